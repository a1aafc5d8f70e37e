"""The engine core's contract: what LLMEngine and the output processor call of a core, met by
EngineCore in this process and by CoreProcess, which forwards the same calls to an
EngineCore in a child process (--engine-process). The core's parts (KV cache, scheduler,
runner, ...) are not part of it: they exist only in-process (LLMEngine.local_core)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, ModelConfig
    from kvserve.outputs import CoreOutput
    from kvserve.request import Request, RequestStatus
    from kvserve.stats import EngineStats
    from kvserve.worker.tp_workers import TensorParallelWorkers


class Core(Protocol):
    """An engine core as its callers see it. Every call is made from the one thread that
    steps the engine; the facts are fixed once the model has loaded."""

    model_config: ModelConfig
    config: EngineConfig
    quantization: str
    max_model_len: int
    vocab_size: int
    wall_offset: float  # perf_counter -> unix time
    workers: TensorParallelWorkers | None  # the other tensor-parallel ranks (in-process only)
    dead: str | None  # why the core can no longer step, once it cannot

    def check_request(self, req: Request) -> None: ...
    def add_request(self, req: Request) -> None: ...
    def finish_request(self, request_id: str, status: RequestStatus,
                       num_output_tokens: int | None = None, error: str | None = None
                       ) -> CoreOutput | None: ...
    def has_unfinished_requests(self) -> bool: ...
    @property
    def num_unfinished(self) -> int: ...
    def request_status(self, request_id: str) -> tuple[str, list[dict]] | None: ...
    def predicted_ttft(self, num_prompt_tokens: int, max_tokens: int) -> float | None: ...
    def step(self) -> list[CoreOutput]: ...
    def record_step(self) -> None: ...
    def stats(self) -> EngineStats: ...
    def check_health(self) -> str | None: ...
    def check_integrity(self) -> None: ...
    def reset_prefix_cache(self) -> None: ...
    def close(self) -> None: ...


def core_calls() -> frozenset[str]:
    """The names of Core's calls (methods and properties), for a proxy to forward."""
    return frozenset(name for name, value in vars(Core).items()
                     if not name.startswith("_") and (callable(value)
                                                      or isinstance(value, property)))
