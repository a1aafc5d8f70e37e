"""The engine's user-facing configuration."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.slo import LatencyTargets


@dataclass
class EngineArgs:
    """User-facing knobs, named as vLLM names them."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    short_prompt_steps: bool = True
    # latency targets (SchedulerConfig): step sizing under the ITL target, goodput, shedding.
    # target_itl_ms None: the default step budget for steps with decodes (500 ms, or four
    # one-row decode steps where longer: kvserve.slo.default_itl_budget), sizing steps but not
    # counted in goodput; 0: off (the token budget alone sizes steps)
    target_ttft_ms: float | None = None
    target_itl_ms: float | None = None
    shed_late_requests: bool = False  # serving: 429 for requests predicted to miss TTFT
    block_size: int = 16
    # KV cache budget; None: 1 GiB on a CPU, on a GPU what gpu_memory_utilization leaves
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9  # share of a GPU this process may use (vLLM's)
    num_kv_blocks: int | None = None  # exact block count, overriding the memory budget
    kv_cache_dtype: str = "auto"  # "auto" (the compute dtype) or "int8"
    # weight-only quantization: auto (a GGUF's precision class where kvserve's int4/int8
    # kernel runs, unless dtype is float32 by name; else none) | none | int8 | int4 | gguf
    # (a GGUF's matrices read in place in the file's own blocks)
    quantization: str = "auto"
    enable_prefix_caching: bool = True
    # keep blocks before the windows of sliding-window layers (see kv_cache.layout)
    disable_hybrid_kv_cache_manager: bool = False
    host_kv_cache_memory: int | str = 0  # host tier of the prefix cache; 0 = none
    kv_cache_dir: str | None = None  # disk tier of the prefix cache, kept across restarts
    kv_cache_disk_size: int | str = "8GiB"
    kv_cache_write_policy: str = "write-back"  # or "write-through"
    # speculative decoding: JSON string or dict, vLLM's --speculative-config (SpecConfig)
    speculative_config: str | dict | None = None
    timeline_buffer_size: int = 1000  # finished requests whose timelines are kept; 0: off
    step_buffer_size: int = 1000  # recent engine steps kept by the step profiler; 0: off
    # ranks the model is split over (torch.distributed: gloo on CPU, NCCL on CUDA); the KV
    # budget is per rank
    tensor_parallel_size: int = 1
    tp_timeout: float = 60.0  # seconds a collective may wait for a rank before it is failed
    # run the engine core (scheduler, model, KV cache) in a process of its own, behind a pipe
    # (engine.core_process), instead of on the engine thread
    engine_process: bool = False
    # on a GPU, run every step eagerly instead of replaying CUDA graphs for decode steps
    enforce_eager: bool = False
    seed: int = 0

    def latency_targets(self) -> LatencyTargets:
        """--target-ttft-ms and --target-itl-ms as given, in seconds (None: not given, or
        the ITL target off)."""
        s = lambda ms: ms / 1e3 if ms else None  # noqa: E731
        return LatencyTargets(s(self.target_ttft_ms), s(self.target_itl_ms))
