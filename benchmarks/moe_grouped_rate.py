"""The expert GEMMs' rate in isolation: one sparse layer's experts on gguf_grouped at a
prefill's routing, against the same rows given to one expert (the kernel's rate on that
matrix shape without the grouping) and against the layer's q/k/v projection.

    python benchmarks/moe_grouped_rate.py --model FILE [--layer 0] [--tokens 500] [--repeats 7]

`--tokens` random hidden states (bf16, or the engine's activation dtype) are routed by the
layer's own router, sorted by expert as run_layers' moe_mlp sorts them, and timed through
gate/up and down (medians of --repeats calls, after one warm-up). GOPS: 2 x rows x inputs x
outputs a second. The gap between "grouped" and "one expert" is what running many small
GEMMs costs over one large one (each expert's weights read once, short runs of rows); the gap
between "one expert" and q/k/v is the kernel's on this matrix's type and width.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from kvserve.bench.peers import machine
from kvserve.engine.llm_engine import EngineArgs, build_engine
from kvserve.kernels import ops
from kvserve.layers.linear import LinearBase
from kvserve.models.moe import SparseMoE, route
from kvserve.tools.ceilings import run_times


def median_seconds(f: Callable[[], object], repeats: int) -> float:
    return statistics.median(run_times(f, repeats))


def parts(m: LinearBase) -> tuple[list, list, list]:
    """A layer's GGUF blocks as gguf_grouped takes them; SystemExit where it has none."""
    gguf_parts = getattr(m.packed, "gguf_parts", None)
    if gguf_parts is None:
        raise SystemExit("the experts are not GGUF blocks here (a GGUF file under --quantization "
                         "auto or gguf, on the C++ kernels)")
    g = gguf_parts()
    return g["parts"], g["types"], g["rows"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if args.tokens < 1 or args.repeats < 1:
        p.error("--tokens and --repeats must be at least 1")
    k = ops()
    if k is None:
        raise SystemExit("no C++ kernels here")
    engine = build_engine(EngineArgs(model=args.model))
    model = engine.local_core.runner.model
    if not 0 <= args.layer < len(model.layers):
        raise SystemExit(f"--layer {args.layer}: the model has layers 0-{len(model.layers) - 1}")
    moe = model.layers[args.layer].mlp
    if not isinstance(moe, SparseMoE):
        raise SystemExit(f"layer {args.layer} is not a mixture of experts")
    dtype = model.embed_tokens.weight.dtype
    hidden = model.config.hidden_size
    torch.manual_seed(0)
    x = torch.randn(args.tokens, hidden, dtype=dtype)
    _, ids = route(moe.router(x), moe.top_k, moe.normalize)
    flat = ids.flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=len(moe.experts))
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    rows = len(order)
    width = moe.experts[0].down_proj.in_features
    inputs = {"gate/up": x[order // moe.top_k].contiguous(),
              "down": torch.randn(rows, width, dtype=dtype)}
    experts = len(moe.experts)
    print(f"{machine()}; model {args.model}, layer {args.layer}: {args.tokens} tokens x "
          f"{moe.top_k} experts = {rows} rows over {experts} experts ({rows / experts:.1f} an "
          f"expert, {int(counts.min())}-{int(counts.max())}); medians of {args.repeats}")
    one = [0, rows] + [rows] * (experts - 1)  # every row on expert 0
    for name, pick in (("gate/up", lambda e: e.gate_up_proj), ("down", lambda e: e.down_proj)):
        mats = [parts(pick(e)) for e in moe.experts]
        ps, ts, rs = (list(z) for z in zip(*mats, strict=True))
        x_in = inputs[name]
        layer = pick(moe.experts[0])
        ops_count = 2 * rows * layer.in_features * layer.out_features
        for label, offs in (("grouped", offsets), ("one expert", one)):
            t = median_seconds(lambda o=offs, a=x_in, w=(ps, ts, rs): k.gguf_grouped(a, o, *w),
                               args.repeats)
            print(f"  {name:8s} {label:10s} {t * 1e3:7.1f} ms  {ops_count / t / 1e9:5.0f} GOPS")
    qkv = model.layers[args.layer].self_attn.qkv_proj
    q_parts, q_types, q_rows = parts(qkv)
    t = median_seconds(lambda: k.gguf_linear(x, q_parts, q_types, q_rows), args.repeats)
    ops_count = 2 * args.tokens * qkv.in_features * qkv.out_features
    print(f"  q/k/v    {args.tokens} rows   {t * 1e3:7.1f} ms  {ops_count / t / 1e9:5.0f} GOPS")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
