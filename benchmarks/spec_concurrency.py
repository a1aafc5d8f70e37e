"""Speculative decoding under load: is it ever slower than none (issue 39)?

    python benchmarks/spec_concurrency.py --model TARGET.gguf [--draft DRAFT.gguf]
        [--mtp MTP.safetensors] [--concurrency 1,8,32] [--rounds 3] [--max-tokens 128]
        [--k 3] [--spec '{"max_batch_size": 8}']

Offline engines (`kvserve.LLM`) on the same target, side by side in one process: without
speculation, with the draft model (method draft_model) and with a trained MTP drafter
(method mtp), each with its defaults (adaptive depth on) and `num_speculative_tokens` --k.
For each concurrency c, c greedy chat requests (spec_pair.py's code, chat and summary
prompts, in turn) go to each engine at once (c=1: each of those prompts alone, one after
another), the engines' order alternating round by round; the figure is output tokens over
the wall time, median of the rounds, and the
speed-up is each engine's over the engine without speculation. Greedy, so every engine must
give the same tokens: that is checked and printed. Then, per drafter and c, why: acceptance
by draft position, a draft step's time against the target's decode step, and a verify row's
cost, from the engines' step records.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from spec_pair import SETS

from kvserve.bench.peers import machine
from kvserve.engine.llm import LLM
from kvserve.sample.sampling_params import SamplingParams
from kvserve.spec_decode.coordinator import fit_line


def _mark(llm: LLM) -> tuple[int, list[int], list[int]]:
    """Where the engine's step records and speculation totals stand now."""
    core = llm.engine.local_core
    st = core.speculation.stats if core.speculation else None
    step = core.steps[-1].step if core.steps else -1
    return step, list(st.drafts_at) if st else [], list(st.accepted_at) if st else []


def _steps(llm: LLM, mark) -> list:
    """Decode-only step records (no prompt tokens) since `mark`."""
    return [r for r in llm.engine.local_core.steps
            if r.step > mark[0] and r.prefill_tokens == 0 and r.decode_tokens > 0]


def _decode_step(llm: LLM, mark) -> float:
    """The median time of a decode step since `mark` (its total)."""
    return statistics.median(r.total for r in _steps(llm, mark))


def _why(llm: LLM, mark, target_step: float) -> str:
    """Acceptance per position, draft time over the target's step, a verify row's cost."""
    st = llm.engine.local_core.speculation.stats
    at = []
    for i, (d, a) in enumerate(zip(st.drafts_at, st.accepted_at, strict=True)):
        d0 = mark[1][i] if i < len(mark[1]) else 0
        a0 = mark[2][i] if i < len(mark[2]) else 0
        if d > d0:
            at.append(f"{(a - a0) / (d - d0):.2f}")
    steps = _steps(llm, mark)
    drafted = [r.draft for r in steps if r.draft_tokens > 0]
    draft = f"{statistics.median(drafted) / target_step:.2f}" if drafted else "-"
    fitted = fit_line((r.decode_tokens, r.forward + r.sample) for r in steps)
    row = f"{1e3 * fitted[1]:.2f} ms" if fitted is not None else "-"
    return f"{' / '.join(at) or '-'} | {draft} | {row}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the target's GGUF")
    p.add_argument("--draft", type=Path, default=None, help="a draft model's GGUF")
    p.add_argument("--mtp", type=Path, default=None, help="an MTP drafter (train-mtp)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--spec", default="{}",
                   help="more --speculative-config fields for both drafters (JSON)")
    p.add_argument("--kv-cache-memory", default="2GiB")
    args = p.parse_args()
    for path in (args.model, args.draft, args.mtp):
        if path is not None and not path.is_file():
            p.error(f"no such file: {path}")
    if args.draft is None and args.mtp is None:
        p.error("give --draft, --mtp or both")
    levels = [int(c) for c in args.concurrency.split(",")]
    extra = json.loads(args.spec)
    configs: dict[str, dict | None] = {"none": None}
    if args.draft:
        configs["draft_model"] = {"method": "draft_model", "model": str(args.draft),
                                  "num_speculative_tokens": args.k, **extra}
    if args.mtp:
        configs["mtp"] = {"method": "mtp", "model": str(args.mtp),
                          "num_speculative_tokens": args.k, **extra}
    llms = {name: LLM(str(args.model), kv_cache_memory=args.kv_cache_memory,
                      max_num_seqs=max(levels),
                      **({"speculative_config": c} if c else {}))
            for name, c in configs.items()}
    prompts = [q for qs in zip(*SETS.values(), strict=False) for q in qs]
    prompts += [q for qs in SETS.values() for q in qs if q not in prompts]
    chats = [llms["none"].render_chat([{"role": "user", "content": q}]) for q in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in llms.values():  # warm: the first steps calibrate and fault pages in
        llm.generate(chats[:2], SamplingParams(temperature=0, max_tokens=8))
    print(f"machine: {machine()}; target {args.model.name}; k={args.k}; "
          f"{args.rounds} rounds, the engines' order alternating")
    rows, why = [], []
    for c in levels:
        marks = {n: _mark(llm) for n, llm in llms.items()}
        # c=1: each prompt alone, one after another; else c of them at once
        waves = [[q] for q in chats] if c == 1 else [[chats[i % len(chats)] for i in range(c)]]
        rates: dict[str, list[float]] = {n: [] for n in llms}
        tokens: dict[str, list[list[int]]] = {}
        for r in range(args.rounds):
            for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
                t0 = time.perf_counter()
                outs = [o for wave in waves for o in llms[name].generate(wave, params)]
                took = time.perf_counter() - t0
                tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
                rates[name].append(sum(len(t) for t in tokens[name]) / took)
        base = statistics.median(rates["none"])
        cells = []
        for name in llms:
            rate = statistics.median(rates[name])
            same = tokens[name] == tokens["none"]
            cells.append(f"{rate:.1f} ({rate / base:.2f}x{'' if same else ', DIFFERENT'})")
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
        target_step = _decode_step(llms["none"], marks["none"])
        for name in llms:
            if name != "none":
                why.append(f"| {c} | {name} | " + _why(llms[name], marks[name], target_step)
                           + " |")
    print("\n| c | " + " | ".join(f"{n} tok/s" for n in llms) + " |")
    print("|---" * (len(llms) + 1) + "|")
    print("\n".join(rows))
    print("\nwhy (decode steps without prompt work): acceptance at draft positions 1, 2, "
          "3...; a step's draft time over the target's decode step without speculation; a "
          "verify row's cost (least squares of forward + sample over rows)")
    print("| c | drafter | acceptance by position | draft / target step | verify row |")
    print("|---|---|---|---|---|")
    print("\n".join(why))
    for llm in llms.values():
        llm.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
