"""gguf_linear (a GGUF file's own blocks, read in place, and for the types with an interleaved
layout also interleaved 8 rows at a time as `auto` serves them) against quant_linear
(kvserve's int4/int8 tiles, the form GGUF weights were repacked into before), on one layer's
matrices of a real model's shape, at decode (1 row) and prefill (512 rows) sizes.

    python benchmarks/gguf_kernels.py [--shape qwen2.5-1.5b] [--repeats 15] [--as-type IQ4_XS]

Weights are random blocks of each type (the kernels' speed does not depend on the values).
For each matrix it prints the median time of --repeats calls, the bytes each form reads per
call and, at 1 row, the bandwidth that implies; at 512 rows, the int8 multiply-adds per
second. Both kernels run on torch's threads (--threads to set them). The CPU is printed first: its
instruction set decides the path (`gguf_path`).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve import kernels  # noqa: E402
from kvserve.layers.quant import GGML_TYPES, QuantizedWeight  # noqa: E402
from kvserve.tools.ceilings import run_times  # noqa: E402

# (name, out, in, GGUF type) of one decoder layer, as a Q4_K_M file stores them.
SHAPES = {
    "qwen2.5-1.5b": [("qkv", 2048, 1536, "Q4_K"), ("o", 1536, 1536, "Q4_K"),
                     ("gate_up", 17920, 1536, "Q4_K"), ("down", 1536, 8960, "Q6_K")],
    "llama-1b": [("qkv", 3072, 2048, "Q4_K"), ("o", 2048, 2048, "Q4_K"),
                 ("gate_up", 16384, 2048, "Q4_K"), ("down", 2048, 8192, "Q6_K")],
    # one expert's matrices (MXFP4_MOE: the experts MXFP4, attention Q8_0)
    "gpt-oss-20b": [("qkv", 5120, 2880, "Q8_0"), ("o", 2880, 4096, "Q8_0"),
                    ("gate_up", 5760, 2880, "MXFP4"), ("down", 2880, 2880, "MXFP4")],
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def random_blocks(kind: str, rows: int, cols: int) -> torch.Tensor:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.full(raw.shape[:2], 0.01, np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if kind == "MXFP4":  # an E8M0 exponent, not a float16: 2^(121 - 128), near 0.01
        raw[:, :, 0] = 121
        return torch.from_numpy(raw.reshape(rows, -1))
    for off in ((208,) if kind == "Q6_K" else (0,) if kind.startswith("IQ4") else (0, 2)):
        raw[:, :, off:off + 2] = scale
    return torch.from_numpy(raw.reshape(rows, -1))


def median_s(fn, repeats: int) -> float:
    return statistics.median(run_times(fn, repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    ap.add_argument("--as-type", default=None, choices=sorted(GGML_TYPES),
                    help="every matrix in this GGUF type instead (IQ4_XS: an IQ4_XS file)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = kernels.ops()
    if ops is None:
        sys.exit("the C++ kernels are unavailable here")
    print(f"CPU: {cpu_name()}; gguf_linear path: {ops.gguf_path()}; "
          f"quant_linear ISA: {kernels.isa()}; threads: {torch.get_num_threads()}")
    none = [torch.empty(0, dtype=torch.long)]
    # the x8 form on each vector path built here (the best first: auto's); the file's layout
    # on the best
    paths = [p for p in ops.gguf_paths() if p != "portable"] or ["portable"]
    x8_heads = " ".join(f"{'x8 ' + p:>8}" for p in paths)
    print(f"{'matrix':8} {'type':5} {'rows':>5} {'gguf ms':>8} {x8_heads} {'tiles ms':>8} "
          f"{'ratio':>6} {'gguf MB':>8} {'tiles MB':>8} {'gguf GB/s':>9} {'GMAC/s':>7}")
    totals = {1: [0.0, 0.0], 512: [0.0, 0.0]}
    for name, n, k, kind in SHAPES[args.shape]:
        kind = args.as_type or kind
        raw = random_blocks(kind, n, k)
        tid = int(GGMLQuantizationType[kind])
        w = ops.gguf_rows(raw, tid, k, torch.arange(n), torch.float32)
        tiles = QuantizedWeight(w, "int8" if kind == "Q6_K" else "int4")
        x8 = ops.gguf_repacked_type(tid)
        packed = ops.gguf_repack(raw, tid, k, none[0], torch.empty(
            n // 8, 8 * raw.shape[1], dtype=torch.uint8)) if x8 else None
        for m in (1, 512):
            x = torch.randn(m, k)
            g = median_s(lambda x=x, raw=raw, tid=tid: ops.gguf_linear(x, [raw], [tid], none),
                         args.repeats)
            times = []
            if packed is not None:  # the form auto serves: the ratio is against its best path
                times = [median_s(lambda x=x, packed=packed, x8=x8, path=path:
                                  ops.gguf_linear(x, [packed], [x8], none, path=path),
                                  args.repeats) for path in paths]
            q = median_s(lambda x=x, tiles=tiles: tiles.matmul(x), args.repeats)
            best = times[0] if times else g
            totals[m][0] += best
            totals[m][1] += q
            gb = raw.numel() / best / 1e9
            x8_ms = (" ".join(f"{t * 1e3:8.3f}" for t in times) if times
                     else " ".join(f"{'-':>8}" for _ in paths))
            print(f"{name:8} {kind:5} {m:5} {g * 1e3:8.3f} {x8_ms} {q * 1e3:8.3f} "
                  f"{q / best:6.2f} {raw.numel() / 1e6:8.2f} {tiles.nbytes / 1e6:8.2f} "
                  f"{gb if m == 1 else float('nan'):9.2f} "
                  f"{m * n * k / best / 1e9 if m > 1 else float('nan'):7.1f}")
    print(f"ratio: tiles time over gguf_linear's in auto's form (x8 where there is one, on "
          f"{paths[0]}); GB/s and GMAC/s of that form")
    for m, (g, q) in totals.items():
        print(f"layer at {m} rows: gguf (auto's form) {g * 1e3:.3f} ms, tiles {q * 1e3:.3f} "
              f"ms, tiles/gguf {q / g:.2f}x")


if __name__ == "__main__":
    main()
