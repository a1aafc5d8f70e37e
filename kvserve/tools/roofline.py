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
  the LM head likewise, the norms; of a mixture-of-experts layer's routed experts (each
  token's k of E), only the share a step of T new tokens reads on average under uniform,
  independent routing (`kvserve.models.moe.experts_read`: k/E at T = 1, nearing all of
  them as T grows; a real router's skew reads fewer, so such a step can show above its
  floor); an MoE layer's router and shared expert count whole, as any projection;
- KV: the cache rows the step reads (each decode query its whole context; a prefill chunk
  its earlier context once) and its new rows (written);
- activations: per token and layer, the hidden state and MLP intermediate read and written
  once (a lower bound: real kernels touch them a few times); an MoE layer's intermediate is
  its k experts' and its shared expert's;
- FLOPs: 2 per weight a token uses per token (an MoE layer's: k of its E experts, the
  router, a shared expert; LM head per sampled row) plus attention, 4 x heads x head dim
  per layer per attended position.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.layers.linear import LinearBase
from kvserve.layers.quant import GGUFWeight, QuantizedWeight
from kvserve.models.moe import SparseMoE, experts_read
from kvserve.tools.ceilings import (
    ARITHMETIC,
    INT8,
    Machine,
    StepWork,
    measure_machine,
)


def arithmetic_of(layer: LinearBase, activations: torch.dtype) -> str:
    """The arithmetic `layer`'s matmul runs in (see the module docstring)."""
    p = layer.packed
    if isinstance(p, GGUFWeight) or isinstance(p, QuantizedWeight) and p.kernels is not None:
        return INT8
    return ARITHMETIC[activations]




class WorkModel:
    """FLOPs and bytes of the steps of one loaded model (see the module docstring)."""

    def __init__(self, model, kv_bytes_per_token: int) -> None:
        cfg = model.config
        self.cfg = cfg
        self.kv_per_token = kv_bytes_per_token
        act = model.embed_tokens.weight.dtype
        self.attention = ARITHMETIC[act]
        self.weight_bytes = 0.0  # projection weights as their kernels read them, all experts
        # of weight_bytes, the routed experts' by (E, k): a step reads experts_read of them
        self.expert_bytes: dict[tuple[int, int], float] = {}
        self.params_by: dict[str, int] = {}  # per arithmetic, projection parameters a token uses
        head = model.lm_head
        routed: dict[int, tuple[int, int]] = {}  # id of an expert's projection -> (E, k)
        for moe in model.modules():
            if isinstance(moe, SparseMoE):
                routed |= {id(m): (len(moe.experts), moe.top_k)
                           for m in moe.experts.modules() if isinstance(m, LinearBase)}
        experts: dict[tuple[str, int, int], int] = {}  # all experts' parameters, by (a, E, k)
        for module in model.modules():
            if isinstance(module, LinearBase) and module is not head:
                a = arithmetic_of(module, act)
                n, size = module.in_features * module.out_features, layer_bytes(module)
                if id(module) in routed:
                    e, k = routed[id(module)]
                    experts[a, e, k] = experts.get((a, e, k), 0) + n
                    self.expert_bytes[e, k] = self.expert_bytes.get((e, k), 0.0) + size
                else:
                    self.params_by[a] = self.params_by.get(a, 0) + n
                self.weight_bytes += size
        for (a, e, k), n in experts.items():  # E experts of one size a layer: k/E is whole
            self.params_by[a] = self.params_by.get(a, 0) + n * k // e
        self.head = arithmetic_of(head, act)
        self.head_params = head.in_features * head.out_features
        self.head_bytes = layer_bytes(head)
        self.norm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                              if "norm" in n)
        self.act_size = model.embed_tokens.weight.element_size()

    @property
    def params(self) -> int:
        """Projection parameters a token uses (LM head apart): an MoE layer's k of E
        experts."""
        return sum(self.params_by.values())

    def projection_bytes(self, tokens: int) -> float:
        """Bytes of the projections (LM head apart) a step of `tokens` new tokens reads: the
        routed experts' at their expected share (experts_read), every other's whole."""
        return self.weight_bytes + sum(b * (experts_read(e, k, tokens) - 1.0)
                                       for (e, k), b in self.expert_bytes.items())

    def mlp_width(self, layer: int) -> int:
        """The MLP intermediate features a token computes in `layer`: an MoE layer's k
        experts' and its shared expert's."""
        cfg = self.cfg
        if not cfg.sparse(layer):
            return cfg.intermediate_size
        return cfg.num_experts_per_tok * cfg.moe_intermediate_size + \
            cfg.shared_expert_intermediate_size

    def step(self, tokens: int, sampled: int, attended: int, kv_rows: int | None = None
             ) -> StepWork:
        """A step computing `tokens` new tokens, sampling `sampled` rows, whose queries
        attend to `attended` (query, key) pairs in all, reading `kv_rows` cached K/V rows
        (default `attended`: every query reads its own context, as decode does)."""
        cfg = self.cfg
        weights = self.projection_bytes(tokens) + self.norm_bytes + self.head_bytes
        flops = {a: 2.0 * n * tokens for a, n in self.params_by.items()}
        for a, f in ((self.head, 2.0 * self.head_params * sampled),
                     (self.attention, 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
                      * attended)):
            if f:
                flops[a] = flops.get(a, 0.0) + f
        # K/V: the rows read (all KV heads of a row: kv_per_token), and the new rows written.
        kv = self.kv_per_token * ((attended if kv_rows is None else kv_rows) + tokens)
        act = 2 * tokens * sum(2 * cfg.hidden_size + self.mlp_width(i)
                               for i in range(cfg.num_layers)) * self.act_size
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
