"""An engine core's parts built from EngineArgs, apart from running them (engine.core): the
device and dtypes, the tensor-parallel ranks, the model, the KV cache plan and its tiers, the
scheduler, the drafter and the CUDA graphs, with the start-up report in the log."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.attention.kv_quant import kv_storage_dtype
from kvserve.config import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_max_model_len,
)
from kvserve.distributed.parallel import SINGLE, TensorParallel, check_split
from kvserve.engine.args import EngineArgs
from kvserve.kv_cache.events import KVEventLog
from kvserve.kv_cache.layout import KVLayout
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.planner import (
    GPU_ACTIVATION_RESERVE,
    capacity_gain,
    dtype_name,
    gpu_kv_budget,
    kv_token_bytes,
    plan_num_blocks,
    slot_bytes,
)
from kvserve.kv_cache.tiers import TieredKVStore, build_store, cache_fingerprint
from kvserve.models.loader import read_model_config, shard_config
from kvserve.models.paths import resolve_model
from kvserve.sample.structured import GrammarCompiler
from kvserve.sched.scheduler import Scheduler
from kvserve.sched.slo import LatencyTargets, StepShape
from kvserve.settings import parse_size
from kvserve.spec_decode import build_drafter
from kvserve.spec_decode.coordinator import SpecCoordinator
from kvserve.tokenizer import Tokenizer
from kvserve.worker.model_runner import ModelRunner, load_target, resolve_quantization
from kvserve.worker.tp_workers import TensorParallelWorkers

log = logging.getLogger(__name__)


@dataclass
class CoreParts:
    """What an EngineCore runs, as build_parts made it."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    grammars: GrammarCompiler
    quantization: str  # the weights' form as loaded (--quantization resolved)
    kv_layout: KVLayout
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    speculation: SpecCoordinator | None
    workers: TensorParallelWorkers | None  # the other ranks, with --tensor-parallel-size > 1


@dataclass(frozen=True)
class StartupConfig:
    """EngineArgs checked once and resolved as far as they go before the model is read:
    what build_parts and EngineCore take. `args` keeps the settings as given (the sizes and
    switches the parts read as they are); the fields beside it are the ones that needed
    parsing or resolving, so no part parses a setting again."""

    args: EngineArgs
    model_path: Path
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: str  # resolve_kv_cache_dtype's: `auto` is left to the attention layers
    quantization: str  # resolve_quantization's: `auto` is left to load_target
    spec: SpecConfig | None
    targets: LatencyTargets
    kv_cache_memory: int | None  # bytes; None: kv_cache_budget's default
    host_kv_cache_memory: int  # bytes; 0: no host tier
    kv_cache_disk_size: int  # bytes
    kv_events: KVEventsConfig | None = None  # None: no KV-cache events collected


def create_config(args: EngineArgs) -> StartupConfig:
    """Validate `args` as a whole, before anything is spawned or loaded, and resolve what
    does not need the model: the device, the dtypes, the sizes, the speculative config and
    the latency targets. What needs the model's own config (--max-model-len against its
    context, a tensor-parallel split of its heads) is checked as soon as it is read."""
    if args.timeline_buffer_size < 0 or args.step_buffer_size < 0:
        raise ValueError("timeline and step buffer sizes must be >= 0")
    if args.data_parallel_rank < 0:
        raise ValueError("--data-parallel-rank must be >= 0")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise ValueError(f"device {args.device!r} is not cpu, cuda or cuda:N") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {args.device!r} is not cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} requested but no CUDA device is "
                         f"available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {args.device}: only {torch.cuda.device_count()} CUDA "
                         f"device(s) visible")
    dtype = resolve_dtype(args.dtype, device)
    kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype)
    kv_storage_dtype(kv_cache_dtype, dtype)  # a bad pair refused before loading anything
    spec = SpecConfig.parse(args.speculative_config)
    kv_events = KVEventsConfig.parse(args.kv_events_config)
    if kv_events is not None and not kv_events.enabled:
        kv_events = None  # vLLM's rule: any publisher, events off unless enabled
    if kv_events is not None:
        kv_events = kv_events.for_rank(args.data_parallel_rank)
    if kv_events is not None and not args.enable_prefix_caching:
        raise ValueError("--kv-events-config: KV-cache events describe the prefix cache; "
                         "they need prefix caching (drop --no-enable-prefix-caching)")
    host_bytes = parse_size(args.host_kv_cache_memory)
    if (host_bytes or args.kv_cache_dir) and not args.enable_prefix_caching:
        raise ValueError("--host-kv-cache-memory and --kv-cache-dir need prefix caching")
    if args.tensor_parallel_size < 1:
        raise ValueError("--tensor-parallel-size must be >= 1")
    if args.tensor_parallel_size > 1:
        _check_tensor_parallel(args, spec, host_bytes)
    return StartupConfig(
        args=args, model_path=resolve_model(args.model), device=device, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        quantization=resolve_quantization(args.quantization, args.dtype), spec=spec,
        targets=args.latency_targets(),
        kv_cache_memory=(parse_size(args.kv_cache_memory)
                         if args.kv_cache_memory is not None else None),
        host_kv_cache_memory=host_bytes,
        kv_cache_disk_size=parse_size(args.kv_cache_disk_size), kv_events=kv_events)


def _check_tensor_parallel(args: EngineArgs, spec: SpecConfig | None, host_bytes: int) -> None:
    """Features that keep state only on rank 0 and so cannot work split over ranks."""
    if args.engine_process:
        raise ValueError("--engine-process does not support --tensor-parallel-size > 1")
    if host_bytes or args.kv_cache_dir:
        raise ValueError("the host and disk prefix-cache tiers copy one process's KV cache; "
                         "they are not supported with --tensor-parallel-size > 1")
    if spec is not None and spec.method == "mtp":
        raise ValueError("the mtp drafter reads the target's full embedding and LM head, "
                         "which tensor parallelism splits; use ngram or draft_model")


def kv_cache_budget(kv_cache_memory: int | None, device: torch.device,
                    utilization: float) -> int:
    """--kv-cache-memory in bytes; without it, 1 GiB on a CPU and, on a GPU, what
    --gpu-memory-utilization leaves once the model (and any draft model) is loaded."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type != "cuda":
        return 1 << 30
    gc.collect()  # what earlier engines in this process left, handed back to the device
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = gpu_kv_budget(total, free, utilization)
    log.info("KV cache budget %.1f GiB: %.2f of the GPU's %.1f GiB, less %.1f GiB in use after "
             "loading and %.1f GiB kept for activations", budget / 2**30, utilization,
             total / 2**30, (total - free) / 2**30, GPU_ACTIVATION_RESERVE / 2**30)
    return budget


def build_parts(config: StartupConfig) -> CoreParts:
    """Spawn the tensor-parallel ranks, load this rank's model and set up the KV cache, its
    tiers, the scheduler and the drafter, saying what was built in the start-up log. A
    failure closes the ranks already spawned."""
    args, device = config.args, config.device
    if device.type == "cuda":
        torch.cuda.set_device(device)  # cuda:N's kernels and allocations, not cuda:0's
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    workers: TensorParallelWorkers | None = None
    tp = SINGLE
    if args.tensor_parallel_size > 1:
        cfg = read_model_config(config.model_path)  # metadata only: refuse a bad split first
        check_split(cfg.num_heads, cfg.num_kv_heads, args.tensor_parallel_size)
        workers = TensorParallelWorkers(
            str(config.model_path), config.dtype, str(device), config.kv_cache_dtype,
            config.quantization, args.block_size, args.tensor_parallel_size, args.tp_timeout,
            args.max_model_len)
        tp = workers.tp
        device = workers.device
    try:
        return _build(config, device, tp, workers, t0)
    except BaseException:
        if workers is not None:
            workers.close(timeout=1.0)
        raise


def _build(config: StartupConfig, device: torch.device, tp: TensorParallel,
           workers: TensorParallelWorkers | None, t0: float) -> CoreParts:
    """build_parts once the ranks are spawned: `device` is this rank's."""
    args, path, dtype = config.args, config.model_path, config.dtype
    loaded, quantization = load_target(str(path), dtype, device, config.kv_cache_dtype,
                                       config.quantization, tp, args.max_model_len)
    # `auto` as the attention layers resolved it (kernels.kv_cache_dtype_for)
    kv_cache_dtype = loaded.model.layers[0].self_attn.backend.kv_cache_dtype
    cfg = loaded.config
    if loaded.gguf_reader is not None:
        tokenizer = Tokenizer.from_gguf(path, reader=loaded.gguf_reader)
        # The reader's parsed metadata (a numpy array per vocabulary entry and merge) and
        # its mapped file are large for a big vocabulary; drop them before the KV cache is
        # allocated, which is when resident memory peaks.
        loaded.gguf_reader = None
    else:
        tokenizer = Tokenizer.from_dir(path)
    # the tokenizer's JSON only when a grammar first needs it (slow for a large vocabulary)
    grammars = GrammarCompiler(tokenizer.backend.to_str, cfg.vocab_size,
                               sorted(tokenizer.eos_token_ids))
    # The default step budget is resolved once the calibration has measured this machine
    # (engine.calibration); until then, and with --target-itl-ms 0, no ITL target.
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=resolve_max_model_len(args.max_model_len, cfg),
        short_prompt_steps=args.short_prompt_steps, target_ttft_s=config.targets.ttft_s,
        target_itl_s=config.targets.itl_s, shed_late_requests=args.shed_late_requests)
    spec = config.spec
    drafter = (build_drafter(spec, loaded.model, path, dtype, device, sched)
               if spec is not None else None)
    cache = CacheConfig(block_size=args.block_size, kv_cache_memory=kv_cache_budget(
                            config.kv_cache_memory, device, args.gpu_memory_utilization),
                        num_blocks=args.num_kv_blocks, kv_cache_dtype=kv_cache_dtype)
    engine_config = EngineConfig(model=str(path), dtype=dtype, device=device, cache=cache,
                                 scheduler=sched, seed=args.seed)
    extra = drafter.kv_bytes_per_token() if drafter is not None else 0
    # A draft model keeps its K/V at the slots of group 0's table, which must then cover
    # every token: with no whole-context layer to head it, no block is freed early.
    all_windowed = all(cfg.window(i) for i in range(cfg.num_layers))
    free = not args.disable_hybrid_kv_cache_manager and not (extra and all_windowed)
    layout = KVLayout.for_model(cfg, free_windows=free)
    num_blocks = plan_num_blocks(shard_config(cfg, tp), cache, dtype, extra, layout)
    if workers is not None:
        num_blocks = workers.agree_num_blocks(cache, layout, num_blocks)
    runner = ModelRunner(loaded.model, cache, num_blocks, dtype, device, workers, layout)
    events = KVEventLog(cache.block_size) if config.kv_events is not None else None
    kv = KVCacheManager(num_blocks, cache.block_size, args.enable_prefix_caching,
                        _prefix_store(config, runner, cfg, layout), layout, events)
    scheduler = Scheduler(sched, kv)
    speculation: SpecCoordinator | None = None
    if spec is not None and drafter is not None:
        # scheduler.cost read at each call: calibration puts a fitted model in its place.
        speculation = SpecCoordinator(
            spec, drafter, kv, lambda rows: scheduler.cost.predict(StepShape(0, rows, 0)))
        runner.keep_hidden = drafter.needs_hidden
        log.info("speculative decoding: %s", spec)
    log.info("loaded %s (%s, %d layers, %s weights, %s; quantization %s: %s) in %.1fs",
             path.name, cfg.architecture, cfg.num_layers, loaded.weight_format,
             dtype_name(dtype), quantization, loaded.model.weight_kernel(),
             time.perf_counter() - t0)
    if cfg.num_experts:
        log.info("mixture of experts: %d experts, %d a token%s%s, in %d of %d layers",
                 cfg.num_experts, cfg.num_experts_per_tok,
                 " (weights renormalized)" if cfg.norm_topk_prob else "",
                 " and a shared expert" if cfg.shared_expert_intermediate_size else "",
                 cfg.num_layers - len(cfg.dense_layers), cfg.num_layers)
    variant = loaded.model.batch_variant_parts()
    if variant:
        log.warning("not batch-invariant here: a request's tokens may depend on what else "
                    "runs with it (%s)", "; ".join(variant))
    _log_kv_cache(config, shard_config(cfg, tp), cache, layout, num_blocks, tp.size > 1)
    if device.type == "cuda" and not args.enforce_eager:
        if runner.can_capture_graphs():
            runner.capture_decode_graphs(args.max_num_seqs, sched.max_model_len)
        else:
            log.info("decode steps run eagerly: CUDA graphs need one rank, attention "
                     "on the Triton kernels (bf16/float16/float32, K/V unquantized) and no "
                     "experts")
    return CoreParts(config=engine_config, model_config=cfg, tokenizer=tokenizer,
                     grammars=grammars, quantization=quantization, kv_layout=layout,
                     runner=runner, kv=kv, scheduler=scheduler, speculation=speculation,
                     workers=workers)


def _prefix_store(config: StartupConfig, runner: ModelRunner, cfg: ModelConfig,
                  layout: KVLayout) -> TieredKVStore | None:
    """The host and disk tiers under the prefix cache, when asked for."""
    args = config.args
    if not (config.host_kv_cache_memory or args.kv_cache_dir):
        return None
    kv0 = runner.kv_caches[0]
    fingerprint = cache_fingerprint(
        config.model_path, cfg, config.dtype,
        (tuple(kv0.shape[:2]), kv0.shape[3], str(kv0.dtype), layout), args.block_size)
    return build_store(runner.kv_caches, args.block_size, config.host_kv_cache_memory,
                       args.kv_cache_dir, config.kv_cache_disk_size, fingerprint,
                       args.kv_cache_write_policy)


def _log_kv_cache(config: StartupConfig, cfg: ModelConfig, cache: CacheConfig,
                  layout: KVLayout, num_blocks: int, sharded: bool) -> None:
    """The start-up report's lines on the KV cache: its blocks, what a token costs in them
    and, with 16-bit or int8 K/V under wider activations, the capacity that gives.
    `cfg` is this rank's share of the model (shard_config)."""
    dtype = config.dtype
    token_bytes = kv_token_bytes(cfg, cache.kv_cache_dtype, dtype)
    per_tok, kv_name = token_bytes.total, dtype_name(token_bytes.storage_dtype)
    rank0 = " (rank 0's heads)" if sharded else ""
    if layout.hybrid:
        # A block holds one group's layers; a token costs per_tok in the whole-context
        # layers and nothing more in a sliding-window layer once it leaves the window.
        blk = slot_bytes(cfg, cache.kv_cache_dtype, dtype, layout)
        log.info("KV cache%s: %d blocks x %d tokens x %d layers, %.2f GiB; %s; a token "
                 "takes %.1f KiB (%s K/V) in every layer, %.1f KiB once older than the "
                 "windows", rank0, num_blocks, cache.block_size, layout.group_size,
                 num_blocks * cache.block_size * blk / 2**30, layout.describe(),
                 per_tok / 1024, kv_name, blk * layout.group_windows.count(0) / 1024)
    else:
        windowed = any(cfg.window(i) for i in range(cfg.num_layers))
        log.info("KV cache%s: %d blocks x %d tokens = %d tokens, %.1f KiB per token "
                 "(%s K/V), %.2f GiB%s", rank0, num_blocks, cache.block_size,
                 num_blocks * cache.block_size, per_tok / 1024, kv_name,
                 num_blocks * cache.block_size * per_tok / 2**30,
                 "" if not windowed else f"; {layout.describe()}"
                 if layout.group_windows[0] else "; blocks before the sliding windows kept")
    if token_bytes.storage_dtype != dtype:
        log.info("%s KV%s: %.2fx the tokens of %s", kv_name,
                 " (--kv-cache-dtype auto)" if config.args.kv_cache_dtype == "auto" else "",
                 capacity_gain(cfg, cache.kv_cache_dtype, dtype), dtype_name(dtype))
