#!/usr/bin/env python3
"""A soak of a kvserve server: a bounded, seeded mix of good, awkward and hostile requests for
a while, then a report of what came back and what the server kept.

The mix (weights in MIX): streaming and whole completions and chats, streams cut after a few
chunks, slow consumers, n > 1 with logprobs, prefix-sharing groups, cache_salt, JSON-schema
requests, and hostile ones (bad JSON, wrong types, out-of-range values, an oversized body,
context overflow, huge n / logprobs / stop lists / logit_bias maps, invalid token ids, an
unknown model, deep nesting), each of which must get its 4xx. Arrivals are steady, Poisson or
bursty around --rate, with at most --concurrency in flight (arrivals wait while that many
are).

Checked at the end: no 5xx, no unexpected status, every successful stream ended with [DONE],
the server back to 0 running and 0 waiting, and its integrity report clean with every KV block
free. Per window (--window seconds): requests by outcome, TTFT and ITL p50/p99, the server's
RSS (with --spawn), the worst /health latency.

usage: soak.py [--base-url URL | --spawn "SERVER FLAGS"] [--duration S] [--rate R]
               [--concurrency C] [--arrivals steady|poisson|bursty] [--seed N] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_split import ROOT, serve, stop  # noqa: E402

MODEL = None  # filled from /v1/models

GOOD = ["stream_completion", "completion", "stream_chat", "chat", "cut_stream", "slow_reader",
        "n2_logprobs", "shared_prefix", "salted", "json_schema"]
HOSTILE = {  # kind -> the statuses it may get
    "bad_json": {400}, "wrong_type": {400}, "out_of_range": {400}, "oversized": {413},
    "context_overflow": {400}, "huge_n": {400}, "huge_logprobs": {400}, "huge_stop": {400},
    "huge_logit_bias": {400}, "bad_token_ids": {400}, "unknown_model": {404},
    "deep_nesting": {400},
}
MIX = {**dict.fromkeys(GOOD, 8), **dict.fromkeys(HOSTILE, 1)}
WORDS = ["the", "harbour", "boats", "people", "work", "morning", "light", "river", "stone",
         "market", "bread", "city", "winter", "road", "music", "garden", "window", "story"]
PREFIXES = [" ".join(random.Random(i).choices(WORDS, k=120)) for i in range(4)]


@dataclass
class Outcome:
    kind: str
    start: float
    status: int | None = None  # None: the request itself failed (connection, timeout)
    ok: bool = False  # the outcome expected for its kind
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    longest_silence: float = 0.0
    end: float = 0.0


def body_for(kind: str, rng: random.Random) -> tuple[str, dict | bytes]:
    """(path, JSON body or raw bytes) for one request of `kind`."""
    words = " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))
    base = {"model": MODEL, "prompt": words, "max_tokens": rng.randint(4, 48),
            "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 10**6)}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": words}],
            "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.7])}
    comp, chats = "/v1/completions", "/v1/chat/completions"
    if kind in ("stream_completion", "cut_stream", "slow_reader"):
        return comp, {**base, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "completion":
        return comp, base
    if kind == "stream_chat":
        return chats, {**chat, "stream": True}
    if kind == "chat":
        return chats, chat
    if kind == "n2_logprobs":
        return comp, {**base, "n": 2, "logprobs": 2}
    if kind == "shared_prefix":
        return comp, {**base, "prompt": rng.choice(PREFIXES) + " " + words}
    if kind == "salted":
        return comp, {**base, "prompt": rng.choice(PREFIXES), "cache_salt": f"t{rng.randint(0, 3)}"}
    if kind == "json_schema":
        return chats, {**chat, "max_tokens": 64, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"word": {"enum": WORDS[:5]},
                                                 "n": {"type": "integer", "minimum": 0,
                                                       "maximum": 99}},
                "required": ["word", "n"], "additionalProperties": False}}}}
    if kind == "bad_json":
        return comp, b'{"prompt": "unterminated'
    if kind == "wrong_type":
        return comp, {**base, "max_tokens": "many"}
    if kind == "out_of_range":
        return comp, {**base, "temperature": -3}
    if kind == "oversized":
        return comp, json.dumps({**base, "prompt": "x" * (5 << 20)}).encode()
    if kind == "context_overflow":
        return comp, {**base, "max_tokens": 10**7}
    if kind == "huge_n":
        return comp, {**base, "n": 10**6}
    if kind == "huge_logprobs":
        return comp, {**base, "logprobs": 10**4}
    if kind == "huge_stop":
        return comp, {**base, "stop": ["z" * 10] * 10**4}
    if kind == "huge_logit_bias":
        return comp, {**base, "logit_bias": {str(i): 1 for i in range(10**5)}}
    if kind == "bad_token_ids":
        return comp, {**base, "prompt": [1, 2, 10**9]}
    if kind == "unknown_model":
        return comp, {**base, "model": "no-such-model"}
    assert kind == "deep_nesting"
    return comp, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random) -> Outcome:
    out = Outcome(kind, time.perf_counter())
    path, body = body_for(kind, rng)
    kw = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    try:
        if isinstance(body, dict) and body.get("stream"):
            await _stream(client, path, kw, kind, out)
        else:
            r = await client.post(path, **kw)
            out.status = r.status_code
            want = HOSTILE.get(kind, {200})
            out.ok = r.status_code in want
            if out.ok and r.status_code == 200:
                out.ttft = time.perf_counter() - out.start
            elif not out.ok:
                out.error = r.text[:200]
            if r.status_code != 200 and r.status_code < 500:
                err = r.json().get("error", {}) if r.headers.get(
                    "content-type", "").startswith("application/json") else {}
                if not err.get("message"):
                    out.ok, out.error = False, f"no OpenAI error body: {r.text[:120]}"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.end = time.perf_counter()
    if not (isinstance(body, dict) and body.get("stream")):
        out.longest_silence = out.end - out.start  # a whole response: silent until it comes
    return out


async def _stream(client: httpx.AsyncClient, path: str, kw: dict, kind: str,
                  out: Outcome) -> None:
    cut_after = 3 if kind == "cut_stream" else None
    async with client.stream("POST", path, **kw) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = (await r.aread()).decode(errors="replace")[:200]
            return
        last = out.start  # the wait for the first chunk counts as silence too
        chunks, done = 0, False
        async for line in r.aiter_lines():
            now = time.perf_counter()
            out.longest_silence = max(out.longest_silence, now - last)
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            payload = json.loads(line[6:])
            if "error" in payload:
                out.error = json.dumps(payload)[:200]
                return
            if payload.get("choices"):
                if out.ttft is None:
                    out.ttft = now - out.start
                else:
                    out.itls.append(now - last)
            last = now
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                out.ok = True  # the client goes away; the server must free its blocks
                return
            if kind == "slow_reader":
                await asyncio.sleep(0.05)
        out.ok = done
        if not done:
            out.error = "stream ended without [DONE]"


async def health_watch(base: str, stop: asyncio.Event, worst: list[float]) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            with contextlib.suppress(httpx.HTTPError):
                await c.get("/health")
            worst.append(time.perf_counter() - t0)
            await asyncio.sleep(1.0)


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def soak(args: argparse.Namespace, base: str, pid: int | None) -> dict:
    global MODEL
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        MODEL = (await client.get("/v1/models")).json()["data"][0]["id"]
        kinds, weights = zip(*MIX.items(), strict=True)
        sem = asyncio.Semaphore(args.concurrency)
        outcomes: list[Outcome] = []
        tasks: set[asyncio.Task] = set()
        stop = asyncio.Event()
        health: list[float] = []
        watcher = asyncio.create_task(health_watch(base, stop, health))
        windows: list[dict] = []
        t_start = time.perf_counter()
        next_window = t_start
        t = t_start

        async def run(kind: str, seed: int) -> None:
            try:
                outcomes.append(await one(client, kind, random.Random(seed)))
            finally:
                sem.release()

        while t - t_start < args.duration:
            if t >= next_window:
                windows.append({"start_s": round(t - t_start, 1), "rss_mb": rss_mb(pid)})
                next_window += args.window
            if args.arrivals == "steady":
                gap = 1 / args.rate
            elif args.arrivals == "poisson":
                gap = rng.expovariate(args.rate)
            else:  # bursty: a burst of 4x the concurrency, then quiet
                gap = 0.0 if rng.random() < 0.9 else 4 * args.concurrency / args.rate
            await asyncio.sleep(gap)
            await sem.acquire()  # at --concurrency in flight, arrivals wait (no backlog)
            task = asyncio.create_task(run(rng.choices(kinds, weights)[0], rng.randrange(2**32)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            t = time.perf_counter()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t_start
        # Back to idle: nothing running or waiting, every block free, integrity clean.
        deadline = time.perf_counter() + 120
        while True:
            stats = (await client.get("/v1/engine/stats")).json()
            if stats["running"] == 0 and stats["waiting"] == 0 or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.5)
        integrity = (await client.get("/v1/engine/integrity")).json()
        stop.set()
        await watcher
    for w_i, w in enumerate(windows):
        lo, hi = w["start_s"], w["start_s"] + args.window
        ws = [o for o in outcomes if lo <= o.start - t_start < hi]
        ttft = [o.ttft * 1e3 for o in ws if o.ttft is not None and o.kind in GOOD]
        itl = [x * 1e3 for o in ws for x in o.itls]
        w.update(requests=len(ws), ok=sum(o.ok for o in ws),
                 ttft_p50_ms=pct(ttft, 0.5), ttft_p99_ms=pct(ttft, 0.99),
                 itl_p50_ms=pct(itl, 0.5), itl_p99_ms=pct(itl, 0.99), index=w_i)
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        k = by_kind.setdefault(o.kind, {})
        label = "ok" if o.ok else f"unexpected {o.status}" if o.status else "failed"
        k[label] = k.get(label, 0) + 1
    bad = [o for o in outcomes if not o.ok]
    return {
        "duration_s": round(elapsed, 1), "requests": len(outcomes),
        "ok": sum(o.ok for o in outcomes),
        "5xx": sum(1 for o in outcomes if o.status is not None and o.status >= 500),
        "not_ok": len(bad), "first_not_ok": [(o.kind, o.status, o.error) for o in bad[:5]],
        "by_kind": by_kind, "windows": windows,
        "health_worst_s": round(max(health, default=0.0), 3),
        "longest_silence_s": round(max((o.longest_silence for o in outcomes), default=0.0), 2),
        "idle_after": {"running": stats["running"], "waiting": stats["waiting"]},
        "integrity": integrity,
        "leaked_blocks": integrity["kv_blocks"] - integrity["kv_free_blocks"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None)
    p.add_argument("--spawn", default=None, metavar="FLAGS",
                   help="start `kvserve serve FLAGS` on --port and soak it (RSS is read too)")
    p.add_argument("--port", type=int, default=8741)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    p.add_argument("--window", type=float, default=300.0, help="report window, seconds")
    p.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--arrivals", choices=["steady", "poisson", "bursty"], default="poisson")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    args = p.parse_args()
    proc = None
    if args.spawn is not None:
        proc = serve(ROOT, shlex.split(args.spawn), args.port,
                     Path(f"/tmp/kvserve-soak-{args.port}.log"))
        base = f"http://127.0.0.1:{args.port}"
    else:
        base = args.base_url or "http://127.0.0.1:8000"
    try:
        report = asyncio.run(soak(args, base, proc.pid if proc else None))
    finally:
        if proc is not None:
            stop(proc)
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    passed = (report["5xx"] == 0 and report["not_ok"] == 0 and report["leaked_blocks"] == 0
              and report["integrity"]["ok"] and report["idle_after"] == {"running": 0,
                                                                          "waiting": 0})
    print("PASS" if passed else "FAIL", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
