"""Cost of per-request timelines and the step profiler: throughput with both on (the
defaults) against both off (`timeline_buffer_size=0, step_buffer_size=0`), default model.

    python benchmarks/observability_overhead.py [--rounds 5] [--requests 32] [--max-tokens 128]

Two engines in one process run the same 32 random prompts at once (concurrency 32), in
alternating rounds, so that machine noise hits both alike; prints every round, the medians
and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.engine.llm import LLM
from kvserve.sample.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    engines = {"on": LLM(), "off": LLM(timeline_buffer_size=0, step_buffer_size=0)}
    gen = torch.Generator().manual_seed(0)
    vocab = engines["on"].engine.model_config.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm up
    results: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            t = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
            results[name].append(tps)
            print(f"round {r + 1} {name:3s} {tps:7.1f} output tok/s", flush=True)
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    print(f"median: on {on:.1f}, off {off:.1f} output tok/s; on / off = {on / off:.3f} "
          f"({100 * (on / off - 1):+.1f}%)")


if __name__ == "__main__":
    main()
