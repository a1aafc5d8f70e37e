"""Rates of kvserve's matmul kernels on this CPU, against torch's F.linear on the same shape.

    python benchmarks/kernel_rates.py [--n 8192] [--k 2048] [--rows 1,8,32,256] [--repeats 5]

For int4 and int8 `quant_linear` (random codes, float32 activations) and float32
`dense_linear`: the median time of --repeats calls per row count, as GOP/s (2 x rows x n x k
over the time) and, for the quantized forms, as GB/s of packed weight read (meaningful at one
row, where a call streams its weight once). Prints the instruction set the kernels run on
(`kernels.isa()`); exits 1 where they are not built.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvserve import kernels
from kvserve.tools.ceilings import timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192, help="outputs (a multiple of 16)")
    ap.add_argument("--k", type=int, default=2048, help="inputs (a multiple of 32)")
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if args.n <= 0 or args.n % 16 or args.k <= 0 or args.k % 32 or min(rows) < 1 \
            or args.repeats < 1:
        ap.error("--n must be a positive multiple of 16, --k of 32; --rows and --repeats >= 1")
    ops = kernels.ops()
    if ops is None or kernels.quant_kernels(torch.float32, "cpu", args.n, args.k) is None:
        print("kvserve's kernels are not built for this CPU (see kvserve/kernels/__init__.py)")
        return 1
    n, k = args.n, args.k
    g = torch.Generator().manual_seed(0)
    print(f"kernels: {kernels.isa()}; {torch.get_num_threads()} threads; weight {n} x {k}")
    for bits in (4, 8):
        q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
        d = torch.rand(n, k // 32, generator=g) * 0.01
        m = -torch.rand(n, k // 32, generator=g) * 0.1
        packed = ops.quant_pack(q, d, m, bits)
        for r in rows:
            x = torch.randn(r, k, generator=g)
            t = timed(lambda: ops.quant_linear(x, packed), args.repeats)  # noqa: B023
            print(f"int{bits} quant_linear, {r:4d} rows: {t * 1e3:8.2f} ms  "
                  f"{2 * r * n * k / t / 1e9:7.1f} GOP/s  {packed.numel() / t / 1e9:6.1f} GB/s")
    w = torch.randn(n, k, generator=g)
    packed = ops.dense_pack(w)
    for r in rows:
        x = torch.randn(r, k, generator=g)
        t = timed(lambda: ops.dense_linear(x, packed), args.repeats)  # noqa: B023
        ref = timed(lambda: torch.nn.functional.linear(x, w), args.repeats)  # noqa: B023
        print(f"float32 dense_linear, {r:4d} rows: {t * 1e3:8.2f} ms  "
              f"{2 * r * n * k / t / 1e9:7.1f} GFLOP/s  (torch F.linear "
              f"{2 * r * n * k / ref / 1e9:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
