"""`kvserve plan`, `kvserve roofline`, `kvserve train-mtp` and `kvserve cache`: sizing a model
for this machine, training its drafter, and the start-up weight cache."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.entrypoints.cli.common import add_engine_args, ensure_default_model
from kvserve.models.paths import resolve_model

if TYPE_CHECKING:
    from kvserve.models.cache_budget import StoredEntry


def add_parsers(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser("plan", help="KV cache memory plan from the model's config alone")
    add_engine_args(pl, ["model", "kv_cache_memory", "dtype", "device", "block_size",
                         "max_model_len", "max_num_batched_tokens",
                         "disable_hybrid_kv_cache_manager"], {"kv_cache_memory": "1GiB"},
                    no_download=False)
    pl.add_argument("--prompt-len", type=int, default=1024)
    pl.add_argument("--output-len", type=int, default=128)
    pl.add_argument("--bandwidth", type=float, default=None, metavar="GB/S",
                    help="memory read bandwidth for the decode floor (default: measured "
                         "here, a streaming sum of 512 MiB)")
    pl.set_defaults(func=cmd_plan)

    r = sub.add_parser("roofline", help="this machine's ceilings and where the model's "
                                        "decode and prefill steps sit against them")
    add_engine_args(r, ["model", "dtype", "quantization", "kv_cache_memory"],
                    {"kv_cache_memory": "1GiB"})
    r.add_argument("--batches", default="1,8,32,128", help="decode batch sizes")
    r.add_argument("--prefill", type=int, default=512, help="prefill chunk (0: none)")
    r.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--plot", default=None, metavar="PNG", help="also draw the roofline there")
    r.set_defaults(func=cmd_roofline)

    t = sub.add_parser("train-mtp", help="train a multi-token-prediction drafter on the "
                                         "model's own generations")
    add_engine_args(t, ["model"], no_download=False)
    t.add_argument("--output", default="mtp.safetensors", help="where to save the module")
    t.add_argument("--num-prompts", type=int, default=1024)
    t.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    t.add_argument("--epochs", type=int, default=6)
    t.add_argument("--batch-size", type=int, default=256)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--prompts", default=None, metavar="FILE",
                   help="train on these prompts instead of the built-in set: one a line, or "
                        "JSON Lines of {\"prompt\": ...} for a .jsonl file (a tenth held out)")
    t.add_argument("--generations", default=None, metavar="FILE",
                   help="the target's answers: read from FILE when it exists (skipping the "
                        "generation, the longest stage), else written there")
    t.add_argument("--intermediate", type=int, default=None,
                   help="the module's SwiGLU width (default: 4x the hidden size)")
    t.add_argument("--draft-vocab", type=int, default=8192,
                   help="tokens the draft head scores, the most frequent in the data "
                        "(0: the whole vocabulary)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--no-download", action="store_true",
                   help="fail instead of installing a missing default model")
    t.set_defaults(func=cmd_train_mtp)

    ca = sub.add_parser("cache", help="the start-up weight cache: list or clear its entries",
                        description="The weight cache under $KVSERVE_CACHE_DIR/weights. Its "
                        "budget: KVSERVE_WEIGHT_CACHE_BUDGET (all entries, default 4GiB) and "
                        "KVSERVE_WEIGHT_CACHE_MODEL_BUDGET (one model's entries: a size, or a "
                        "multiple of the model file's size, default 1x, at least 256MiB).")
    cache_sub = ca.add_subparsers(dest="cache_command", required=True, metavar="{list,clear}")
    cl = cache_sub.add_parser("list", help="each entry's model file, size, last use and "
                                           "whether this kvserve can use it; total vs budget")
    cl.set_defaults(func=cmd_cache_list)
    cc = cache_sub.add_parser("clear", help="remove every entry (or only stale ones)")
    cc.add_argument("--stale", action="store_true",
                    help="only entries this kvserve cannot start from: model file gone or "
                         "changed, made by another kvserve version or kernels build, damaged")
    cc.set_defaults(func=cmd_cache_clear)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print what the KV budget holds for the model, per KV dtype, from its config alone."""
    import torch

    from kvserve import kernels
    from kvserve.config import resolve_dtype, resolve_kv_cache_dtype, resolve_max_model_len
    from kvserve.kv_cache.layout import KVLayout
    from kvserve.kv_cache.planner import (
        capacity_gain,
        dtype_name,
        plan_kv,
    )
    from kvserve.models.loader import read_model_config
    from kvserve.settings import parse_size

    budget = parse_size(args.kv_cache_memory)
    for name in ("prompt_len", "output_len"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    path = resolve_model(args.model)
    cfg = read_model_config(path)
    dtype = resolve_dtype(args.dtype, torch.device(args.device))
    max_len = resolve_max_model_len(args.max_model_len, cfg)
    seq_len = args.prompt_len + args.output_len
    if seq_len > max_len:
        raise ValueError(f"--prompt-len + --output-len = {seq_len} exceeds max_model_len "
                         f"{max_len}")
    if seq_len == 0:
        raise ValueError("--prompt-len + --output-len must be > 0")
    if args.max_num_batched_tokens < 1:
        raise ValueError("--max-num-batched-tokens must be >= 1")
    layout = KVLayout.for_model(cfg, free_windows=not args.disable_hybrid_kv_cache_manager)
    chunk = args.max_num_batched_tokens
    # The compute dtype, a 16-bit cache under float32 activations, int8.
    kvs = ["auto", *(["float16"] if dtype == torch.float32 else []), "int8"]
    plans = [plan_kv(cfg, budget, args.block_size, kv, dtype, seq_len, layout, chunk)
             for kv in kvs]
    full = [plan_kv(cfg, budget, args.block_size, kv, dtype, max_len, layout, chunk)
            for kv in kvs]
    # What the engine's --kv-cache-dtype auto stores here (loads the kernels to ask them).
    picked = kernels.kv_cache_dtype_for(resolve_kv_cache_dtype("auto", args.dtype), dtype,
                                        torch.device(args.device), cfg.head_dim)
    auto = plans[0] if picked in ("auto", "float32") else plans[kvs.index(picked)]
    mib = 2**20
    print(f"model: {cfg.name or path.name} ({cfg.architecture}): {cfg.num_layers} layers, "
          f"{cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, head dim {cfg.head_dim}, "
          f"context {cfg.max_position}" + (
              f", {cfg.num_experts} experts ({cfg.num_experts_per_tok} a token)"
              if cfg.num_experts else ""))
    resident = _print_weights(args, cfg, path, dtype)
    print(f"KV budget: {budget:,} B ({budget / mib:.1f} MiB), blocks of {args.block_size} "
          f"tokens; a sequence = {args.prompt_len} prompt + {args.output_len} output = "
          f"{seq_len} tokens = {plans[0].blocks_per_seq} blocks\n")
    print(f"{'KV dtype':<10}{'bytes/token':>12}{'blocks':>10}{'tokens':>10}{'KV MiB':>10}"
          f"{'+ weights MiB':>15}{f'seqs of {seq_len}':>15}{f'seqs of {max_len}':>15}")
    for p, f in zip(plans, full, strict=True):
        tb = p.token_bytes
        print(f"{dtype_name(tb.storage_dtype):<10}{tb.total:>12}{p.num_blocks:>10}"
              f"{p.num_tokens:>10}{p.kv_bytes / mib:>10.1f}"
              f"{(p.kv_bytes + resident) / mib:>15.1f}"
              f"{p.max_seqs:>15}{f.max_seqs:>15}")
    print()
    for p in plans:
        print(f"{dtype_name(p.token_bytes.storage_dtype)}: {p.token_bytes.breakdown()} per token")
    why = ("float32 asked for by name keeps the cache exact" if picked == "float32" else
           "the CPU kernel widens it as it reads, under float32 activations"
           if picked == "float16" else "no kernel here reads a 16-bit cache under float32"
           if dtype == torch.float32 else "the compute dtype")
    print(f"--kv-cache-dtype auto: {dtype_name(auto.token_bytes.storage_dtype)} here ({why})")
    if any(layout.group_windows):
        _print_windows(args, cfg, dtype, layout, auto, seq_len, max_len, budget)
    for p in plans[1:]:
        seqs = f"{p.max_seqs / plans[0].max_seqs:.2f}x" if plans[0].max_seqs else "n/a"
        kv = p.token_bytes.kv_cache_dtype
        print(f"{kv} holds {capacity_gain(cfg, kv, dtype):.2f}x the tokens of "
              f"{dtype_name(dtype)} ({seqs} the sequences of {seq_len} tokens)")
    return 0


MOE_BATCH = 32  # plan's middle figure of what an MoE model's decode step reads


def _print_weights(args: argparse.Namespace, cfg, path: Path, dtype) -> int:
    """`plan`'s weights lines and its decode floor: the bytes held and read a token, as
    --quantization auto and gguf hold a GGUF's matrices. Returns the bytes held."""
    from kvserve.kv_cache.planner import dtype_name, param_count, weight_bytes
    from kvserve.models.gguf_file import WeightBytes, gguf_weight_bytes

    mib = 2**20
    held = gguf_weight_bytes(path, dtype, in_place=False)
    if held is None:
        print(f"weights: {param_count(cfg):,} parameters = "
              f"{weight_bytes(cfg, dtype) / mib:.1f} MiB in {dtype_name(dtype)}")
        _print_decode_floor(args, weight_bytes(cfg, dtype), None)
        return weight_bytes(cfg, dtype)
    mapped = gguf_weight_bytes(path, dtype, in_place=True)
    assert mapped is not None
    pages = f" ({held.in_place / mib:.1f} MiB of it the file's pages)" if held.in_place else ""
    def reads(b: WeightBytes) -> str:
        if b.one_token == b.per_token:
            return f"a decode step reads {b.per_token / mib:.1f} MiB"
        return (f"a decode step of one token reads {b.one_token / mib:.1f} MiB "
                f"({cfg.num_experts_per_tok} of {cfg.num_experts} experts a layer), "
                f"{b.reads(MOE_BATCH) / mib:.1f} MiB at batch {MOE_BATCH} (uniform routing), "
                f"{b.per_token / mib:.1f} MiB with every expert touched")

    print(f"weights: {param_count(cfg):,} parameters = {held.resident / mib:.1f} MiB as "
          f"--quantization auto holds them{pages}; {reads(held)}")
    print(f"  --quantization gguf: {mapped.resident / mib:.1f} MiB "
          f"({mapped.in_place / mib:.1f} MiB of it read in place from the file); "
          f"{reads(mapped)}")
    _print_decode_floor(args, held.one_token, mapped.one_token)
    return held.resident


def _print_windows(args: argparse.Namespace, cfg, dtype, layout, auto, seq_len: int,
                   max_len: int, budget: int) -> None:
    """`plan`'s line on sliding windows: what a sequence holds with the blocks before its
    windows handed back, against keeping them all."""
    from kvserve.kv_cache.planner import plan_kv

    mib = 2**20
    kept = [plan_kv(cfg, budget, args.block_size, auto.token_bytes.kv_cache_dtype, dtype, n)
            for n in (seq_len, max_len)]
    held = auto.blocks_per_seq * auto.block_bytes
    print(f"sliding windows: {layout.describe()}; blocks before a window are handed back "
          f"while a sequence runs: one of {seq_len} tokens holds at most "
          f"{held / mib:.1f} MiB ({held / seq_len / 1024:.1f} KiB per token) against "
          f"{seq_len * auto.token_bytes.total / mib:.1f} MiB keeping every block "
          f"(--disable-hybrid-kv-cache-manager: {kept[0].max_seqs} and "
          f"{kept[1].max_seqs} sequences)")


def _print_decode_floor(args: argparse.Namespace, per_token: int, in_place: int | None
                        ) -> None:
    """The bandwidth floor of a batch-1 decode step: the bytes it reads over the machine's
    read bandwidth (measured now, or --bandwidth); `in_place`: --quantization gguf's bytes."""
    import torch

    from kvserve.tools import ceilings

    if args.bandwidth is not None:
        if not args.bandwidth > 0:
            raise ValueError("--bandwidth must be > 0 (GB/s)")
        gbs, how = args.bandwidth, "--bandwidth"
    elif args.device != "cpu":
        return
    else:
        method, gbs = ceilings.read_bandwidth()
        how = f"{method}, {torch.get_num_threads()} threads, measured now"
    floor = lambda n: f"{n / gbs / 1e6:.1f} ms ({gbs * 1e9 / n:.1f} tok/s at most)"  # noqa: E731
    line = f"decode floor at {gbs:.1f} GB/s ({how}): a batch-1 step {floor(per_token)}"
    if in_place is not None:
        line += f"; --quantization gguf {floor(in_place)}"
    print(line)


def cmd_roofline(args: argparse.Namespace) -> int:
    """Measure the machine's ceilings and where the model's steps sit against them (each
    against the roof of its own arithmetic; a step above its roof is flagged)."""
    from kvserve.engine.llm_engine import EngineArgs, build_engine
    from kvserve.kv_cache.planner import dtype_name
    from kvserve.tools import ceilings, roofline

    ensure_default_model(args)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ValueError(f"--batches wants comma-separated integers, got {args.batches!r}") \
            from None
    if not batches or min(batches) < 1 or args.prefill < 0 or args.steps < 1 \
            or args.repeats < 1:
        raise ValueError("--batches must be >= 1, --prefill >= 0, --steps and --repeats >= 1")
    engine = build_engine(EngineArgs(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        enable_prefix_caching=False, max_num_seqs=max(batches),
        max_num_batched_tokens=max(512, max(batches), args.prefill),
        kv_cache_memory=args.kv_cache_memory, step_buffer_size=0))
    machine, points, ridge = roofline.run(engine, batches, args.prefill, args.steps,
                                          args.repeats)
    print(f"activations {dtype_name(machine.dtype)}; quantization: {engine.quantization} "
          f"({engine.local_core.runner.model.weight_kernel()}); {args.repeats} runs a figure")
    for line in [*ceilings.machine_lines(machine), *roofline.table(points)]:
        print(line)
    ctx = roofline.decode_context(args.steps)
    print(f"decode at ~{ctx} tokens of context turns compute-bound at batch "
          f"{ridge if ridge is not None else '> 4096'} by this cost model")
    if args.plot:
        print(f"plot written to {roofline.plot(machine, points, args.plot)}")
    return 0


def cmd_train_mtp(args: argparse.Namespace) -> int:
    """Self-distil a multi-token-prediction drafter for the model and save it."""
    from kvserve.tools.train_mtp import read_prompts, train_mtp

    ensure_default_model(args)
    for name in ("num_prompts", "max_tokens", "epochs", "batch_size", "intermediate"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.draft_vocab < 0:
        raise ValueError("--draft-vocab must be >= 0 (0: the whole vocabulary)")
    prompts = None
    if args.prompts is not None:
        path = Path(args.prompts).expanduser()
        if not path.is_file():
            raise ValueError(f"--prompts: no such file: {path}")
        prompts = read_prompts(path)
    report = train_mtp(args.model, Path(args.output), args.num_prompts, args.max_tokens,
                       args.epochs, args.batch_size, args.lr, args.intermediate,
                       draft_vocab=args.draft_vocab, seed=args.seed,
                       progress=not args.no_progress, prompts=prompts,
                       generations=Path(args.generations).expanduser()
                       if args.generations else None)
    last = report["history"][-1]
    print(f"saved {args.output}: {report['train_positions']} training positions from "
          f"{report['sequences']} generations, {report['total_seconds']:.0f}s; draft vocabulary "
          f"{report['draft_vocab']} tokens ({100 * report['draft_vocab_coverage']:.1f}% of "
          f"the target's choices); on answers to held-out prompts, agreement with the "
          f"target's greedy token: depth 1 {100 * last['val_agree_depth1']:.1f}%, depth 2 "
          f"{100 * last['val_agree_depth2']:.1f}%")
    print(f'use it with --speculative-config \'{{"method": "mtp", "model": "{args.output}"}}\'')
    return 0


def cmd_cache_list(args: argparse.Namespace) -> int:
    """Each weight cache entry (most recently used first): last use, size, whether this kvserve
    can start from it, and its model file; the total against the budget; the kernels' build
    notes (listed, never removed here)."""
    from kvserve import kernels
    from kvserve.disk_cache import cache_dir, cache_off
    from kvserve.models.cache_budget import (
        CURRENT,
        WRITING,
        Budget,
        model_bytes,
        scan,
        size_text,
        status,
    )
    from kvserve.models.weight_cache import code_versions

    budget = Budget.from_env()
    root = cache_dir()
    weights = root / "weights"
    entries = scan(weights)
    versions = code_versions()
    off = " (off: KVSERVE_NO_WEIGHT_CACHE is set)" if cache_off() else ""
    print(f"weight cache: {weights}{off}")
    stale = 0
    if entries:
        print(f"  {'last used':<16}  {'size':>10}  {'status':<28}  model file (dtype, "
              f"quantization)")
    for e in reversed(entries):
        state = status(e, versions)
        stale += state not in (CURRENT, WRITING)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        print(f"  {when:<16}  {size_text(e.bytes):>10}  {state:<28}  {_entry_text(e)}")
    total = sum(e.bytes for e in entries)
    print(f"total {size_text(total)} in {len(entries)} "
          f"entr{'y' if len(entries) == 1 else 'ies'}; budget {budget.describe()}")
    per_model: dict[str, list[int]] = {}  # model path: [its size, its entries' bytes]
    for e in entries:
        if e.header is not None:
            model = e.header["model"]
            per_model.setdefault(model["path"], [model_bytes(model), 0])[1] += e.bytes
    over = [m for m, (size, held) in per_model.items() if held > budget.for_model(size)]
    if total > budget.total or over:
        print(f"over budget{' (' + ', '.join(over) + ')' if over else ''}: the next start "
              f"that uses or writes an entry removes the least recently used")
    if stale:
        print(f"{stale} not current: `kvserve cache clear --stale` removes "
              f"{'it' if stale == 1 else 'them'}")
    notes = kernels.noted_builds(root / "kernels")
    if notes:
        this = kernels.expected_build_id()
        print(f"kernel builds noted in {root / 'kernels'} (listed only):")
        for marker, note in notes:
            if note is None:
                print(f"  {marker.stem}: unreadable")
                continue
            so = Path(str(note.get("so", "")))
            which = "this kvserve's build" if note.get("key") == this else "another build"
            print(f"  {marker.stem}: {which}, library {so}"
                  f"{'' if so.is_file() else ' (missing)'}")
    return 0


def _entry_text(e: StoredEntry) -> str:
    """An entry's model file and configuration, or its files when it has no readable
    manifest."""
    h = e.header
    if h is None:
        return "(no manifest) " + ", ".join(sorted(f.name for f in e.files))
    dtype = str(h.get("dtype", "?")).removeprefix("torch.")
    rank, size = h.get("tp", [0, 1])
    tp = f", rank {rank} of {size}" if size > 1 else ""
    return f"{h['model']['path']} ({dtype}, {h.get('quantization', '?')}{tp})"


def cmd_cache_clear(args: argparse.Namespace) -> int:
    """Remove every weight cache entry, or with --stale those this kvserve cannot start from
    (`kvserve cache list` says why of each)."""
    from kvserve.disk_cache import cache_dir
    from kvserve.models.cache_budget import CURRENT, WRITING, scan, size_text, status
    from kvserve.models.weight_cache import code_versions

    weights = cache_dir() / "weights"
    entries = scan(weights)
    if args.stale:
        versions = code_versions()
        chosen = [e for e in entries if status(e, versions) not in (CURRENT, WRITING)]
    else:
        chosen = entries
    try:
        for e in chosen:
            e.remove()
    except OSError as err:
        print(f"kvserve: error: cannot remove {err.filename}: {err.strerror}", file=sys.stderr)
        return 1
    kept = [e for e in entries if e not in chosen]
    print(f"removed {len(chosen)} of {len(entries)} entries "
          f"({size_text(sum(e.bytes for e in chosen))}) from {weights}; "
          f"{size_text(sum(e.bytes for e in kept))} kept")
    return 0
