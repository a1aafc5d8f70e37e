"""kvserve and llama-server on the same GGUF, both up at once, one request at a time in turn:
ratios that hold on a machine whose speed drifts.

    python benchmarks/paired.py --model FILE.gguf [--rounds 8] [--prompt-len 500]
        [--output-len 128] [--kvserve-args "..."] [--llama-server-args "..."]

On a shared 2-core virtual machine the same run moves by a quarter within minutes (the
neighbours' load, the memory bandwidth left), more than the differences being measured, and
benchmarks/vs_llamacpp.py runs one server's workloads after the other's. Here both servers
are started first (the way vs_llamacpp.py starts them: `kvserve serve` with its defaults,
llama-server `-t 2`), then each round sends the same requests to each server in turn, one
at a time, the order alternating round by round:

  prefill   a --prompt-len prompt of random token IDs, 1 output token: TTFT
  decode    a 16-token prompt, --output-len tokens (ignore_eos): TPOT, the time from the
            first streamed token to the last over the tokens after the first

Every request has its own random prompt (no prefix-cache hit on either server). A server
waits idle while the other runs (a pause after each request lets spinning threads sleep).
Printed per round: each server's figures and their ratio; then the median of each server's
figures and the median of the per-round ratios (kvserve's speed over llama-server's), with the
machine's CPU and both servers' peak RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import time

import httpx
from vs_llamacpp import (
    Workload,
    add_beside_llama_server_args,
    beside_llama_server,
    server_spec,
)

from kvserve.bench.peers import THREADS, Server, command_str, machine


def stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, last token's time after the first s, tokens) of one completion: the tokens
    the final chunk's usage counts, else the chunks with text (random weights write tokens
    that decode to no text, or to part of a character, which a server sends with the next)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600,
                      trust_env=False) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            choice = event.get("choices") or [{}]
            if not choice[0].get("text"):
                continue
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            chunks += 1
    if first is None or last is None:
        raise RuntimeError(f"{url}: no token streamed")
    return first - t0, last - first, usage["completion_tokens"] if usage else chunks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_beside_llama_server_args(p, "/tmp/kvserve-paired")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=500)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--pause", type=float, default=1.0, help="seconds idle after each request")
    args = p.parse_args()
    if args.rounds < 1 or args.prompt_len < 1 or args.output_len < 2:
        p.error("--rounds and --prompt-len must be at least 1, --output-len at least 2")
    peers = beside_llama_server(p, args)
    # SIGTERM too stops both servers (the `finally` below), as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = ("kvserve", "llama-server")
    servers: dict[str, Server] = {}
    try:
        for name in names:
            # llama-server's slots sized for the longer request
            w = Workload("paired", "", max(args.prompt_len, 16), args.output_len, 1, 1, ())
            spec = server_spec(name, w, args.model, peers, args)
            servers[name] = Server(spec, args.out_dir / f"{name}.log", args.start_timeout)
        rng = random.Random(0)
        ttft: dict[str, list[float]] = {n: [] for n in names}
        tpot: dict[str, list[float]] = {n: [] for n in names}
        ratios: dict[str, list[float]] = {"prefill": [], "decode": []}
        print(f"machine: {machine()}; {THREADS} threads each; model {args.model.name}")
        for name, server in servers.items():
            print(f"{name}: {command_str(server.argv)}")
        for r in range(args.rounds):
            prefill = [rng.randrange(1000, 30000) for _ in range(args.prompt_len)]
            decode = [rng.randrange(1000, 30000) for _ in range(16)]
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                first, _, _ = stream(servers[name].url, prefill, 1)
                time.sleep(args.pause)
                _, rest, tokens = stream(servers[name].url, decode, args.output_len)
                time.sleep(args.pause)
                if tokens < args.output_len * 0.9:  # a chunk may carry 2 tokens; not fewer
                    raise RuntimeError(f"{name} streamed {tokens} tokens of "
                                       f"{args.output_len}")
                ttft[name].append(first)
                tpot[name].append(rest / (args.output_len - 1))
            k, ll = names
            ratios["prefill"].append(ttft[ll][-1] / ttft[k][-1])
            ratios["decode"].append(tpot[ll][-1] / tpot[k][-1])
            print(f"round {r} ({' then '.join(order)}): TTFT {ttft[k][-1] * 1e3:.0f} / "
                  f"{ttft[ll][-1] * 1e3:.0f} ms ({ratios['prefill'][-1]:.2f}x), TPOT "
                  f"{tpot[k][-1] * 1e3:.1f} / {tpot[ll][-1] * 1e3:.1f} ms "
                  f"({ratios['decode'][-1]:.2f}x)", flush=True)
        med = statistics.median
        print(f"\nmedians of {args.rounds} rounds, kvserve / llama-server:")
        for what, a, b, unit, rate in (
                ("prefill", ttft[k], ttft[ll], "TTFT ms", args.prompt_len),
                ("decode", tpot[k], tpot[ll], "TPOT ms", 1)):
            print(f"  {what}: {unit} {med(a) * 1e3:.1f} / {med(b) * 1e3:.1f}; tok/s "
                  f"{rate / med(a):.1f} / {rate / med(b):.1f}; median ratio "
                  f"{med(ratios[what]):.2f}x (min {min(ratios[what]):.2f}, max "
                  f"{max(ratios[what]):.2f})")
        for name, server in servers.items():
            print(f"  {name} peak RSS: {server.peak_rss_gib():.2f} GiB")
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
