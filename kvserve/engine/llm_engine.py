"""The synchronous engine: add_request / abort_request / step, over its two sides.

`EngineCore` (engine.core) runs the model: scheduler, runner, KV cache, speculative
decoding. `OutputProcessor` (engine.processor) faces callers: tokenization, n > 1 samples,
detokenization, stop strings, outputs and timelines. `LLMEngine` steps the one and hands what
it did to the other; `build_engine` wires them from EngineArgs, and the offline API, the
async engine, the server and the CLI all get their engine from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.engine.args import EngineArgs
from kvserve.engine.core import EngineCore, EngineDeadError
from kvserve.engine.core_api import Core
from kvserve.engine.core_process import CoreProcess
from kvserve.engine.processor import OutputProcessor
from kvserve.engine.startup import create_config
from kvserve.outputs import OutputKind, RequestOutput
from kvserve.sample.sampling_params import SamplingParams
from kvserve.stats import EngineStats
from kvserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, ModelConfig
    from kvserve.worker.tp_workers import TensorParallelWorkers

__all__ = ["EngineArgs", "EngineDeadError", "LLMEngine", "build_engine"]


def build_engine(args: EngineArgs) -> LLMEngine:
    """Load the model and set up both sides of an engine: the core on this thread, or with
    `engine_process` in a child process (which loads the model while this one loads the
    tokenizer)."""
    config = create_config(args)  # every setting checked before anything is loaded
    if not args.engine_process:
        core = EngineCore(config)
        return LLMEngine(core, OutputProcessor(core, core.tokenizer, args.timeline_buffer_size))
    proc = CoreProcess(config)
    try:
        tokenizer = Tokenizer.load(config.model_path)
        proc.wait_ready()
    except BaseException:
        proc.close()
        raise
    return LLMEngine(proc, OutputProcessor(proc, tokenizer, args.timeline_buffer_size))


class LLMEngine:
    """One engine, stepped by one thread. Its core is any `Core` (engine.core_api): in this
    process, its parts are `local_core`'s, for tools and tests on that thread; readers
    elsewhere use the snapshots of `stats()` (published by AsyncEngine)."""

    def __init__(self, core: Core, processor: OutputProcessor) -> None:
        self.core = core
        self.processor = processor
        self.tokenizer = processor.tokenizer

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    output_kind: OutputKind = OutputKind.CUMULATIVE) -> str:
        """See OutputProcessor.add_request."""
        return self.processor.add_request(request_id, prompt, params, arrival_time,
                                          cache_salt, output_kind)

    def add_requests(self, requests, arrival_time: float | None = None,
                     cache_salt: str | None = None,
                     output_kind: OutputKind = OutputKind.CUMULATIVE,
                     admit=None) -> list[str]:
        """See OutputProcessor.add_requests: all of them or none."""
        return self.processor.add_requests(requests, arrival_time, cache_salt, output_kind,
                                           admit)

    def abort_request(self, request_id: str, error: str | None = None) -> bool:
        """See OutputProcessor.abort_request."""
        return self.processor.abort_request(request_id, error)

    def step(self) -> list[RequestOutput]:
        """Run one batch and return the outputs of the requests it touched (and of those
        aborted since the last step). See EngineCore.step for how failures are confined."""
        outputs = self.processor.process(self.core.step())
        self.core.record_step()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests() or self.core.has_unfinished_requests()

    @property
    def num_unfinished(self) -> int:
        return self.processor.num_unfinished

    def stats(self) -> EngineStats:
        return self.core.stats()

    def request_timeline(self, request_id: str) -> dict | None:
        return self.processor.request_timeline(request_id)

    def dashboard_state(self, recent: int = 20) -> dict:
        """The engine's side of the dashboard (JSON-ready): batch, KV pool and tiers, prefix
        cache, speculation, and the newest requests' waterfall segments. Call it on the thread
        that steps the engine."""
        return {**self.core.stats().as_json(),
                "recent": self.processor.recent_timelines(recent)}

    def check_health(self) -> str | None:
        return self.core.check_health()

    def close(self) -> None:
        self.core.close()

    def reset_prefix_cache(self) -> None:
        """See EngineCore.reset_prefix_cache; call it on the thread that steps the engine."""
        self.core.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.core.check_integrity()

    # The core's facts, whichever core it is.

    @property
    def dead(self) -> str | None:
        return self.core.dead

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def quantization(self) -> str:
        return self.core.quantization

    @property
    def workers(self) -> TensorParallelWorkers | None:
        return self.core.workers

    @property
    def local_core(self) -> EngineCore:
        """The core in this process, whose parts (`kv`, `kv_layout`, `scheduler`, `runner`,
        `speculation`, `steps`) tools and tests read on the stepping thread. Under
        --engine-process they live in the child, and this says so."""
        if not isinstance(self.core, EngineCore):
            raise RuntimeError("the engine core runs in a process of its own "
                               "(--engine-process): its parts are not in this process")
        return self.core
