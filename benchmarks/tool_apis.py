#!/usr/bin/env python3
"""What issue 38's agent features cost, on one machine, rounds alternated:

- grammar: tool_choice auto's lazy grammars. `kvserve bench serve` (random 256 in / at most
  128 out, chat endpoint, tools declared, tool_choice auto) at concurrency 1 and 32 against
  three servers that differ only in the parser: `hermes` and `qwen3_coder` (whose auto runs
  their lazy grammars) and `mistral` (none). All render the same prompts, tools included, so
  the difference is the grammar. Random prompts do not ask for a call; one opened by chance
  would be held to a grammar on one server only.
- apis: one answer through /v1/chat/completions, /v1/responses and /v1/messages, the same
  conversation and the same greedy tokens, 128 requests at concurrency 32, whole and
  streamed.

usage: tool_apis.py [--rounds 3] [--parts grammar,apis] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_split import PYTHON, ROOT, serve, stop  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
LOADS = {"c1": ["--num-prompts", "12", "--max-concurrency", "1"],
         "c32": ["--num-prompts", "64", "--max-concurrency", "32"]}
QUESTION = "Write a short paragraph about the history of the bicycle."


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                if line.startswith("Model name"))


def bench(port: int, load: str, out: Path, seed: int) -> dict:
    cmd = [str(PYTHON), "-m", "kvserve", "bench", "serve", "--base-url",
           f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions", "--dataset",
           "random", "--random-input-len", "256", "--random-output-len", "128", *LOADS[load],
           "--seed", str(seed), "--temperature", "0", "--no-progress", "--save-result",
           str(out), "--extra-body", json.dumps({"tools": [WEATHER], "tool_choice": "auto"}),
           # A grammar ends its request at the end of sequence, ignore_eos or not (the
           # sampler's rule for constrained rows): greedy answers that end where the model
           # ends them are the same tokens on both servers, so throughputs compare.
           "--no-ignore-eos"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def grammar_part(rounds: int, flags: list[str], out: Path) -> None:
    parsers = {"hermes grammar": "hermes", "qwen3_coder grammar": "qwen3_coder",
               "no grammar (mistral)": "mistral"}
    ports = {name: 8741 + i for i, name in enumerate(parsers)}
    procs = {name: serve(ROOT, ["--enable-auto-tool-choice", "--tool-call-parser", parser,
                                *flags], ports[name], out / f"server-{parser}.log")
             for name, parser in parsers.items()}
    results: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, int], set[int]] = {}  # the same on every server
    try:
        for r in range(rounds):
            for load in LOADS:
                names = list(parsers) if r % 2 == 0 else list(reversed(parsers))
                for name in names:
                    s = bench(ports[name], load, out / f"{load}-{parsers[name]}-{r}.json", r)
                    assert s["failed"] == 0, s
                    results.setdefault((load, name), []).append(s["output_throughput"])
                    tokens.setdefault((load, r), set()).add(s["total_output_tokens"])
                    print(f"round {r} {load} {name}: {s['output_throughput']:.1f} tok/s, "
                          f"{s['total_output_tokens']} tokens", file=sys.stderr)
    finally:
        for p in procs.values():
            stop(p)
    med = statistics.median
    same = all(len(t) == 1 for t in tokens.values())
    print(f"\ntool_choice auto's lazy grammar, random 256/128 chat requests with a tool, "
          f"medians of {rounds} rounds (CPU: {cpu()}; output tokens the same on every "
          f"server in every run: {same})")
    print("| load | " + " | ".join(f"{n}, tok/s" for n in parsers)
          + " | hermes / none | qwen3_coder / none |")
    print("|---" * (len(parsers) + 3) + "|")
    for load in LOADS:
        a, b, c = (med(results[(load, n)]) for n in parsers)
        print(f"| {load} | {a:.1f} | {b:.1f} | {c:.1f} | {a / c:.3f} | {b / c:.3f} |")


def request(api: str, stream: bool) -> tuple[str, dict]:
    turn = [{"role": "user", "content": QUESTION}]
    if api == "chat":
        return "/v1/chat/completions", {"messages": turn, "max_tokens": 64, "temperature": 0,
                                        "stream": stream}
    if api == "responses":
        return "/v1/responses", {"input": QUESTION, "max_output_tokens": 64, "temperature": 0,
                                 "stream": stream}
    return "/v1/messages", {"messages": turn, "max_tokens": 64, "temperature": 0,
                            "stream": stream}


async def load(port: int, api: str, stream: bool, n: int = 128, concurrency: int = 32
               ) -> float:
    """Seconds for `n` requests, `concurrency` at a time, each read to its end."""
    path, body = request(api, stream)
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
        async def one() -> None:
            async with limit:
                r = await c.post(path, json=body)
                r.raise_for_status()
                if not stream:
                    r.json()

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t0


def apis_part(rounds: int, flags: list[str], out: Path) -> None:
    port = 8745
    proc = serve(ROOT, flags, port, out / "server-apis.log")
    apis = ("chat", "responses", "messages")
    times: dict[tuple[str, bool], list[float]] = {}
    try:
        asyncio.run(load(port, "chat", False, n=8))  # warm-up
        for r in range(rounds):
            for stream in (False, True):
                order = apis if r % 2 == 0 else tuple(reversed(apis))
                for api in order:
                    t = asyncio.run(load(port, api, stream))
                    times.setdefault((api, stream), []).append(t)
                    print(f"round {r} {api} stream={stream}: {t:.2f} s", file=sys.stderr)
    finally:
        stop(proc)
    med = statistics.median
    print(f"\none answer through each API: 128 requests of the same conversation (64 greedy "
          f"tokens), 32 at a time, medians of {rounds} rounds (CPU: {cpu()})")
    print("| API | whole, s | vs chat | streamed, s | vs chat |")
    print("|---|---|---|---|---|")
    for api in apis:
        row = []
        for stream in (False, True):
            t, base = med(times[(api, stream)]), med(times[("chat", stream)])
            row += [f"{t:.2f}", f"{t / base:.3f}"]
        print(f"| {api} | " + " | ".join(row) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", default="grammar,apis")
    p.add_argument("--out", type=Path, default=Path("~/.cache/kvserve-bench/tool-apis"))
    p.add_argument("server_flags", nargs="*")
    args = p.parse_args()
    out = args.out.expanduser() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    parts = args.parts.split(",")
    if "grammar" in parts:
        grammar_part(args.rounds, args.server_flags, out)
    if "apis" in parts:
        apis_part(args.rounds, args.server_flags, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
