"""Speculative decoding on the default model: acceptance, speed, and greedy identity.

    python benchmarks/spec_decode.py [--mtp mtp.safetensors] [--max-tokens 128]
                                     [--only baseline,ngram,...]

For each configuration, with the offline API and greedy sampling:
  - single stream: the prompts one after another; output tokens/s over all of them;
  - batch of 8: the same prompts all at once; output tokens/s;
  - draft tokens verified, accepted, acceptance rate, and tokens per target step;
  - whether every output is token-for-token the baseline's (the same target weights).
Two prompt sets: "chat" (open questions) and "copy" (tasks that repeat their input, where
prompt lookup shines). Configurations (the target in brackets):
  baseline           [int4, the default]   no speculation
  ngram              [int4]                prompt lookup, k=3
  mtp                [int4]                trained MTP module, k=2 (needs --mtp)
  baseline-bf16      [bf16 weights]        no speculation
  draft-int4         [bf16 weights]        the same model with int4 weights as draft, k=3
"""

from __future__ import annotations

import argparse
import time

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

CHAT = [
    "What is the capital city of France? Answer in one sentence.",
    "Explain how a rainbow forms.",
    "Give three tips for staying focused while studying.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between cats and dogs as pets?",
    "Describe the water cycle in simple terms.",
    "Why do leaves change color in autumn?",
    "How does a bicycle stay upright when it moves?",
]
COPY = [
    "Repeat the following sentence three times: The quick brown fox jumps over the lazy dog.",
    "Copy this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Fix the spelling in this text and rewrite it in full: Teh cat sat on teh mat and "
    "looked at teh dog, who was sleeping under teh table next to teh window.",
    "Rewrite this code with the variable x renamed to count:\n"
    "x = 0\nfor item in items:\n    if item > 10:\n        x = x + 1\nprint(x)",
    "Summarize by repeating the key sentence: Our meeting is moved to Friday at 3 pm. "
    "Please note that our meeting is moved to Friday at 3 pm.",
    "Write the numbers from one to twenty in words, separated by commas.",
    "Repeat after me: To be or not to be, that is the question.",
    "Convert to uppercase: the rain in spain stays mainly in the plain.",
]


def run(name: str, llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    eng = llm.engine
    t0 = time.perf_counter()
    single = [llm.generate([p], params)[0] for p in prompts]
    t_single = time.perf_counter() - t0
    before = (eng.spec_stats.num_drafts, eng.spec_stats.num_accepted)
    t0 = time.perf_counter()
    batch = llm.generate(prompts, params)
    t_batch = time.perf_counter() - t0
    n_single = sum(len(o.outputs[0].token_ids) for o in single)
    n_batch = sum(len(o.outputs[0].token_ids) for o in batch)
    drafts = sum(o.metrics.num_draft_tokens for o in single)
    accepted = sum(o.metrics.num_accepted_tokens for o in single)
    return {
        "name": name, "single_tps": n_single / t_single, "batch_tps": n_batch / t_batch,
        "drafts": drafts, "accepted": accepted,
        "batch_drafts": eng.spec_stats.num_drafts - before[0],
        "batch_accepted": eng.spec_stats.num_accepted - before[1],
        "tokens": [o.outputs[0].token_ids for o in single],
        "batch_tokens": [o.outputs[0].token_ids for o in batch],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtp", default=None, help="MTP module from `kvserve train-mtp`")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    args = p.parse_args()
    configs = [
        ("baseline", "auto", None, "baseline"),
        ("ngram", "auto", {"method": "ngram", "num_speculative_tokens": 3}, "baseline"),
        ("mtp", "auto", {"method": "mtp", "model": args.mtp, "num_speculative_tokens": 2},
         "baseline"),
        ("baseline-bf16", "none", None, "baseline-bf16"),
        ("draft-int4", "none", {"method": "draft_model", "quantization": "int4",
                                "num_speculative_tokens": 3}, "baseline-bf16"),
    ]
    only = set(args.only.split(",")) if args.only else None
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results: dict[tuple[str, str], dict] = {}
    for name, quant, spec, ref in configs:
        if (only and name not in only) or (name == "mtp" and not args.mtp):
            continue
        llm = LLM(quantization=quant, speculative_config=spec)
        for set_name, texts in (("chat", CHAT), ("copy", COPY)):
            prompts = [llm.render_chat([{"role": "user", "content": t}]) for t in texts]
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm up
            r = run(name, llm, prompts, params)
            base = results.get((ref, set_name))
            r["same_single"] = None if base is None else r["tokens"] == base["tokens"]
            r["same_batch"] = None if base is None else r["batch_tokens"] == base["tokens"]
            r["speedup_single"] = None if base is None else r["single_tps"] / base["single_tps"]
            r["speedup_batch"] = None if base is None else r["batch_tps"] / base["batch_tps"]
            results[(name, set_name)] = r
            acc = f"{100 * r['accepted'] / r['drafts']:.1f}%" if r["drafts"] else "-"
            bacc = (f"{100 * r['batch_accepted'] / r['batch_drafts']:.1f}%"
                    if r["batch_drafts"] else "-")
            print(f"{name:14s} {set_name:5s} single {r['single_tps']:6.1f} tok/s "
                  f"(x{r['speedup_single'] or 1:.2f})  batch-8 {r['batch_tps']:6.1f} tok/s "
                  f"(x{r['speedup_batch'] or 1:.2f})  drafts {r['drafts']:5d} accepted "
                  f"{acc:>6s} (batch {bacc:>6s})  identical to {ref}: single "
                  f"{r['same_single']} batch {r['same_batch']}", flush=True)
        del llm


if __name__ == "__main__":
    main()
