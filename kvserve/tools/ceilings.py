"""This machine's ceilings, measured: matmul rates per arithmetic (float, and the int8/int4
kernels' tiles and GGUF Q4_K blocks), read bandwidth (a streaming sum, a copy, the kernels'
matrix-vector products), and the report lines and JSON that show them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve import kernels
from kvserve.layers.quant import GGML_TYPES

ARITHMETIC = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
# kvserve's quant_linear and gguf_linear: int8 x int8 dot products (int8 or int4 weights, or a
# GGUF file's own blocks)
INT8 = "int8"


@dataclass
class StepWork:
    flops_by: dict[str, float]  # arithmetic -> FLOPs
    weight_bytes: float
    kv_bytes: float
    act_bytes: float

    @property
    def flops(self) -> float:
        return sum(self.flops_by.values())

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.act_bytes


@dataclass
class Machine:
    """This machine's measured rates: per arithmetic, GFLOP/s by method; GB/s by method.
    A roof is the best method of each."""

    dtype: torch.dtype  # the activations' (attention, dense layers)
    threads: int
    compute: dict[str, dict[str, float]]
    bandwidth: dict[str, float]

    def ceiling(self, arithmetic: str) -> float:
        """GFLOP/s of `arithmetic` (ValueError when it was not measured here)."""
        if not self.compute.get(arithmetic):
            raise ValueError(f"no {arithmetic} ceiling measured on this machine")
        return max(self.compute[arithmetic].values())

    @property
    def read_gbs(self) -> float:
        return max(self.bandwidth.values())

    def compute_seconds(self, cost: StepWork) -> float:
        """The least time the step's FLOPs take, each arithmetic at its own ceiling."""
        return sum(f / (self.ceiling(a) * 1e9) for a, f in cost.flops_by.items() if f)

    def memory_seconds(self, cost: StepWork) -> float:
        return cost.bytes / (self.read_gbs * 1e9)


def run_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of `repeats` runs of `fn`, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs, after one warm-up run."""
    return statistics.median(run_times(fn, repeats))


def _rate(amount: float, fn: Callable[[], object], repeats: int) -> float:
    """`amount` (FLOPs or bytes) per `fn` call at its fastest run, in billions per second:
    a roof is what the machine can do, and a busy machine only slows a run down."""
    return amount / min(run_times(fn, repeats)) / 1e9


def _quant_tiles(ops, n: int, k: int, bits: int) -> torch.Tensor:
    """`quant_pack`'s tiles of an [n, k] weight: one tile of random codes, repeated (the
    kernel has no data-dependent branches, so its time does not depend on the values)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 1 << bits, (16, 32), dtype=torch.uint8, generator=gen)
    d = torch.full((16, 1), 0.01)
    tile = ops.quant_pack(q, d, -128 * d if bits == 8 else -8 * d, bits)
    return tile.expand(n // 16, k // 32, -1).contiguous()


Q4_K = GGML_TYPES["Q4_K"]  # the type most of a Q4_K_M file's matrices have
Q4_K_BLOCK = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][1]  # bytes per 256 weights


def _q4k_weight(ops, n: int, k: int) -> tuple[torch.Tensor, int] | None:
    """An [n, k] Q4_K weight of random codes and scales (its float16 d and dmin 0.01) as
    `auto` serves it: (the tensor, its type number), interleaved 8 rows at a time where the
    kernels have that layout. None where gguf_linear cannot read Q4_K or k is no multiple of
    256."""
    if k % 256 or n % 8 or not ops.gguf_supports(Q4_K):
        return None
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, k // 256, Q4_K_BLOCK), dtype=torch.uint8, generator=gen)
    raw[:, :, :4] = torch.full((n, k // 256, 2), 0.01, dtype=torch.float16).view(torch.uint8)
    raw = raw.view(n, -1)
    x8 = ops.gguf_repacked_type(Q4_K)
    if not x8:
        return raw, Q4_K
    out = torch.empty(n // 8, 8 * raw.shape[1], dtype=torch.uint8)
    return ops.gguf_repack(raw, Q4_K, k, torch.empty(0, dtype=torch.long), out), x8


def _gguf_rate(ops, x: torch.Tensor, weight: tuple[torch.Tensor, int], amount: float,
               repeats: int) -> float:
    w, kind = weight
    none = [torch.empty(0, dtype=torch.long)]
    return _rate(amount, lambda: ops.gguf_linear(x, [w], [kind], none), repeats)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations kvserve's kernels would see for a model in `dtype`."""
    return dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32


def measure_compute(dtype: torch.dtype, repeats: int = 5, n: int = 2048,
                    rows: int = 512) -> dict[str, dict[str, float]]:
    """GFLOP/s per arithmetic and method: torch's n^3 matmul and kvserve's dense_linear
    (`rows` x n x n, a prefill chunk's shape) in bf16, fp32 and `dtype`; quant_linear with
    8- and 4-bit weights and gguf_linear on Q4_K blocks at that shape for int8 (activations
    in `dtype` where the kernel takes them)."""
    out: dict[str, dict[str, float]] = {}
    for dt in dict.fromkeys((torch.bfloat16, torch.float32, dtype)):
        out[ARITHMETIC[dt]] = _float_rates(dt, repeats, n, rows)
    act = _kernel_dtype(dtype)
    x = torch.randn(rows, n, dtype=act)
    if (ops := kernels.quant_kernels(act, "cpu", n, n)) is not None:
        out[INT8] = {}
        for bits in (8, 4):
            w = _quant_tiles(ops, n, n, bits)
            out[INT8][f"kvserve quant_linear {bits}-bit weights {rows}x{n}x{n}"] = _rate(
                2 * rows * n * n, lambda w=w: ops.quant_linear(x, w), repeats)
    if (ops := kernels.gguf_kernels(act, "cpu", [Q4_K])) is not None and \
            (q4k := _q4k_weight(ops, n, n)) is not None:
        # a GGUF model's prefill runs this kernel: on an AVX-512 VNNI CPU it outran
        # quant_linear, so without it prefill rows came out above their roof
        out.setdefault(INT8, {})[f"kvserve gguf_linear Q4_K {rows}x{n}x{n}"] = _gguf_rate(
            ops, x, q4k, 2 * rows * n * n, repeats)
    return out


def _float_rates(dtype: torch.dtype, repeats: int, n: int, rows: int) -> dict[str, float]:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    rates = {f"torch matmul {n}^3": _rate(2 * n**3, lambda: a @ b, repeats)}
    if (ops := kernels.dense_kernels(dtype, "cpu", n, n)) is not None:
        w, x = ops.dense_pack(b), torch.randn(rows, n, dtype=dtype)
        rates[f"kvserve dense_linear {rows}x{n}x{n}"] = _rate(
            2 * rows * n * n, lambda: ops.dense_linear(x, w), repeats)
    return rates


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


def measure_bandwidth(dtype: torch.dtype, repeats: int = 5, read_bytes: int = 1 << 30,
                      k: int = 4096) -> dict[str, float]:
    """GB/s by method, each over far more than the caches hold: a float32 sum of
    `read_bytes`, a copy moving half that (a quarter read, a quarter written), and GEMVs
    (one row) over
    about a quarter of it with [n, k] weights: torch's matvec in `dtype`, and kvserve's
    dense_linear and quant_linear (8- and 4-bit weights) as a decode step runs them. Each
    method's tensors go before the next is allocated."""
    out = dict([_sum_rate(read_bytes, repeats), _copy_rate(read_bytes // 2, repeats),
                _matvec_rate(dtype, read_bytes // 4, k, repeats)])
    act = _kernel_dtype(dtype)
    if kernels.dense_kernels(act, "cpu", 16, k) is not None:
        out.update([_dense_gemv_rate(act, read_bytes // 4, k, repeats)])
    if kernels.quant_kernels(act, "cpu", 16, k) is not None:
        out.update(_quant_gemv_rate(act, bits, read_bytes // 4, k, repeats) for bits in (8, 4))
    if (ops := kernels.gguf_kernels(act, "cpu", [Q4_K])) is not None and \
            (q4k := _q4k_weight(ops, _outputs(read_bytes // 4, Q4_K_BLOCK / 256, k),
                                k)) is not None:
        w = q4k[0]
        out[f"kvserve gguf_linear Q4_K GEMV {_mib(w.nbytes)}"] = _gguf_rate(
            ops, torch.randn(1, k, dtype=act), q4k, w.nbytes, repeats)
    return out


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 3) -> tuple[str, float]:
    """(method, GB/s) of a streaming read far larger than the caches, with torch's threads:
    the figure a batch-1 decode step, which reads every weight once, cannot beat."""
    return _sum_rate(nbytes, repeats)


def _sum_rate(nbytes: int, repeats: int) -> tuple[str, float]:
    big = torch.ones(nbytes // 4)
    return f"sum {_mib(big.nbytes)}", _rate(big.nbytes, big.sum, repeats)


def _copy_rate(nbytes: int, repeats: int) -> tuple[str, float]:
    """`nbytes` moved: half read, half written."""
    src = torch.ones(nbytes // 8)
    dst = torch.empty_like(src)
    return (f"copy {_mib(src.nbytes)} (read + written)",
            _rate(2 * src.nbytes, lambda: dst.copy_(src), repeats))


def _outputs(nbytes: float, bytes_per_weight: float, k: int) -> int:
    """Outputs (a multiple of 16) of a weight of about `nbytes` with `k` inputs."""
    return max(16, int(nbytes / bytes_per_weight / k) // 16 * 16)


def _matvec_rate(dtype: torch.dtype, nbytes: int, k: int, repeats: int) -> tuple[str, float]:
    x = torch.randn(1, k, dtype=dtype)
    # Constant values: the time of a matvec does not depend on them.
    w = torch.full((_outputs(nbytes, x.element_size(), k), k), 0.01, dtype=dtype)
    return (f"torch {ARITHMETIC[dtype]} matvec {_mib(w.nbytes)}",
            _rate(w.nbytes, lambda: F.linear(x, w), repeats))


def _dense_gemv_rate(dtype: torch.dtype, nbytes: int, k: int, repeats: int
                     ) -> tuple[str, float]:
    x = torch.randn(1, k, dtype=dtype)
    ops = kernels.ops()
    w = ops.dense_pack(torch.full((_outputs(nbytes, x.element_size(), k), k), 0.01,
                                  dtype=dtype))
    return (f"kvserve dense_linear {ARITHMETIC[dtype]} GEMV {_mib(w.nbytes)}",
            _rate(w.nbytes, lambda: ops.dense_linear(x, w), repeats))


def _quant_gemv_rate(dtype: torch.dtype, bits: int, nbytes: int, k: int, repeats: int
                     ) -> tuple[str, float]:
    x = torch.randn(1, k, dtype=dtype)
    ops = kernels.ops()
    # tile bytes per weight: bits / 8, and a float16 scale and minimum per 32 weights
    w = _quant_tiles(ops, _outputs(nbytes, bits / 8 + 4 / 32, k), k, bits)
    return (f"kvserve quant_linear {bits}-bit GEMV {_mib(w.nbytes)}",
            _rate(w.nbytes, lambda: ops.quant_linear(x, w), repeats))


def measure_machine(dtype: torch.dtype, repeats: int = 5, matmul_n: int = 2048,
                    rows: int = 512, read_bytes: int = 1 << 30) -> Machine:
    """Every ceiling and bandwidth figure of this machine, with all of torch's threads."""
    return Machine(dtype, torch.get_num_threads(),
                   measure_compute(dtype, repeats, matmul_n, rows),
                   measure_bandwidth(dtype, repeats, read_bytes))


def ceilings_json(machine: Machine) -> dict:
    """The machine's figures as a JSON-able dict: each arithmetic's ceiling and the bandwidth
    (GFLOP/s, GB/s; the best method of each) with every method's figure."""
    return {
        "threads": machine.threads,
        "activations": str(machine.dtype).removeprefix("torch."),
        "compute_gflops": {a: {"ceiling": machine.ceiling(a), "methods": dict(m)}
                           for a, m in machine.compute.items() if m},
        "bandwidth_gbs": {"best": machine.read_gbs, "methods": dict(machine.bandwidth)},
    }


def machine_lines(machine: Machine) -> list[str]:
    """The machine's figures, one arithmetic or one bandwidth method a line."""
    lines = [f"machine: {machine.threads} threads; each figure a method's fastest run, each "
             "roof the best method"]
    for a, methods in machine.compute.items():
        detail = "; ".join(f"{m} {v:.0f}" for m, v in methods.items())
        lines.append(f"  {a:5s} ceiling {machine.ceiling(a):8.1f} GFLOP/s   ({detail})")
    lines.append(f"  memory bandwidth {machine.read_gbs:6.1f} GB/s")
    lines += [f"    {m:44s} {v:6.1f} GB/s" for m, v in machine.bandwidth.items()]
    return lines
