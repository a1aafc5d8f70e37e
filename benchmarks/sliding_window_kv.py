"""KV memory of long Gemma 3 270M requests with sliding-window blocks handed back (the
default) and kept (--disable-hybrid-kv-cache-manager), side by side in one run.

For each prompt length, one greedy request in each configuration (default engine otherwise):
the most KV bytes the request held at once (blocks in use after each step, in bytes), per
token of the request, and whether both gave the same tokens and logprobs.

    python benchmarks/sliding_window_kv.py [--lengths 2048,8192] [--output-len 16]
"""

from __future__ import annotations

import argparse
import time

from kvserve.engine.llm import LLM
from kvserve.kv_cache.planner import slot_bytes
from kvserve.models.paths import gemma3_model_path
from kvserve.sample.sampling_params import SamplingParams


def run(path: str, prompt: list[int], out_len: int, disable: bool) -> dict:
    engine = LLM(path, kv_cache_memory="2GiB", disable_hybrid_kv_cache_manager=disable).engine
    kv = engine.local_core.kv
    block = kv.block_size * slot_bytes(engine.model_config, "auto", engine.config.dtype,
                                       engine.local_core.kv_layout)
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=out_len,
                                                   ignore_eos=True, logprobs=1))
    peak, final = 0, None
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
    seconds = time.perf_counter() - t0
    engine.close()
    c = final.outputs[0]
    return {"peak": peak * block, "seconds": seconds, "tokens": c.token_ids,
            "logprobs": [lp.logprob for lp in c.logprobs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,8192", help="prompt lengths, comma-separated")
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    path = str(gemma3_model_path())
    text = "A long account of the harbour, its boats and the people who work there. "
    tok = LLM(path, kv_cache_memory="64MiB").tokenizer
    base = tok.encode(text * 2000)
    print("| prompt tokens | KV held, blocks handed back | KV held, all kept | per token "
          "(back / kept) | ratio | same tokens and logprobs | seconds (back / kept) |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        prompt = base[:n]
        back = run(path, prompt, args.output_len, False)
        kept = run(path, prompt, args.output_len, True)
        total = n + args.output_len
        same = back["tokens"] == kept["tokens"] and back["logprobs"] == kept["logprobs"]
        print(f"| {n} | {back['peak'] / 2**20:.1f} MiB | {kept['peak'] / 2**20:.1f} MiB | "
              f"{back['peak'] / total / 1024:.1f} / {kept['peak'] / total / 1024:.1f} KiB | "
              f"{back['peak'] / kept['peak']:.2f} | {'yes' if same else 'NO'} | "
              f"{back['seconds']:.1f} / {kept['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
