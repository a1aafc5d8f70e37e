"""Speculative decoding on the default model: acceptance, speed, and greedy identity.

    python benchmarks/spec_decode.py [--mtp mtp.safetensors] [--max-tokens 128]
                                     [--only baseline,ngram,...]

For each configuration, with the offline API and greedy sampling:
  - single stream, per prompt set: the prompts one after another; output tokens/s over all;
    drafts, draft tokens, accepted tokens, mean acceptance length, per-position acceptance;
  - concurrency 32: both sets twice over (32 prompts) submitted at once; output tokens/s;
  - whether every output is token-for-token the baseline's (the same target weights).
Two prompt sets: "chat" (open questions) and "copy" (tasks that repeat their input, where
prompt lookup shines). Configurations (the target in brackets):
  baseline           [int4, the default]   no speculation
  ngram              [int4]                prompt lookup, k=3
  mtp                [int4]                trained MTP module, k=--mtp-k (needs --mtp)
  baseline-bf16      [bf16 weights]        no speculation
  draft-int4         [bf16 weights]        the same model with int4 weights as draft, k=3
"""

from __future__ import annotations

import argparse
import copy
import time

from kvserve.engine.llm import LLM
from kvserve.sample.sampling_params import SamplingParams
from kvserve.stats import SpecStats

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


def spec_line(before: SpecStats, after: SpecStats) -> str:
    rounds = after.num_rounds - before.num_rounds
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted - before.num_accepted
    if not drafts:
        return "no drafts"
    per_pos = []
    for i, (d, a) in enumerate(zip(after.drafts_at, after.accepted_at, strict=True)):
        d0 = before.drafts_at[i] if i < len(before.drafts_at) else 0
        a0 = before.accepted_at[i] if i < len(before.accepted_at) else 0
        per_pos.append(f"{100 * (a - a0) / (d - d0):.0f}%" if d > d0 else "-")
    return (f"drafts {rounds} draft tokens {drafts} accepted {accepted} "
            f"({100 * accepted / drafts:.1f}%) mean acceptance length "
            f"{1 + accepted / rounds:.2f} per position {' '.join(per_pos)}")


def _same(tokens: list[list[int]], base: list[list[int]]) -> str:
    """How many outputs equal the reference's, and where the others first differ."""
    diverge = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)))
               for a, b in zip(tokens, base, strict=True) if a != b]
    text = f"{len(tokens) - len(diverge)}/{len(tokens)}"
    return text + (f" (others differ from token {diverge})" if diverge else "")


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, together: bool
          ) -> tuple[list[list[int]], float, str]:
    before = copy.deepcopy(llm.engine.local_core.speculation.stats)
    t0 = time.perf_counter()
    outs = (llm.generate(prompts, params) if together
            else [llm.generate([p], params)[0] for p in prompts])
    dt = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    after = llm.engine.local_core.speculation.stats
    return tokens, sum(map(len, tokens)) / dt, spec_line(before, after)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtp", default=None, help="MTP module from `kvserve train-mtp`")
    p.add_argument("--mtp-k", type=int, default=1, help="MTP drafts per step")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    args = p.parse_args()
    configs = [
        ("baseline", "auto", None, "baseline"),
        ("ngram", "auto", {"method": "ngram", "num_speculative_tokens": 3}, "baseline"),
        ("mtp", "auto", {"method": "mtp", "model": args.mtp, "num_speculative_tokens": args.mtp_k},
         "baseline"),
        ("baseline-bf16", "none", None, "baseline-bf16"),
        ("draft-int4", "none", {"method": "draft_model", "quantization": "int4",
                                "num_speculative_tokens": 3}, "baseline-bf16"),
    ]
    only = set(args.only.split(",")) if args.only else None
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results: dict[tuple[str, str], tuple[list[list[int]], float]] = {}
    for name, quant, spec, ref in configs:
        if (only and name not in only) or (name == "mtp" and not args.mtp):
            continue
        llm = LLM(quantization=quant, speculative_config=spec)
        chat = [llm.render_chat([{"role": "user", "content": t}]) for t in CHAT]
        copy_ = [llm.render_chat([{"role": "user", "content": t}]) for t in COPY]
        llm.generate(chat[:1], SamplingParams(temperature=0, max_tokens=8))  # warm up
        for run, prompts, together in (("chat", chat, False), ("copy", copy_, False),
                                       ("c32", (chat + copy_) * 2, True)):
            tokens, tps, line = timed(llm, prompts, params, together)
            results[(name, run)] = (tokens, tps)
            base = results.get((ref, run))
            same = "-" if base is None or ref == name else _same(tokens, base[0])
            speed = "" if base is None or ref == name else f" (x{tps / base[1]:.2f} {ref})"
            print(f"{name:14s} {run:5s} {tps:6.1f} tok/s{speed}  identical: {same}  "
                  f"{line}", flush=True)
        del llm


if __name__ == "__main__":
    main()
