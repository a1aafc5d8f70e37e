"""Offline figures on the default model: single-stream decode, prefill, batched throughput.

    python benchmarks/offline.py [--model ...] [--dtype auto] [--repeats 3]

Prints medians over --repeats runs of each measurement, all taken in one process so the
ratios compare like with like on a noisy machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.sample.sampling_params import SamplingParams


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: in SmolLM2's vocabulary they are special tokens.
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    EngineArgs.add_cli_args(p, ["model", "dtype", "kv_cache_dtype", "max_num_seqs",
                                "max_num_batched_tokens"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory="4GiB",
              kv_cache_dtype=args.kv_cache_dtype)
    vocab = llm.engine.model_config.vocab_size
    print(f"model {llm.engine.config.model} dtype {llm.engine.config.dtype} "
          f"kv {args.kv_cache_dtype} ({llm.engine.config.cache.kv_cache_dtype}) "
          f"threads {torch.get_num_threads()}")
    llm.generate(random_prompts(2, 64, vocab, 0), SamplingParams(max_tokens=8))  # warm up

    decode, prefill, throughput, e2e_tps = [], [], [], []
    for r in range(args.repeats):
        # Single stream: one request, decode rate after the first token.
        out = llm.generate(random_prompts(1, 32, vocab, 100 + r),
                           SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))[0]
        decode.append(1.0 / out.metrics.tpot)

        # Prefill: a 512-token prompt in one step (budget 512), first token only.
        out = llm.generate(random_prompts(1, 512, vocab, 200 + r),
                           SamplingParams(temperature=0, max_tokens=1))[0]
        prefill.append(512 / out.metrics.prefill_time)

        # Batched: many requests at once, fixed output length.
        prompts = random_prompts(args.num_requests, args.prompt_len, vocab, 300 + r)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len,
                                                    ignore_eos=True))
        wall = time.perf_counter() - t0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        throughput.append(gen / wall)
        e2e_tps.append((gen + args.num_requests * args.prompt_len) / wall)
        print(f"run {r}: decode {decode[-1]:.1f} tok/s, prefill {prefill[-1]:.0f} tok/s, "
              f"batched {throughput[-1]:.1f} output tok/s ({e2e_tps[-1]:.0f} total tok/s, "
              f"{wall:.1f}s)", flush=True)
    llm.engine.check_integrity()

    med = statistics.median
    print()
    print(f"single-stream decode       {med(decode):8.1f} tok/s")
    print(f"prefill (512-token prompt) {med(prefill):8.1f} tok/s")
    print(f"batched throughput         {med(throughput):8.1f} output tok/s "
          f"({args.num_requests} requests x {args.prompt_len} prompt + {args.output_len} "
          f"output; {med(e2e_tps):.0f} prompt+output tok/s)")
    print(f"batched / single-stream    {med(throughput) / med(decode):8.2f}x")


if __name__ == "__main__":
    main()
