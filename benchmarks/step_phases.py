"""Where an engine step's time goes: each phase of the C++ layer loop (run_layers' torch.profiler
scopes: the q/k/v and output projections, attention, a dense MLP, or a mixture of experts'
router, experts and weighted sum), the LM head and the rest of the step (scheduling, inputs,
sampling, outputs), for a prefill and for decode steps at a few batch sizes.

    python benchmarks/step_phases.py [--model FILE] [--batches 1,8,32] [--prompt 500]
        [--steps 16] [--rounds 3]

One engine in this process (its defaults, as `kvserve serve` starts it). Per step kind, the
median over --rounds of each phase's milliseconds per step (a round: `--steps` decode steps
of the batch, or one prefill of a --prompt-token prompt, under torch.profiler), and the step's
median time without the profiler beside its time under it (the profiler records every ATen
call too, which costs a little). Random prompts; decode steps run at 32-80 tokens of context.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvserve.bench.peers import machine
from kvserve.engine.llm_engine import EngineArgs, build_engine
from kvserve.sample.sampling_params import SamplingParams

PHASES = ("qkv_proj", "attention", "o_proj", "mlp", "moe_router", "moe_experts", "moe_combine",
          "moe_shared_expert", "lm_head")


def add(engine, n: int, prompt: int, max_tokens: int, rng: random.Random) -> None:
    for _ in range(n):
        ids = [rng.randrange(100, 30000) for _ in range(prompt)]
        engine.add_request(f"r{rng.random()}", ids,
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def plain_steps(engine, n: int) -> list[float]:
    """n steps' times (s), without the profiler."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def profiled_steps(engine, n: int) -> dict[str, float]:
    """n steps under torch.profiler: each kvserve:: scope's milliseconds a step ("step": the
    whole step)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            with record_function("kvserve::step"):
                engine.step()
    return {e.key.removeprefix("kvserve::"): e.cpu_time_total / 1e3 / n
            for e in prof.key_averages() if e.key.startswith("kvserve::")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=500)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    engine = build_engine(EngineArgs(model=args.model) if args.model else EngineArgs())
    model = engine.local_core.runner.model
    head = model.compute_logits

    def scoped_head(hidden: torch.Tensor) -> torch.Tensor | None:
        with record_function("kvserve::lm_head"):
            return head(hidden)

    model.compute_logits = scoped_head
    rng = random.Random(0)
    add(engine, 1, 16, 8, rng)  # warm-up, the profiler's first start included
    engine.step()
    profiled_steps(engine, 4)
    drain(engine)
    rows: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)
    for _ in range(args.rounds):
        for b in [int(x) for x in args.batches.split(",")]:
            add(engine, b, 32, 2 * args.steps + 4, rng)
            engine.step()  # the prompts
            engine.step()
            plain = plain_steps(engine, args.steps)
            rows[f"decode b={b}"].append((statistics.median(plain), profiled_steps(
                engine, args.steps)))
            drain(engine)
        if args.prompt:  # one step each (the prompt within the step's token budget)
            add(engine, 1, args.prompt, 1, rng)
            plain = plain_steps(engine, 1)
            drain(engine)
            add(engine, 1, args.prompt, 1, rng)
            rows[f"prefill {args.prompt}"].append((plain[0], profiled_steps(engine, 1)))
            drain(engine)
    print(f"machine: {machine()}; model {args.model or 'default'}; "
          f"{model.weight_kernel()}; medians of {args.rounds} rounds, ms per step")
    used = [ph for ph in PHASES if any(ph in r[1] for rs in rows.values() for r in rs)]
    print(f"{'step':14} {'alone':>8} {'profiled':>9} " +
          " ".join(f"{ph:>12}" for ph in used) + f" {'rest':>8}")
    for name, rs in rows.items():
        step = statistics.median(r[1].get("step", 0.0) for r in rs)
        cells = {ph: statistics.median(r[1].get(ph, 0.0) for r in rs) for ph in used}
        rest = step - sum(cells.values())
        print(f"{name:14} {statistics.median(r[0] for r in rs) * 1e3:8.2f} {step:9.2f} " +
              " ".join(f"{cells[ph]:12.2f}" for ph in used) + f" {rest:8.2f}")


if __name__ == "__main__":
    main()
