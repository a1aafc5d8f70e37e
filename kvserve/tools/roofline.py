"""`kvserve roofline`: where the loaded model's steps sit against this machine's ceilings.

A step needs FLOPs and bytes. Its time can be no lower than the larger of its compute time
(FLOPs over the peak rate of the arithmetic that does them) and its memory time (bytes over
the memory bandwidth). Decode at small batches reads every weight once per step for very few
FLOPs, so it meets the bandwidth floor first; a prefill chunk does hundreds of FLOPs per
weight byte and meets a compute ceiling. The batch where decode turns compute-bound is
where the two times meet.

Which roof (`Machine`, `Point`). A FLOP is counted in the arithmetic of the kernel that does
it (`arithmetic_of`):
- "int8": a projection whose weight is int8 or int4 tiles on kvserve's `quant_linear`,
  which quantizes the activations to int8 and multiplies with VNNI integer dot products;
- the activations' dtype ("bf16", "fp32", "fp16"): every other projection (kvserve's
  `dense_linear`, torch's `F.linear`, and torch's weight-only int4/int8 kernels, which widen
  the weights to the activations' dtype) and attention.
Each arithmetic's ceiling is measured with all threads as the best of the kernels that do
it at a large, compute-bound shape (`measure_compute`): torch's matmul and kvserve's
`dense_linear` for a float dtype, `quant_linear` with 8- and 4-bit weights for int8. The
bandwidth is the best of several streaming reads larger than the caches
(`measure_bandwidth`): a sum, a copy, and the GEMVs of the kernels a decode step runs. Every
method's figure (its fastest run) is reported; only the best of each is a roof, since the
machine can do at least that. Steps are timed as medians.

The rule for a step whose FLOPs are in several arithmetics (quantized projections with bf16
attention or a bf16 LM head): its compute time is at least sum over arithmetics a of
FLOPs_a / ceiling_a, so its ceiling is the FLOP-weighted harmonic combination FLOPs / that
time; a one-arithmetic step gets that arithmetic's ceiling. Achieved = roof time / measured
time, which cannot pass 100%: a row above it means a ceiling was under-measured or the
step's cost over-counted (or its bytes stayed in a cache), and is flagged as such.

What a step is counted to need (`StepWork`):
- weights: every projection in the form its kernel reads (`PackedWeight.nbytes`: the
  quantized tiles with their scales, the repacked dense weight, else the weight itself),
  the LM head likewise, the norms;
- KV: the cache rows the step reads (each decode query its whole context; a prefill chunk
  its earlier context once) and its new rows (written);
- activations: per token and layer, the hidden state and MLP intermediate read and written
  once (a lower bound: real kernels touch them a few times);
- FLOPs: 2 per weight per token (LM head per sampled row) plus attention, 4 x heads x head
  dim per layer per attended position.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.layers.linear import LinearBase
from kvserve.layers.quant import GGUFWeight, QuantizedWeight

ARITHMETIC = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
# kvserve's quant_linear and gguf_linear: int8 x int8 dot products (int8 or int4 weights, or a
# GGUF file's own blocks)
INT8 = "int8"


def arithmetic_of(layer: LinearBase, activations: torch.dtype) -> str:
    """The arithmetic `layer`'s matmul runs in (see the module docstring)."""
    p = layer.packed
    if isinstance(p, GGUFWeight) or isinstance(p, QuantizedWeight) and p.kernels is not None:
        return INT8
    return ARITHMETIC[activations]


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


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations kvserve's kernels would see for a model in `dtype`."""
    return dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32


def measure_compute(dtype: torch.dtype, repeats: int = 5, n: int = 2048,
                    rows: int = 512) -> dict[str, dict[str, float]]:
    """GFLOP/s per arithmetic and method: torch's n^3 matmul and kvserve's dense_linear
    (`rows` x n x n, a prefill chunk's shape) in bf16, fp32 and `dtype`; quant_linear with
    8- and 4-bit weights at that shape for int8 (activations in `dtype` where the kernel
    takes them)."""
    out: dict[str, dict[str, float]] = {}
    for dt in dict.fromkeys((torch.bfloat16, torch.float32, dtype)):
        out[ARITHMETIC[dt]] = _float_rates(dt, repeats, n, rows)
    act = _kernel_dtype(dtype)
    if (ops := kernels.quant_kernels(act, "cpu", n, n)) is not None:
        x = torch.randn(rows, n, dtype=act)
        out[INT8] = {}
        for bits in (8, 4):
            w = _quant_tiles(ops, n, n, bits)
            out[INT8][f"kvserve quant_linear {bits}-bit weights {rows}x{n}x{n}"] = _rate(
                2 * rows * n * n, lambda w=w: ops.quant_linear(x, w), repeats)
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


class WorkModel:
    """FLOPs and bytes of the steps of one loaded model (see the module docstring)."""

    def __init__(self, model, kv_bytes_per_token: int) -> None:
        cfg = model.config
        self.cfg = cfg
        self.kv_per_token = kv_bytes_per_token
        act = model.embed_tokens.weight.dtype
        self.attention = ARITHMETIC[act]
        self.weight_bytes = 0.0  # projection weights as their kernels read them
        self.params_by: dict[str, int] = {}  # per arithmetic, projection parameters a token uses
        head = model.lm_head
        for module in model.modules():
            if isinstance(module, LinearBase) and module is not head:
                a = arithmetic_of(module, act)
                self.params_by[a] = self.params_by.get(a, 0) + \
                    module.in_features * module.out_features
                self.weight_bytes += layer_bytes(module)
        self.head = arithmetic_of(head, act)
        self.head_params = head.in_features * head.out_features
        self.head_bytes = layer_bytes(head)
        self.norm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                              if "norm" in n)
        self.act_size = model.embed_tokens.weight.element_size()

    @property
    def params(self) -> int:
        """Projection parameters used by every token (LM head apart)."""
        return sum(self.params_by.values())

    def step(self, tokens: int, sampled: int, attended: int, kv_rows: int | None = None
             ) -> StepWork:
        """A step computing `tokens` new tokens, sampling `sampled` rows, whose queries
        attend to `attended` (query, key) pairs in all, reading `kv_rows` cached K/V rows
        (default `attended`: every query reads its own context, as decode does)."""
        cfg = self.cfg
        weights = self.weight_bytes + self.norm_bytes + self.head_bytes
        flops = {a: 2.0 * n * tokens for a, n in self.params_by.items()}
        for a, f in ((self.head, 2.0 * self.head_params * sampled),
                     (self.attention, 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
                      * attended)):
            if f:
                flops[a] = flops.get(a, 0.0) + f
        # K/V: the rows read (all KV heads of a row: kv_per_token), and the new rows written.
        kv = self.kv_per_token * ((attended if kv_rows is None else kv_rows) + tokens)
        act = 2 * tokens * cfg.num_layers * (2 * cfg.hidden_size + cfg.intermediate_size) \
            * self.act_size
        return StepWork(flops, weights, kv, act)

    def decode(self, batch: int, context: int) -> StepWork:
        return self.step(batch, batch, batch * context)

    def prefill(self, chunk: int, context_before: int = 0) -> StepWork:
        """A chunk read its context once (one attention call over the request)."""
        attended = sum(context_before + i + 1 for i in range(chunk))
        return self.step(chunk, 1, attended, kv_rows=context_before)

    def ridge_batch(self, machine: Machine, context: int, limit: int = 4096) -> int | None:
        """Smallest decode batch whose compute time reaches its memory time."""
        for b in range(1, limit + 1):
            c = self.decode(b, context)
            if machine.compute_seconds(c) >= machine.memory_seconds(c):
                return b
        return None


def layer_bytes(layer: LinearBase) -> int:
    """Bytes a layer's matmul reads of its weight: the packed form where it has one (the
    weight itself may also be kept, for a tied embedding, and is not read), else the weight."""
    if layer.packed is not None:
        return layer.packed.nbytes
    return layer.weight.numel() * layer.weight.element_size()


@dataclass
class Point:
    """One measured step against its roof (see the module docstring)."""

    name: str
    seconds: float
    cost: StepWork
    machine: Machine = field(repr=False)

    @property
    def floor(self) -> float:
        return self.machine.memory_seconds(self.cost)

    @property
    def ceiling_time(self) -> float:
        return self.machine.compute_seconds(self.cost)

    @property
    def roof_time(self) -> float:
        return max(self.floor, self.ceiling_time)

    @property
    def bound(self) -> str:
        return "memory" if self.floor >= self.ceiling_time else "compute"

    @property
    def ceiling_gflops(self) -> float:
        """This step's compute ceiling: its arithmetics' combined (FLOP-weighted harmonic)."""
        return self.cost.flops / self.ceiling_time / 1e9

    @property
    def achieved(self) -> float:
        """Roof time / measured time: at most 1 when the figures are right."""
        return self.roof_time / self.seconds

    @property
    def arithmetic(self) -> str:
        """The FLOPs' arithmetics, with their shares where there are several."""
        f = self.cost.flops_by
        if len(f) == 1:
            return next(iter(f))
        return "+".join(f"{a} {100 * v / self.cost.flops:.0f}%" for a, v in
                        sorted(f.items(), key=lambda kv: -kv[1]))

    def warning(self) -> str | None:
        """A warning when the point sits above its roof; None when it does not."""
        if self.achieved <= 1:
            return None
        limit = "bandwidth floor" if self.bound == "memory" else "compute ceiling"
        return (f"WARNING: {self.name} ran at {100 * self.achieved:.1f}% of its {limit}, above "
                f"its roof: a ceiling or the bandwidth is under-measured, or this step's "
                f"cost over-counted (or its bytes stayed in a cache); do not trust this row")

    def row(self) -> str:
        gflops = self.cost.flops / self.seconds / 1e9
        gbs = self.cost.bytes / self.seconds / 1e9
        limit = "bandwidth floor" if self.bound == "memory" else "compute ceiling"
        flag = "  ABOVE ITS ROOF" if self.achieved > 1 else ""
        return (f"{self.name:14s} {1e3 * self.seconds:9.2f} {self.cost.flops / 1e9:8.2f} "
                f"{self.cost.bytes / 1e6:8.1f} {gflops:8.1f} {gbs:7.1f}  "
                f"{self.arithmetic:18s} {self.ceiling_gflops:8.1f}  {self.bound:7s} "
                f"{100 * self.achieved:6.1f}% of its {limit}{flag}")


HEADER = (f"{'step':14s} {'ms':>9s} {'GFLOP':>8s} {'MB':>8s} {'GFLOP/s':>8s} {'GB/s':>7s}  "
          f"{'arithmetic':18s} {'ceiling':>8s}  bound   achieved")


def table(points: list[Point]) -> list[str]:
    """The header, a row a point, then a warning line for each point above its roof."""
    warnings = [w for p in points if (w := p.warning()) is not None]
    return [HEADER, *(p.row() for p in points), *warnings]


PROMPT_LEN = 16  # decode measurements start from prompts this long
DECODE_WARMUP = 2  # untimed decode steps first: a batch's first steps can run far slower


def decode_context(steps: int) -> int:
    """The context of the middle timed step of `time_decode`: the cost model's decode."""
    return PROMPT_LEN + DECODE_WARMUP + steps // 2


def time_decode(engine, batch: int, steps: int, seed: int) -> float:
    """Median seconds of a decode step with `batch` sequences (prompts of PROMPT_LEN)."""
    from kvserve.sample.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + DECODE_WARMUP + 2,
                            ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()
        engine.add_request(f"roofline-d{batch}-{seed}-{i}", prompt, params)
    sched = engine.local_core.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                               for r in sched.running):
        engine.step()
    for _ in range(DECODE_WARMUP):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def time_prefill(engine, chunk: int, repeats: int, seed: int) -> float:
    """Median seconds of the step that computes a `chunk`-token prompt in one go."""
    from kvserve.sample.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats + 1):
        prompt = torch.randint(3, vocab, (chunk,), generator=gen).tolist()
        engine.add_request(f"roofline-p{chunk}-{seed}-{i}", prompt, params)
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times[1:])  # the first warms up


def cost_model(engine) -> WorkModel:
    """The cost model of `engine`'s loaded model and KV cache."""
    from kvserve.kv_cache.planner import kv_bytes_per_token

    return WorkModel(engine.local_core.runner.model, kv_bytes_per_token(
        engine.model_config, engine.config.cache.kv_cache_dtype, engine.config.dtype))


def run(engine, batches: list[int], prefill: int, steps: int, repeats: int,
        machine: Machine | None = None) -> tuple[Machine, list[Point], int | None]:
    """Measure the machine and the engine's steps; returns the points and the ridge batch."""
    machine = machine or measure_machine(engine.config.dtype, repeats)
    model = cost_model(engine)
    points = []
    context = decode_context(steps)
    for i, b in enumerate(batches):
        seconds = time_decode(engine, b, steps, seed=i)
        points.append(Point(f"decode b={b}", seconds, model.decode(b, context), machine))
    if prefill:
        seconds = time_prefill(engine, prefill, repeats, seed=99)
        points.append(Point(f"prefill {prefill}", seconds, model.prefill(prefill), machine))
    return machine, points, model.ridge_batch(machine, context)


def plot(machine: Machine, points: list[Point], path) -> Path:
    """The roofline (log-log: FLOP per byte against GFLOP/s): a roof per arithmetic the
    points use, the measured steps (red: above their roof) each with a dash at its own
    roof."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    bw = machine.read_gbs
    intensities = [p.cost.flops / p.cost.bytes for p in points]
    lo, hi = min(intensities + [1.0]) / 2, max(intensities + [1000.0]) * 2
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5))
    for a in sorted({a for p in points for a in p.cost.flops_by}):
        c = machine.ceiling(a)
        ax.plot(xs, [min(c, bw * x) for x in xs],
                label=f"{a} roof: {bw:.0f} GB/s, {c:.0f} GFLOP/s")
    for p, x in zip(points, intensities, strict=True):
        y = p.cost.flops / p.seconds / 1e9
        ax.plot(x, y, "o", color="red" if p.achieved > 1 else "#333")
        ax.plot([x / 1.3, x * 1.3], [min(p.ceiling_gflops, bw * x)] * 2, color="#333", lw=1)
        ax.annotate(p.name, (x, y), textcoords="offset points", xytext=(5, -12), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="FLOP per byte", ylabel="GFLOP/s",
           title="Measured steps against this machine's roofs")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
