"""How many 1024-token sequences run at once in a fixed KV budget, bf16 vs int8 KV cache.

    python benchmarks/kv_capacity.py [--kv-cache-memory 128MiB] [--requests 48]

For each KV dtype: an engine with the same --kv-cache-memory gets many random 1024-token
prompts (16 output tokens each, ignore_eos) at once, with a seat and token budget large enough
that only KV memory limits admission; the peak number of requests running together is
measured, next to the planner's prediction.
"""

from __future__ import annotations

import argparse
import random

from kvserve.engine.llm_engine import EngineArgs, build_engine
from kvserve.sample.sampling_params import SamplingParams


def peak_running(kv_cache_dtype: str, budget: str, n: int, prompt_len: int) -> dict:
    engine = build_engine(EngineArgs(kv_cache_memory=budget, kv_cache_dtype=kv_cache_dtype,
                                  max_num_seqs=512, max_num_batched_tokens=8192,
                                  enable_prefix_caching=False))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i in range(n):
        engine.add_request(str(i), [rng.randrange(100, 49000) for _ in range(prompt_len)], params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.local_core.scheduler.running))
    engine.check_integrity()
    tokens = prompt_len + 16
    kv = engine.local_core.kv
    blocks_per_seq = -(-tokens // kv.block_size)
    return {"blocks": kv.num_blocks, "planned": kv.num_blocks // blocks_per_seq,
            "peak": peak, "preemptions": engine.local_core.scheduler.num_preemptions}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-cache-memory", default="128MiB")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=1024)
    args = p.parse_args()
    results = {d: peak_running(d, args.kv_cache_memory, args.requests, args.prompt_len)
               for d in ("auto", "int8")}
    print(f"\nKV budget {args.kv_cache_memory}, {args.requests} requests of "
          f"{args.prompt_len} + 16 tokens:")
    print("KV dtype   blocks   planned seqs   peak running   preemptions")
    for d, r in results.items():
        name = "bfloat16" if d == "auto" else d
        print(f"{name:9s} {r['blocks']:7d} {r['planned']:14d} {r['peak']:14d} "
              f"{r['preemptions']:13d}")
    a, b = results["auto"], results["int8"]
    print(f"int8 / bf16: {b['blocks'] / a['blocks']:.2f}x blocks, "
          f"{b['peak'] / a['peak']:.2f}x concurrent sequences")


if __name__ == "__main__":
    main()
