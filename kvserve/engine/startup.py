"""An engine core's parts built from EngineArgs, apart from running them (engine.core): the
device and dtypes, the tensor-parallel ranks, the model, the KV cache plan and its tiers, the
scheduler, the drafter and the CUDA graphs, with the start-up report in the log."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from kvserve.attention.kv_quant import kv_storage_dtype
from kvserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from kvserve.distributed.parallel import SINGLE, TensorParallel, check_split
from kvserve.engine.args import EngineArgs
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
from kvserve.kv_cache.tiers import build_store, cache_fingerprint
from kvserve.models.loader import read_model_config, shard_config
from kvserve.models.paths import resolve_model
from kvserve.scheduler import Scheduler
from kvserve.settings import parse_size
from kvserve.spec_decode import build_drafter
from kvserve.spec_decode.coordinator import SpecCoordinator
from kvserve.structured import GrammarCompiler
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


def _check_tensor_parallel(args: EngineArgs) -> None:
    """Features that keep state only on rank 0 and so cannot work split over ranks."""
    if parse_size(args.host_kv_cache_memory) or args.kv_cache_dir:
        raise ValueError("the host and disk prefix-cache tiers copy one process's KV cache; "
                         "they are not supported with --tensor-parallel-size > 1")
    spec = SpecConfig.parse(args.speculative_config)
    if spec is not None and spec.method == "mtp":
        raise ValueError("the mtp drafter reads the target's full embedding and LM head, "
                         "which tensor parallelism splits; use ngram or draft_model")


def kv_cache_budget(args: EngineArgs, device: torch.device) -> int:
    """--kv-cache-memory in bytes; without it, 1 GiB on a CPU and, on a GPU, what
    --gpu-memory-utilization leaves once the model (and any draft model) is loaded."""
    if args.kv_cache_memory is not None:
        return parse_size(args.kv_cache_memory)
    if device.type != "cuda":
        return 1 << 30
    gc.collect()  # what earlier engines in this process left, handed back to the device
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = gpu_kv_budget(total, free, args.gpu_memory_utilization)
    log.info("KV cache budget %.1f GiB: %.2f of the GPU's %.1f GiB, less %.1f GiB in use after "
             "loading and %.1f GiB kept for activations", budget / 2**30,
             args.gpu_memory_utilization, total / 2**30, (total - free) / 2**30,
             GPU_ACTIVATION_RESERVE / 2**30)
    return budget


def build_parts(args: EngineArgs) -> CoreParts:
    """Resolve the device and dtypes, spawn the tensor-parallel ranks, load this rank's model
    and set up the KV cache, its tiers, the scheduler and the drafter, saying what was built
    in the start-up log. A failure closes the ranks already spawned."""
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
    if device.type == "cuda":
        torch.cuda.set_device(device)  # cuda:N's kernels and allocations, not cuda:0's
    dtype = resolve_dtype(args.dtype, device)
    kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype)
    kv_storage_dtype(kv_cache_dtype, dtype)  # a bad pair refused before loading anything
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    t0 = time.perf_counter()
    workers: TensorParallelWorkers | None = None
    tp = SINGLE
    if args.tensor_parallel_size > 1:
        _check_tensor_parallel(args)
        cfg = read_model_config(path)  # metadata only: refuse a bad split before spawning
        check_split(cfg.num_heads, cfg.num_kv_heads, args.tensor_parallel_size)
        workers = TensorParallelWorkers(
            str(path), dtype, str(device), kv_cache_dtype,
            resolve_quantization(args.quantization, args.dtype),
            args.block_size, args.tensor_parallel_size, args.tp_timeout,
            args.max_model_len)
        tp = workers.tp
        device = workers.device
    elif args.tensor_parallel_size != 1:
        raise ValueError("--tensor-parallel-size must be >= 1")
    try:
        return _build(args, path, dtype, kv_cache_dtype, device, tp, workers, t0)
    except BaseException:
        if workers is not None:
            workers.close(timeout=1.0)
        raise


def _build(args: EngineArgs, path, dtype: torch.dtype, kv_cache_dtype: str,
           device: torch.device, tp: TensorParallel,
           workers: TensorParallelWorkers | None, t0: float) -> CoreParts:
    """build_parts once the device, dtypes and ranks are settled."""
    loaded, quantization = load_target(
        str(path), dtype, device, kv_cache_dtype,
        resolve_quantization(args.quantization, args.dtype), tp, args.max_model_len)
    # `auto` as the attention layers resolved it (kernels.kv_cache_dtype_for)
    kv_cache_dtype = loaded.model.layers[0].self_attn.backend.kv_cache_dtype
    cfg = loaded.config
    if loaded.gguf_reader is not None:
        tokenizer = Tokenizer.from_gguf(path, reader=loaded.gguf_reader)
        # The reader's parsed metadata (a numpy array per vocabulary entry and merge) and
        # its mapped file held ~230 MB measured here; drop it before the KV cache is
        # allocated, which is when resident memory peaks.
        loaded.gguf_reader = None
    else:
        tokenizer = Tokenizer.from_dir(path)
    # the tokenizer's JSON only when a grammar first needs it (slow for a large vocabulary)
    grammars = GrammarCompiler(tokenizer.backend.to_str, cfg.vocab_size,
                                    sorted(tokenizer.eos_token_ids))
    max_len = args.max_model_len or cfg.max_position
    if max_len > cfg.max_position:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's context length "
                         f"{cfg.max_position}")
    targets = args.latency_targets()
    # The default step budget is resolved once the calibration has measured this machine
    # (_resolve_itl_budget); until then, and with --target-itl-ms 0, no ITL target.
    sched = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len,
                            args.short_prompt_steps, targets.ttft_s, targets.itl_s,
                            args.shed_late_requests)
    spec = SpecConfig.parse(args.speculative_config)
    drafter = (build_drafter(spec, loaded.model, path, dtype, device, sched)
               if spec is not None else None)
    cache = CacheConfig(args.block_size, kv_cache_budget(args, device),
                        args.num_kv_blocks, kv_cache_dtype)
    config = EngineConfig(str(path), dtype, device, cache, sched, args.seed)
    extra = drafter.kv_bytes_per_token() if drafter is not None else 0
    # A draft model keeps its K/V at the slots of group 0's table, which must then cover
    # every token: with no whole-context layer to head it, no block is freed early.
    all_windowed = all(cfg.window(i) for i in range(cfg.num_layers))
    free = not args.disable_hybrid_kv_cache_manager and not (extra and all_windowed)
    layout = KVLayout.for_model(cfg, free_windows=free)
    num_blocks = plan_num_blocks(shard_config(cfg, tp), cache, dtype, extra, layout)
    if workers is not None:
        num_blocks = workers.agree_num_blocks(cache, layout, num_blocks)
    runner = ModelRunner(loaded.model, cache, num_blocks, dtype, device, workers,
                              layout)
    store = None
    host_bytes = parse_size(args.host_kv_cache_memory)
    if host_bytes or args.kv_cache_dir:
        if not args.enable_prefix_caching:
            raise ValueError("--host-kv-cache-memory and --kv-cache-dir need prefix caching")
        kv0 = runner.kv_caches[0]
        fingerprint = cache_fingerprint(path, cfg, dtype, (tuple(kv0.shape[:2]), kv0.shape[3],
                                                           str(kv0.dtype), layout),
                                        cache.block_size)
        store = build_store(runner.kv_caches, cache.block_size,
                            host_bytes, args.kv_cache_dir,
                            parse_size(args.kv_cache_disk_size), fingerprint,
                            args.kv_cache_write_policy)
    kv = KVCacheManager(num_blocks, cache.block_size, args.enable_prefix_caching,
                             store, layout)
    scheduler = Scheduler(sched, kv)
    speculation: SpecCoordinator | None = None
    if spec is not None and drafter is not None:
        speculation = SpecCoordinator(spec, drafter, kv)
        runner.keep_hidden = drafter.needs_hidden
        log.info("speculative decoding: %s", spec)
    token_bytes = kv_token_bytes(shard_config(cfg, tp), cache.kv_cache_dtype, dtype)
    per_tok, kv_name = token_bytes.total, dtype_name(token_bytes.storage_dtype)
    log.info("loaded %s (%s, %d layers, %s weights, %s; quantization %s: %s) in %.1fs",
             path.name, cfg.architecture, cfg.num_layers, loaded.weight_format,
             dtype_name(dtype), quantization, loaded.model.weight_kernel(),
             time.perf_counter() - t0)
    variant = loaded.model.batch_variant_parts()
    if variant:
        log.warning("not batch-invariant here: a request's tokens may depend on what else "
                    "runs with it (%s)", "; ".join(variant))
    if layout.hybrid:
        # A block holds one group's layers; a token costs per_tok in the whole-context
        # layers and nothing more in a sliding-window layer once it leaves the window.
        blk = slot_bytes(shard_config(cfg, tp), cache.kv_cache_dtype, dtype, layout)
        log.info("KV cache%s: %d blocks x %d tokens x %d layers, %.2f GiB; %s; a token "
                 "takes %.1f KiB (%s K/V) in every layer, %.1f KiB once older than the "
                 "windows", " (rank 0's heads)" if tp.size > 1 else "", num_blocks,
                 cache.block_size, layout.group_size,
                 num_blocks * cache.block_size * blk / 2**30, layout.describe(),
                 per_tok / 1024, kv_name, blk * layout.group_windows.count(0) / 1024)
    else:
        log.info("KV cache%s: %d blocks x %d tokens = %d tokens, %.1f KiB per token "
                 "(%s K/V), %.2f GiB%s", " (rank 0's heads)" if tp.size > 1 else "",
                 num_blocks, cache.block_size, num_blocks * cache.block_size,
                 per_tok / 1024, kv_name,
                 num_blocks * cache.block_size * per_tok / 2**30,
                 "" if not any(cfg.window(i) for i in range(cfg.num_layers)) else
                 f"; {layout.describe()}" if layout.group_windows[0] else
                 "; blocks before the sliding windows kept")
    if token_bytes.storage_dtype != dtype:
        log.info("%s KV%s: %.2fx the tokens of %s", kv_name,
                 " (--kv-cache-dtype auto)" if args.kv_cache_dtype == "auto" else "",
                 capacity_gain(cfg, cache.kv_cache_dtype, dtype), dtype_name(dtype))
    if device.type == "cuda" and not args.enforce_eager:
        if runner.can_capture_graphs():
            runner.capture_decode_graphs(args.max_num_seqs, max_len)
        else:
            log.info("decode steps run eagerly: CUDA graphs need one rank and attention "
                     "on the Triton kernels (bf16/float16/float32, K/V unquantized)")
    return CoreParts(config=config, model_config=cfg, tokenizer=tokenizer, grammars=grammars,
                     quantization=quantization, kv_layout=layout, runner=runner, kv=kv,
                     scheduler=scheduler, speculation=speculation, workers=workers)
