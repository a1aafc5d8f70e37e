"""Streams against a long prompt: how long do users who are streaming wait between two tokens
while another user's long prompt is computed, and what does that cost the long prompt?

    python benchmarks/long_prompt_stall.py [--model M.gguf] [--kvserve-args "..."]
        [--streams 4] [--stream-tokens 150] [--long-tokens 7000] [--long-at 3]
        [--only kvserve,llama-server] [--llama-server-args "..."]

Each server is started cold (no warm-up request: the numbers are a new server's) on a free
port, one at a time:

  kvserve       `kvserve serve --model M` plus --kvserve-args (e.g. "--target-itl-ms 0" for
                the token budget alone)
  llama-server  llama.cpp's server (built by benchmarks/vs_llamacpp.py's harness when missing)
                with `-t 2 -np` streams + 1 and a context that holds every request

--streams clients each stream --stream-tokens tokens (temperature 0, ignore_eos) after a
--stream-prompt-tokens prompt; --long-at seconds after they start, one more client sends a
--long-tokens prompt for one token. Prompts are random token ids (distinct per request, so no
prefix-cache hits), the same for every server. Printed per server: the streams' gaps between
two tokens while the long prompt is computed (from its send to its first token: median, p99,
max, and how many), the gap median before it came, and the long prompt's TTFT; plus the CPU
(`lscpu`'s model name). A server streams a chunk per token (kvserve one per step), so a gap is
the time between two chunks of one stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvserve.bench import peers as harness

# Token ids every model this is run with has (the default model's vocabulary is 49,152):
# random prompts from this range are valid everywhere, and never a chat template's specials.
TOKEN_RANGE = (1000, 30000)


@dataclass
class Stream:
    """One client's chunk times (perf_counter seconds)."""

    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    error: str | None = None


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                   out: Stream) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    out.sent = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    out.error = str(chunk["error"])
                    return
                if any(c.get("text") or c.get("finish_reason") is None
                       for c in chunk.get("choices", [])):
                    out.chunks.append(time.perf_counter())
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"


async def run(url: str, args: argparse.Namespace) -> tuple[list[Stream], Stream]:
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    streams = [Stream() for _ in range(args.streams)]
    long = Stream()
    prompts = [prompt(args.stream_prompt_tokens) for _ in streams]
    long_prompt = prompt(args.long_tokens)
    timeout = httpx.Timeout(args.timeout, connect=30)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        tasks = [asyncio.create_task(complete(client, url, p, args.stream_tokens, s))
                 for p, s in zip(prompts, streams, strict=True)]
        await asyncio.sleep(args.long_at)
        tasks.append(asyncio.create_task(complete(client, url, long_prompt, 1, long)))
        await asyncio.gather(*tasks)
    return streams, long


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summarize(name: str, streams: list[Stream], long: Stream) -> dict:
    errors = [s.error for s in [*streams, long] if s.error]
    if errors or not long.chunks:
        return {"server": name, "errors": errors or ["the long prompt got no token"]}
    start, end = long.sent, long.chunks[0]
    during, before = [], []
    for s in streams:
        for a, b in zip(s.chunks, s.chunks[1:], strict=False):
            if start < b <= end:
                during.append(b - a)
            elif b <= start:
                before.append(b - a)
    return {"server": name, "gaps_during": len(during),
            "gap_median_ms": 1e3 * statistics.median(during) if during else None,
            "gap_p99_ms": 1e3 * quantile(during, 0.99) if during else None,
            "gap_max_ms": 1e3 * max(during) if during else None,
            "gap_before_median_ms": 1e3 * statistics.median(before) if before else None,
            "long_ttft_s": end - start}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return harness.machine()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return harness.machine()


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    from kvserve.models.paths import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="a GGUF both servers load (default: kvserve's default model)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=150)
    p.add_argument("--stream-prompt-tokens", type=int, default=32)
    p.add_argument("--long-tokens", type=int, default=7000)
    p.add_argument("--long-at", type=float, default=3.0,
                   help="seconds after the streams start that the long prompt is sent")
    p.add_argument("--only", default="kvserve", help="kvserve,llama-server")
    p.add_argument("--kvserve-args", default="", help="flags for kvserve serve")
    p.add_argument("--llama-server-args", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--cache-dir", type=Path, default=Path("~/.cache/kvserve-bench"))
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args()
    if args.streams < 1 or args.stream_tokens < 2 or args.long_tokens < 1:
        p.error("--streams, --stream-tokens and --long-tokens must be positive")
    model = args.model or default_model_path()
    if model is None:
        p.error("no --model and the default model is not installed")
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="kvserve-stall-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    context = args.stream_prompt_tokens + args.stream_tokens + args.long_tokens + 64
    servers: list[tuple[str, tuple[str, ...]]] = []
    only = args.only.split(",")
    if "kvserve" in only:
        extra = shlex.split(args.kvserve_args)
        servers.append((f"kvserve {args.kvserve_args}".strip(), (
            *harness.KVSERVE, "serve", "--port", "{port}", "--model", str(model), *extra)))
    if "llama-server" in only:
        peers = harness.Peers(args.cache_dir.expanduser())
        if not peers.has("llama-server"):
            peers.build("llama-server")
        slots = args.streams + 1
        servers.append((f"llama-server -np {slots}", (
            str(peers.llama_server), "-m", str(model), "--host", "127.0.0.1", "--port",
            "{port}", "-t", str(harness.THREADS), "-np", str(slots), "-c",
            str(slots * context), *shlex.split(args.llama_server_args))))
    results = []
    for name, argv in servers:
        harness.log(name)
        safe = "".join(c if c.isalnum() else "-" for c in name)[:60]
        server = harness.Server(harness.ServerSpec(argv, "/health"), out_dir / f"{safe}.log",
                                args.start_timeout, warmup=False)
        try:
            streams, long = asyncio.run(run(server.url, args))
            if name.startswith("kvserve"):  # what the scheduler did, step by step
                steps = httpx.get(f"{server.url}/v1/engine/steps?limit=1000", timeout=30,
                                  trust_env=False).text
                (out_dir / f"{safe}-steps.json").write_text(steps)
        finally:
            server.stop()
        summary = summarize(name, streams, long)
        harness.log(f"  {summary}")
        results.append(summary)
    print(f"\n{args.streams} streams of {args.stream_tokens} tokens ({args.stream_prompt_tokens}"
          f"-token prompts), a {args.long_tokens}-token prompt {args.long_at:g} s in; model "
          f"{model.name}; CPU {cpu_model()}; cold servers; logs in {out_dir}\n")
    print("| server | gaps while the prompt runs: median / p99 / max ms (n) | gap median "
          "before, ms | long prompt TTFT s |\n|---|---|---|---|")
    for r in results:
        if "errors" in r:
            print(f"| {r['server']} | errors: {'; '.join(r['errors'])[:200]} | | |")
            continue
        print(f"| {r['server']} | {fmt(r['gap_median_ms'])} / {fmt(r['gap_p99_ms'])} / "
              f"{fmt(r['gap_max_ms'])} ({r['gaps_during']}) | "
              f"{fmt(r['gap_before_median_ms'])} | {fmt(r['long_ttft_s'], 2)} |")
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
