"""The engine's user-facing configuration: each EngineArgs field is one setting, declared
once with its flag's help, choices and parser (kvserve.settings), so `kvserve serve`,
`generate`, `chat`, `plan`, `roofline` and `train-mtp` all build their engine flags from
it."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.models.paths import DEFAULT_MODEL
from kvserve.settings import (
    add_fields_as_flags,
    device_arg,
    fields_from_flags,
    fraction,
    itl_target,
    positive_float,
    setting,
)

if TYPE_CHECKING:
    from kvserve.sched.slo import LatencyTargets


@dataclass
class EngineArgs:
    """User-facing knobs, named as vLLM names them; each field (but the Python API's own,
    cli=False) is also a flag of the `engine` group (add_cli_args)."""

    model: str | None = setting(
        None, f"short name, .gguf file or Hugging Face directory (default: {DEFAULT_MODEL})")
    dtype: str = setting("auto", "compute dtype; auto: bfloat16 on a GPU or a CPU with native "
                                 "bf16 (AVX512-BF16, AMX), else float32",
                         choices=["auto", "float32", "bfloat16", "float16"])
    device: str = setting("cpu", "cpu, cuda or cuda:N (tensor-parallel rank r on cuda:N+r)",
                          parse=device_arg)
    max_model_len: int | None = setting(
        None, "prompt + max_tokens limit (default: the model's context length)")
    max_num_seqs: int = setting(64, "most requests in one step")
    max_num_batched_tokens: int = setting(512, "token budget of one step (prompt chunks + "
                                               "decodes)")
    short_prompt_steps: bool = setting(
        True, "prompt work of at most a quarter of the budget (a question after a cached "
              "prefix, a prompt's last chunk) runs in steps of its own, between normal steps: "
              "earlier first tokens at a small cost in time per output token")
    # latency targets (SchedulerConfig): step sizing under the ITL target, goodput, shedding
    target_ttft_ms: float | None = setting(
        None, "time-to-first-token target: goodput counts requests within it (and "
              "--target-itl-ms); with --shed-late-requests the server refuses (429) requests "
              "predicted to miss it", parse=positive_float, metavar="MS")
    target_itl_ms: float | None = setting(
        None, "inter-token latency target (checked as time per output token): each step's "
              "prompt work and the admission of new requests are sized by a step cost model, "
              "calibrated at start-up and fitted online, so that decode steps stay within it "
              "(default: a 500 ms step budget, or four one-row decode steps where longer, not "
              "counted as a goodput target; 0 or off: steps sized by the token budget alone)",
        parse=itl_target, metavar="MS|off")
    shed_late_requests: bool = setting(
        False, "serve: answer 429 (with Retry-After) at once to a request predicted to miss "
               "--target-ttft-ms, instead of queueing it")
    block_size: int = setting(16, "tokens per KV block")
    kv_cache_memory: int | str | None = setting(
        None, "KV cache budget, e.g. 2GiB (default: 1GiB on a CPU; on a GPU what "
              "--gpu-memory-utilization leaves after loading)")
    gpu_memory_utilization: float = setting(
        0.9, "on a GPU without --kv-cache-memory: the share of the device this process may "
             "use in all (weights, KV cache, activations)", parse=fraction)
    num_kv_blocks: int | None = setting(
        None, "exact KV block count, overriding the memory budget", cli=False)
    kv_cache_dtype: str = setting(
        "auto", "how K/V are stored: auto = float16 where the CPU kernel reads it under "
                "float32 activations (AVX2), unless --dtype float32 is given; else the compute "
                "dtype. float16/bfloat16 under float32 activations halve a token's bytes; "
                "int8 = per-token, per-head quantized K/V (~1.9x the tokens of a 16-bit cache)",
        choices=["auto", "float32", "bfloat16", "float16", "int8"])
    quantization: str = setting(
        "auto", "weight-only int8/int4 quantization (CPU); auto keeps a GGUF's precision "
                "class (Q4_1 -> int4) where kvserve's int4/int8 kernel runs (AVX512-VNNI or "
                "AVX2), unless --dtype float32 is given; else none; gguf reads a GGUF's "
                "matrices in place in the file's own blocks (its bytes and memory, slower "
                "kernels for now)",
        choices=["auto", "none", "int8", "int4", "gguf"])
    enable_prefix_caching: bool = setting(True, "reuse K/V of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = setting(
        False, "keep the blocks of sliding-window layers that fall before their window (by "
               "default they are handed back while a request runs)")
    host_kv_cache_memory: int | str = setting(
        0, "host-memory tier of the prefix cache, e.g. 4GiB (default: none)")
    kv_cache_dir: str | None = setting(
        None, "disk tier of the prefix cache; survives restarts (default: none)")
    kv_cache_disk_size: int | str = setting("8GiB", "disk tier budget")
    kv_cache_write_policy: str = setting(
        "write-back", "copy blocks to lower tiers when evicted, or as soon as computed",
        choices=["write-back", "write-through"])
    # a JSON string or a dict, vLLM's --speculative-config (SpecConfig)
    speculative_config: str | dict | None = setting(
        None, 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": '
              '3}\'; methods ngram, draft_model, mtp', metavar="JSON")
    # a JSON string or a dict (or a KVEventsConfig), vLLM's --kv-events-config
    kv_events_config: str | dict | None = setting(
        None, "publish KV-cache events (blocks stored and removed, per medium) as vLLM "
              "does, for KV-aware routers, e.g. '{\"enable_kv_cache_events\": true, "
              "\"endpoint\": \"tcp://*:5557\"}'; fields: enable_kv_cache_events, publisher "
              "(zmq, null), endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, "
              "topic", metavar="JSON")
    data_parallel_rank: int = setting(
        0, "this engine's rank among data-parallel replicas (vLLM's flag): its KV-event "
           "batches carry it, and its --kv-events-config endpoints' ports are offset by it "
           "(set for each replica under --data-parallel-size)")
    timeline_buffer_size: int = setting(
        1000, "finished requests whose timelines stay available (0: none)")
    step_buffer_size: int = setting(1000, "recent engine steps kept by the step profiler "
                                          "(0: none)")
    tensor_parallel_size: int = setting(
        1, "split the model over N ranks (processes on CPU, GPUs on CUDA) with "
           "torch.distributed; --kv-cache-memory is then per rank", aliases=("-tp",))
    tp_timeout: float = setting(
        60.0, "seconds a tensor-parallel collective waits for a rank before the engine fails "
              "(a dead or hung rank)")
    engine_process: bool = setting(
        False, "run the engine core (scheduler, model, KV cache) in a process of its own, "
               "behind a pipe, instead of on the engine thread")
    enforce_eager: bool = setting(
        False, "on a GPU, run decode steps eagerly instead of as CUDA graphs")
    seed: int = setting(0, "the engine's seed (requests carry their own)", cli=False)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, only: Iterable[str] | None = None,
                     defaults: dict[str, Any] | None = None) -> argparse._ArgumentGroup:
        """The `engine` flag group: every setting (or those in `only`), from the fields."""
        group = parser.add_argument_group("engine")
        add_fields_as_flags(cls, group, only, defaults)
        return group

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return fields_from_flags(cls, ns)

    def latency_targets(self) -> LatencyTargets:
        """--target-ttft-ms and --target-itl-ms as given, in seconds (None: not given, or
        the ITL target off)."""
        from kvserve.sched.slo import LatencyTargets

        s = lambda ms: ms / 1e3 if ms else None  # noqa: E731
        return LatencyTargets(s(self.target_ttft_ms), s(self.target_itl_ms))

