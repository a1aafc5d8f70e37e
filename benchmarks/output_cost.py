#!/usr/bin/env python3
"""Does a step's output work grow with the request's length? One greedy request of 4,096
tokens on the default model, once with each OutputKind; prints the step profiler's `output`
phase (appending, detokenizing, stop checks, building the caller's output) over the first
and the last 512 decode steps, and the time to build each step's outputs as the caller sees
them. CUMULATIVE copies every token, text and logprob so far into every output (what every
output was before OutputKind existed); DELTA and FINAL_ONLY should not grow.

usage: output_cost.py [--tokens 4096] [--logprobs 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve.engine.llm_engine import EngineArgs, build_engine
from kvserve.outputs import OutputKind
from kvserve.sample.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--logprobs", type=int, default=1)
    args = p.parse_args()
    engine = build_engine(EngineArgs(step_buffer_size=args.tokens + 16,
                                     max_model_len=args.tokens + 64))
    prompt = engine.tokenizer.encode("Write a very long story about a lighthouse keeper.")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                            logprobs=args.logprobs)
    window = 512
    print(f"{args.tokens} tokens, logprobs={args.logprobs}; medians over {window} steps, ms")
    print("| kind | output phase, first | output phase, last | last / first |")
    print("|---|---|---|---|")
    for kind in OutputKind:
        before = engine.local_core.steps[-1].step if engine.local_core.steps else 0
        engine.add_request(kind.value, prompt, params, output_kind=kind)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        wall = time.perf_counter() - t0
        steps = [s for s in engine.local_core.steps if s.step > before and s.decode_tokens]
        first = statistics.median(s.output for s in steps[:window]) * 1e3
        last = statistics.median(s.output for s in steps[-window:]) * 1e3
        print(f"| {kind.value} | {first:.3f} | {last:.3f} | {last / first:.2f}x |"
              f"  ({len(steps)} decode steps, {wall:.1f} s)")


if __name__ == "__main__":
    main()
