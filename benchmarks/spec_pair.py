"""Speculative decoding with a real draft model, kvserve beside llama-server (issue 39).

    python benchmarks/spec_pair.py --model TARGET.gguf --draft DRAFT.gguf [--rounds 3]
        [--max-tokens 128] [--k 3] [--kvserve-spec '{"draft_vocab_size": 16384}']
        [--mtp MTP.safetensors] [--llama-server-args "..."]

Four servers up at once, on the same two files: kvserve and llama-server each without
speculation and with the draft model (kvserve `--speculative-config` method draft_model with
`num_speculative_tokens` --k; llama-server `--model-draft` with `--spec-draft-n-max` --k),
and with --mtp a fifth: kvserve with that trained MTP drafter (method mtp, the same k).
Each round sends every prompt of three sets (code, chat, and a summary of a document in the
prompt) to each server in turn, one request at a time, the order alternating round by
round: a streamed chat completion, greedy, --max-tokens at most, ending where the model
ends it. Its decode speed is the completion tokens after the first (the usage the server
reports) over the time from the first streamed token to the last; each server's first
token comes from the prompt alone, so the prompt's length does not weigh in.

Printed: per set, each server's median decode speed, the speed-up of each server's
speculation over itself, kvserve's speculative speed over llama-server's, and whether
kvserve's answers were the same text with and without speculation (greedy: they must be);
then the peak RSS of each server and the machine's CPU. The pair used in issue 39:
Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (benchmarks/fetch_qwen_coder.py --model 1.5b
and 0.5b), which share a tokenizer.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
from vs_llamacpp import Workload, add_beside_llama_server_args, beside_llama_server, server_spec

from kvserve.bench.peers import THREADS, Server, command_str, machine

CODE = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a JavaScript function that debounces another function.",
]
CHAT = [
    "Explain how a rainbow forms, in a short paragraph.",
    "Give three tips for staying focused while studying.",
    "What are the main differences between cats and dogs as pets?",
]
DOCUMENT = (
    "The town council met on Tuesday evening to discuss the renovation of the old library. "
    "The building, which opened in 1911, has been closed since the spring because water "
    "leaked through the roof during the storms in March. Engineers hired by the council "
    "found that the roof beams are sound but that most of the slate tiles must be replaced, "
    "and that the heating system no longer meets the safety rules. The cost of the work is "
    "estimated at 2.4 million, of which the regional government has promised to pay half. "
    "Several residents spoke at the meeting. A retired teacher asked that the reading room "
    "keep its original wooden shelves, and a parent asked for a larger space for children's "
    "books and for longer opening hours on Saturdays. The head librarian said that the "
    "collection of local newspapers, which goes back to 1850, was moved to a dry storage "
    "room in April and was not damaged. The council voted seven to two to start the work in "
    "September. The library should reopen in the autumn of next year. Until then, a small "
    "lending point will stay open in the community centre on weekday afternoons, and the "
    "mobile library will visit the three villages of the district every second week."
)
SETS = {"code": CODE, "chat": CHAT,
        "summary": [f"Summarise this document in five bullet points.\n\n{DOCUMENT}"]}
NAMES = ("kvserve", "kvserve+draft", "llama-server", "llama-server+draft")
MTP = "kvserve+mtp"


def decode_rate(url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """(completion tokens after the first per second of streaming, the answer's text)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600,
                      trust_env=False) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    text.append(piece)
    if first is None or last is None or last <= first or tokens < 2:
        raise RuntimeError(f"{url}: too short an answer to time ({tokens} tokens)")
    return (tokens - 1) / (last - first), "".join(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_beside_llama_server_args(p, "/tmp/kvserve-spec-pair")
    p.add_argument("--draft", type=Path, required=True, help="the draft model's GGUF")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="draft tokens per step, both servers")
    p.add_argument("--kvserve-spec", default="{}",
                   help="more fields of kvserve's --speculative-config (JSON)")
    p.add_argument("--mtp", type=Path, default=None,
                   help="also a kvserve with this MTP drafter (`kvserve train-mtp`)")
    p.add_argument("--pause", type=float, default=0.5, help="seconds idle after each request")
    args = p.parse_args()
    if not args.draft.is_file():
        p.error(f"no draft model at {args.draft}")
    if args.mtp is not None and not args.mtp.is_file():
        p.error(f"no MTP module at {args.mtp}")
    names = NAMES + ((MTP,) if args.mtp else ())
    peers = beside_llama_server(p, args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = {"method": "draft_model", "model": str(args.draft),
            "num_speculative_tokens": args.k, **json.loads(args.kvserve_spec)}
    extra = {"kvserve": "", "kvserve+draft": f"--speculative-config '{json.dumps(spec)}'",
             "llama-server": "",
             "llama-server+draft": f"--model-draft {args.draft} --spec-draft-n-max {args.k}"}
    if args.mtp:
        mtp = {"method": "mtp", "model": str(args.mtp), "num_speculative_tokens": args.k}
        extra[MTP] = f"--speculative-config '{json.dumps(mtp)}'"
    base_kv, base_ll = args.kvserve_args, args.llama_server_args
    servers: dict[str, Server] = {}
    try:
        for name in names:
            peer = name.split("+")[0]
            args.kvserve_args = f"{base_kv} {extra[name]}" if peer == "kvserve" else base_kv
            args.llama_server_args = f"{base_ll} {extra[name]}" if peer != "kvserve" \
                else base_ll
            w = Workload("spec", "", 1024, args.max_tokens, 1, 1, ())
            servers[name] = Server(server_spec(peer, w, args.model, peers, args),
                                   args.out_dir / f"{name.replace('+', '-')}.log",
                                   args.start_timeout)
        print(f"machine: {machine()}; {THREADS} threads each; target {args.model.name}, "
              f"draft {args.draft.name}, k={args.k}")
        for name, server in servers.items():
            print(f"{name}: {command_str(server.argv)}")
        rates = {(s, n): [] for s in SETS for n in names}
        answers: dict[tuple[str, str], list[str]] = {}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for set_name, prompts in SETS.items():
                for name in order:
                    texts = []
                    for prompt in prompts:
                        rate, text = decode_rate(servers[name].url, prompt, args.max_tokens)
                        rates[(set_name, name)].append(rate)
                        texts.append(text)
                        time.sleep(args.pause)
                    answers[(set_name, name)] = texts
                print(f"round {r} {set_name}: " + ", ".join(
                    f"{n} {statistics.median(rates[(set_name, n)][-len(prompts):]):.1f}"
                    for n in names) + " tok/s", flush=True)
        med = statistics.median
        print(f"\nmedian decode tok/s of {args.rounds} rounds (each prompt a sample):")
        mtp_cols = " kvserve+mtp | speed-up | kvserve+mtp / llama-server+draft |" \
            if args.mtp else ""
        print("| set | kvserve | kvserve+draft | speed-up | llama-server | llama-server+draft "
              "| speed-up | kvserve+draft / llama-server+draft |" + mtp_cols
              + " kvserve same text |")
        print("|---" * (9 + 3 * bool(args.mtp)) + "|")
        for s in SETS:
            kv, kvd, ll, lld = (med(rates[(s, n)]) for n in NAMES)
            same = all(answers[(s, "kvserve")] == answers[(s, n)] for n in names
                       if n.startswith("kvserve+"))
            row = (f"| {s} | {kv:.1f} | {kvd:.1f} | {kvd / kv:.2f}x | {ll:.1f} | {lld:.1f} | "
                   f"{lld / ll:.2f}x | {kvd / lld:.2f}x |")
            if args.mtp:
                kvm = med(rates[(s, MTP)])
                row += f" {kvm:.1f} | {kvm / kv:.2f}x | {kvm / lld:.2f}x |"
            print(f"{row} {same} |")
        for name, server in servers.items():
            print(f"{name} peak RSS: {server.peak_rss_gib():.2f} GiB")
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
