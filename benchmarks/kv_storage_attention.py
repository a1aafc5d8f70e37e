"""Paged attention's cost by how K/V are stored, on this CPU: float32, float16 and bf16 (under
float32 activations, widened as they are read) and int8, at several context lengths.

    python benchmarks/kv_storage_attention.py [--contexts 512,2048,8192] [--repeats 21]
                                              [--threads N]

Two steps of SmolLM2-135M's attention shape (9 heads, 3 KV heads, head_dim 64) per context
length L: a decode step of --batch sequences, one row each, with L tokens of context (read
straight from the cache), and a prompt chunk of --chunk rows ending at L (K/V packed once per
step). Prints, per storage, the median over --repeats calls of `paged_attention` (after a
warm-up call) and its ratio to float32's: of the wall time, or with --clock cpu of the
process's CPU time, which a machine shared with other work inflates far less (with --threads
1 it is the call's own work). The storages take turns call by call, so a drift in the
machine's load falls on all of them alike. Exits 1 where the kernel does not run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kvserve import kernels
from kvserve.attention.kv_quant import quantize_int8

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
STORAGES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "int8": torch.int8}


def _cache(values: torch.Tensor, name: str) -> torch.Tensor:
    return quantize_int8(values) if name == "int8" else values.to(STORAGES[name])


def _median_seconds(fns: list[Callable[[], object]], repeats: int,
                    clock: Callable[[], float]) -> list[float]:
    """The median time of each of `fns` over `repeats` rounds of calling each once."""
    for fn in fns:
        fn()  # warm-up: buffers sized, pages touched
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
    return [statistics.median(ts) for ts in times]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,2048,8192", help="context lengths L")
    ap.add_argument("--batch", type=int, default=16, help="sequences of the decode step")
    ap.add_argument("--chunk", type=int, default=256, help="rows of the prompt chunk")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: torch's; 1 is steadier on a busy machine)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
    if min(contexts) < 1 or args.batch < 1 or args.repeats < 1 or \
            not 1 <= args.chunk <= min(contexts):
        ap.error("--contexts, --batch and --repeats must be >= 1, --chunk within 1 .. L")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    ops = kernels.ops()
    here = [n for n, d in STORAGES.items()
            if kernels.attention_kernels(torch.float32, "cpu", HEAD_DIM, d) is not None]
    if ops is None or "float32" not in here:
        print("kvserve's attention kernel is not built for this CPU (see kvserve/kernels)")
        return 1
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"kernels: {kernels.isa()}; {torch.get_num_threads()} threads; {HEADS} heads, "
          f"{KV_HEADS} KV heads, head_dim {HEAD_DIM}; median {args.clock} time of "
          f"{args.repeats} calls, ms")
    print(f"{'step':<28}" + "".join(f"{n:>18}" for n in here))
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    for ctx in contexts:
        nb = -(-ctx // BLOCK)
        values = torch.randn(2, KV_HEADS, args.batch * nb * BLOCK, HEAD_DIM, generator=g)
        caches = {n: _cache(values, n) for n in here}
        del values
        tables = torch.randperm(args.batch * nb, generator=g).view(args.batch, nb)
        steps = {
            f"decode, {args.batch} x 1 row": (
                torch.randn(args.batch, HEADS, HEAD_DIM, generator=g),
                torch.tensor([[b, 1, ctx] for b in range(args.batch)]), tables),
            f"chunk of {args.chunk} rows": (
                torch.randn(args.chunk, HEADS, HEAD_DIM, generator=g),
                torch.tensor([[0, args.chunk, ctx]]), tables[:1]),
        }
        for what, (q, seqs, tab) in steps.items():
            calls = [lambda c=caches[n], q=q, s=seqs, t=tab: ops.paged_attention(
                q, c, s, t, BLOCK, scale) for n in here]
            times = _median_seconds(calls, args.repeats, clock)
            cells = [f"{t * 1e3:9.3f} ({t / times[0]:4.2f}x)" for t in times]
            print(f"{f'L={ctx}: {what}':<28}" + "".join(f"{c:>18}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
