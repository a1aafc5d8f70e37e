"""Tensor parallelism on this CPU: greedy agreement of TP=2 with one process, step times, and
the all-reduce's share of the step.

    python benchmarks/tensor_parallel.py [--dtype auto] [--quantization auto]

For TP=1 and TP=2 (gloo, two processes, one thread each under TP=2; two threads in one
process for TP=1), with the default model:
- greedy outputs of 8 prompts x 64 tokens, compared token for token;
- a 512-token prefill, single-stream decode (128 tokens) and a batch of 16 decoding together:
  median step time and, under TP=2, the median time rank 0 spent in collectives (the sum of
  the row-parallel all-reduces, the embedding's and the logit gather, waiting for the other
  rank included) and its share of the step;
- the bare cost of one collective between two processes, for the gloo all_reduce and for the
  send/recv exchange kvserve uses on two ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.sample.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far "
           "away,", "1, 2, 3, 4,", "Explain photosynthesis to a child.",
           "Write a haiku about the sea.", "The three laws of motion are",
           "SELECT name FROM users WHERE"]


def phase_steps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list:
    """Run prompts to completion and return the StepRecords of that run."""
    engine = llm.engine
    before = engine.local_core.steps[-1].step if engine.local_core.steps else 0
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True))
    return [s for s in engine.local_core.steps if s.step > before]


def describe(name: str, steps: list, tp: int) -> str:
    totals = [s.total for s in steps]
    med = statistics.median(totals)
    line = f"  {name:<24} {len(steps):4d} steps, median step {med * 1e3:7.2f} ms"
    if tp > 1:
        comm = statistics.median(s.all_reduce for s in steps)
        share = statistics.median(s.all_reduce / s.total for s in steps if s.total)
        line += f", collectives {comm * 1e3:6.2f} ms ({share:.0%} of the step)"
    return line


def run(tp: int, dtype: str, quantization: str) -> tuple[list[list[int]], list[str]]:
    lines = []
    with LLM(None, dtype=dtype, quantization=quantization, tensor_parallel_size=tp,
             kv_cache_memory="256MiB", max_num_batched_tokens=512) as llm:
        res = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0,
                                                   ignore_eos=True))
        tokens = [r.outputs[0].token_ids for r in res]
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.model_config.vocab_size

        def rand(n: int) -> list[int]:
            return torch.randint(100, vocab, (n,), generator=g).tolist()

        phase_steps(llm, [rand(512)], 1)  # warm-up
        prefill = phase_steps(llm, [rand(512)], 1)
        single = phase_steps(llm, [rand(16)], 129)[1:]
        batch = phase_steps(llm, [rand(16) for _ in range(16)], 65)[1:]
        lines.append(describe("prefill 512 tokens", prefill, tp))
        lines.append(describe("decode, batch 1", single, tp))
        lines.append(describe("decode, batch 16", batch, tp))
    return tokens, lines


def _collective_bench(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    for rows in (1, 16, 512):
        x = torch.randn(rows, 576)
        other = torch.empty_like(x)

        def exchange(x: torch.Tensor = x, other: torch.Tensor = other) -> None:
            ops = [dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, other, 1 - rank)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        for name, fn in (("gloo all_reduce", lambda x=x: dist.all_reduce(x)),
                         ("send/recv exchange", exchange)):
            for _ in range(20):
                fn()
            rounds = []
            for _ in range(7):  # the median of 7 rounds: this machine is noisy
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                rounds.append((time.perf_counter() - t0) / 50)
            if rank == 0:
                out[(name, rows)] = statistics.median(rounds)
    dist.destroy_process_group()


def collective_costs() -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        out = m.dict()
        port = 29000 + os.getpid() % 1000
        procs = [ctx.Process(target=_collective_bench, args=(r, port, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    EngineArgs.add_cli_args(p, ["dtype", "quantization"])
    args = p.parse_args()
    results = {tp: run(tp, args.dtype, args.quantization) for tp in (1, 2)}
    print(f"default model, --dtype {args.dtype} --quantization {args.quantization}")
    for tp, (_, lines) in results.items():
        print(f"TP={tp}")
        print("\n".join(lines))
    one, two = results[1][0], results[2][0]
    same = sum(a == b for a, b in zip(one, two, strict=True))
    first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
             for a, b in zip(one, two, strict=True)]
    print(f"greedy agreement TP=2 vs TP=1: {same}/{len(one)} prompts identical over 64 tokens"
          + ("" if same == len(one) else f"; first differing token per prompt: {first}"))
    print("one collective between two idle processes (1 thread each), float32 x 576, "
          "median of 7 rounds of 50:")
    for (name, rows), sec in sorted(collective_costs().items(), key=lambda kv: kv[0][1]):
        print(f"  {name:<20} {rows:4d} rows  {sec * 1e6:7.0f} us")


if __name__ == "__main__":
    main()
