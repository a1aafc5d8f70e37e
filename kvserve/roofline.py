"""`kvserve roofline`: where the loaded model's steps sit against this machine's ceilings.

A step needs FLOPs and bytes. Its time can be no lower than the larger of FLOPs / peak matrix
throughput and bytes / memory bandwidth (both measured here, in the compute dtype); the
step is memory-bound when the bytes term is the larger. Decode at small batches reads every
weight once per step for very few FLOPs, so it is judged against the bandwidth floor; a
prefill chunk does hundreds of FLOPs per weight byte, so it is judged against the compute
ceiling. The batch where decode turns compute-bound is where the two terms meet.

What a step is counted to need (`StepCost`):
- weights: every projection in the form its kernel reads (a quantized copy, or the
  compute-dtype weight), the LM head for the sampled rows only, the norms;
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
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.layers.linear import LinearBase


@dataclass
class Machine:
    dtype: torch.dtype
    peak_gflops: float  # large matrix product in `dtype`
    read_gbs: float  # summing a large tensor


@dataclass
class StepCost:
    flops: float
    weight_bytes: float
    kv_bytes: float
    act_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.act_bytes


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_machine(dtype: torch.dtype, repeats: int = 5, matmul_n: int = 2048,
                    read_bytes: int = 1 << 30) -> Machine:
    a = torch.randn(matmul_n, matmul_n, dtype=dtype)
    b = torch.randn(matmul_n, matmul_n, dtype=dtype)
    gflops = 2 * matmul_n**3 / timed(lambda: a @ b, repeats) / 1e9
    big = torch.ones(read_bytes // 4, dtype=torch.float32)
    gbs = big.numel() * 4 / timed(big.sum, repeats) / 1e9
    return Machine(dtype, gflops, gbs)


class CostModel:
    """FLOPs and bytes of the steps of one loaded model (see the module docstring)."""

    def __init__(self, model, kv_bytes_per_token: int) -> None:
        cfg = model.config
        self.cfg = cfg
        self.kv_per_token = kv_bytes_per_token
        self.weight_bytes = 0.0  # projection weights as their kernels read them
        self.params = 0  # projection parameters used by every token (LM head apart)
        head = model.lm_head
        for module in model.modules():
            if isinstance(module, LinearBase) and module is not head:
                n = module.in_features * module.out_features
                self.params += n
                p = module.packed
                self.weight_bytes += p.nbytes if p is not None else \
                    n * module.weight.element_size()
        self.head_params = head.weight.numel()
        self.head_bytes = (head.packed.nbytes if head.packed is not None
                           else self.head_params * head.weight.element_size())
        self.norm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                              if "norm" in n)
        self.act_size = model.embed_tokens.weight.element_size()

    def step(self, tokens: int, sampled: int, attended: int, kv_rows: int | None = None
             ) -> StepCost:
        """A step computing `tokens` new tokens, sampling `sampled` rows, whose queries
        attend to `attended` (query, key) pairs in all, reading `kv_rows` cached K/V rows
        (default `attended`: every query reads its own context, as decode does)."""
        cfg = self.cfg
        weights = self.weight_bytes + self.norm_bytes + self.head_bytes
        attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attended
        flops = 2 * self.params * tokens + 2 * self.head_params * sampled + attn_flops
        # K/V: the rows read (all KV heads of a row: kv_per_token), and the new rows written.
        kv = self.kv_per_token * ((attended if kv_rows is None else kv_rows) + tokens)
        act = 2 * tokens * cfg.num_layers * (2 * cfg.hidden_size + cfg.intermediate_size) \
            * self.act_size
        return StepCost(flops, weights, kv, act)

    def decode(self, batch: int, context: int) -> StepCost:
        return self.step(batch, batch, batch * context)

    def prefill(self, chunk: int, context_before: int = 0) -> StepCost:
        """A chunk read its context once (one attention call over the request)."""
        attended = sum(context_before + i + 1 for i in range(chunk))
        return self.step(chunk, 1, attended, kv_rows=context_before)

    def ridge_batch(self, machine: Machine, context: int, limit: int = 4096) -> int | None:
        """Smallest decode batch whose compute time reaches its memory time."""
        for b in range(1, limit + 1):
            c = self.decode(b, context)
            if c.flops / (machine.peak_gflops * 1e9) >= c.bytes / (machine.read_gbs * 1e9):
                return b
        return None


@dataclass
class Point:
    name: str
    seconds: float
    cost: StepCost
    machine: Machine

    @property
    def floor(self) -> float:
        return self.cost.bytes / (self.machine.read_gbs * 1e9)

    @property
    def ceiling_time(self) -> float:
        return self.cost.flops / (self.machine.peak_gflops * 1e9)

    @property
    def bound(self) -> str:
        return "memory" if self.floor >= self.ceiling_time else "compute"

    def row(self) -> str:
        gflops = self.cost.flops / self.seconds / 1e9
        gbs = self.cost.bytes / self.seconds / 1e9
        memory = self.bound == "memory"
        frac = (self.floor if memory else self.ceiling_time) / self.seconds
        limit = "bandwidth floor" if memory else "compute ceiling"
        return (f"{self.name:14s} {1e3 * self.seconds:9.2f} {self.cost.flops / 1e9:8.2f} "
                f"{self.cost.bytes / 1e6:8.1f} {gflops:8.1f} {gbs:7.1f}  {self.bound:7s} "
                f"{100 * frac:6.1f}% of the {limit}")


HEADER = (f"{'step':14s} {'ms':>9s} {'GFLOP':>8s} {'MB':>8s} {'GFLOP/s':>8s} {'GB/s':>7s}  "
          "bound   achieved")


PROMPT_LEN = 16  # decode measurements start from prompts this long


def time_decode(engine, batch: int, steps: int, seed: int) -> float:
    """Median seconds of a decode step with `batch` sequences (prompts of PROMPT_LEN)."""
    from kvserve.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()
        engine.add_request(f"roofline-d{batch}-{seed}-{i}", prompt, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                               for r in sched.running):
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
    from kvserve.sampling_params import SamplingParams

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


def run(engine, batches: list[int], prefill: int, steps: int, repeats: int,
        machine: Machine | None = None) -> tuple[Machine, list[Point], int | None]:
    """Measure the machine and the engine's steps; returns the points and the ridge batch."""
    from kvserve.kv_cache.planner import kv_bytes_per_token

    cfg = engine.model_config
    dtype = engine.config.dtype
    machine = machine or measure_machine(dtype, repeats)
    model = CostModel(engine.runner.model,
                      kv_bytes_per_token(cfg, engine.config.cache.kv_cache_dtype, dtype))
    points = []
    context = PROMPT_LEN + steps // 2
    for i, b in enumerate(batches):
        seconds = time_decode(engine, b, steps, seed=i)
        points.append(Point(f"decode b={b}", seconds, model.decode(b, context), machine))
    if prefill:
        seconds = time_prefill(engine, prefill, repeats, seed=99)
        points.append(Point(f"prefill {prefill}", seconds, model.prefill(prefill), machine))
    return machine, points, model.ridge_batch(machine, context)


def plot(machine: Machine, points: list[Point], path) -> Path:
    """The roofline (log-log: FLOP per byte against GFLOP/s) with the measured steps on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    intensities = [p.cost.flops / p.cost.bytes for p in points]
    lo, hi = min(intensities + [1.0]) / 2, max(intensities + [1000.0]) * 2
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(xs, [min(machine.peak_gflops, machine.read_gbs * x) for x in xs], color="#333",
            label=f"roof: {machine.read_gbs:.0f} GB/s, {machine.peak_gflops:.0f} GFLOP/s")
    for p, x in zip(points, intensities, strict=True):
        ax.plot(x, p.cost.flops / p.seconds / 1e9, "o")
        ax.annotate(p.name, (x, p.cost.flops / p.seconds / 1e9), textcoords="offset points",
                    xytext=(5, -12), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="FLOP per byte", ylabel="GFLOP/s",
           title="Measured steps against this machine's roofline")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
