"""`kvserve bench soak`: a bounded, seeded soak of a server, with a report of what came back
and what the server kept.

The mix (weights in MIX): streaming and whole completions and chats, streams cut after a few
chunks, slow consumers, n > 1 with logprobs, prefix-sharing groups, cache_salt, JSON-schema
requests; slow clients (a half-sent head, a silent connection, a body that stops), each of
which must be answered 408 or closed; and hostile requests (bad JSON, wrong types,
out-of-range values, an oversized body, context overflow, huge n / logprobs / stop lists /
logit_bias maps, invalid token ids, an unknown model, deep nesting), each of which must get
its 4xx. With `--faults` (a server started with KVSERVE_FAULTS naming request_error
"fault-"), requests whose id carries that marker must get their 500, and only they may.

Arrivals are steady, Poisson or bursty around --rate (or `mixed`: a minute of each in turn),
with at most --concurrency in flight; bursts (every --burst-every seconds in bursty phases)
send --burst-size requests at once on top, far beyond the server's seats and queue, so good
requests may be shed with a 429, which counts as expected.

Checked at the end: no unexpected status (no 5xx but the injected ones), every successful
stream ended with [DONE], the server back to 0 running and 0 waiting, and its integrity
report clean with every KV block free. Per window (--window seconds): requests by outcome,
TTFT and ITL p50/p99, the server's RSS (with --spawn), the worst /health latency (and, in
all, the idle server's median /health, measured before the load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvserve.faults import Faults
from kvserve.settings import positive_float

GOOD = ["stream_completion", "completion", "stream_chat", "chat", "cut_stream", "slow_reader",
        "n2_logprobs", "shared_prefix", "salted", "json_schema"]
SLOW = {"half_head": {408}, "silent": {None}, "stalled_body": {408}}  # None: closed, no word
HOSTILE = {  # kind -> the statuses it may get
    "bad_json": {400}, "wrong_type": {400}, "out_of_range": {400}, "oversized": {413},
    "context_overflow": {400}, "huge_n": {400}, "huge_logprobs": {400}, "huge_stop": {400},
    "huge_logit_bias": {400}, "bad_token_ids": {400}, "unknown_model": {404},
    "deep_nesting": {400},
}
# With --faults only. A 429 is a full queue's answer before the request ran (its fault fires
# in a step): a full soak in the suite had one of 490 requests so, its only "unexpected".
INJECTED = {"injected_error": {500, 429}}
# 429 for a good request: shed by a full queue in a burst
EXPECTED = {**dict.fromkeys(GOOD, {200, 429}), **HOSTILE, **INJECTED, **SLOW}
MIX = {**dict.fromkeys(GOOD, 8), **dict.fromkeys(SLOW, 1), **dict.fromkeys(HOSTILE, 1),
       **dict.fromkeys(INJECTED, 1)}
FAULT_MARKER = "fault-"
WORDS = ["the", "harbour", "boats", "people", "work", "morning", "light", "river", "stone",
         "market", "bread", "city", "winter", "road", "music", "garden", "window", "story"]
PREFIXES = [" ".join(random.Random(i).choices(WORDS, k=120)) for i in range(4)]


@dataclass
class Outcome:
    kind: str
    start: float
    status: int | None = None  # None: no HTTP answer (closed, or the request itself failed)
    ok: bool = False  # the outcome expected for its kind
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    longest_silence: float = 0.0
    end: float = 0.0


def body_for(kind: str, rng: random.Random, model: str) -> tuple[str, dict | bytes]:
    """(path, JSON body or raw bytes) for one request of `kind`."""
    words = " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))
    base = {"model": model, "prompt": words, "max_tokens": rng.randint(4, 48),
            "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 10**6)}
    chat = {"model": model, "messages": [{"role": "user", "content": words}],
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
    if kind == "injected_error":
        return comp, {**base, "request_id": f"{FAULT_MARKER}{rng.randrange(10**9)}"}
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


class Soak:
    def __init__(self, args: argparse.Namespace, pid: int | None) -> None:
        self.args, self.pid = args, pid
        self.rng = random.Random(args.seed)
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.model = ""
        self.outcomes: list[Outcome] = []
        self.health: list[tuple[float, float]] = []  # (time, seconds /health took)
        url = httpx.URL(args.base_url)
        self.host, self.port = url.host, url.port or 80

    # -- one request of each sort

    async def one(self, client: httpx.AsyncClient, kind: str, rng: random.Random) -> Outcome:
        out = Outcome(kind, time.perf_counter())
        if kind in SLOW:
            await self._slow_client(kind, out)
            out.end = time.perf_counter()
            return out
        path, body = body_for(kind, rng, self.model)
        kw = {"content": body, "headers": {"content-type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body}
        streaming = isinstance(body, dict) and body.get("stream")
        try:
            if streaming:
                await self._stream(client, path, kw, kind, out)
            else:
                r = await client.post(path, **kw)
                out.status = r.status_code
                out.ok = r.status_code in EXPECTED[kind]
                if out.ok and r.status_code == 200:
                    out.ttft = time.perf_counter() - out.start
                elif not out.ok:
                    out.error = r.text[:200]
                if r.status_code != 200:
                    self._check_error_body(r, out)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            out.error = f"{type(e).__name__}: {e}"
        out.end = time.perf_counter()
        if not streaming:
            out.longest_silence = out.end - out.start  # a whole response: silent until it comes
        return out

    @staticmethod
    def _check_error_body(r: httpx.Response, out: Outcome) -> None:
        err = {}
        if r.headers.get("content-type", "").startswith("application/json"):
            with contextlib.suppress(ValueError):
                err = r.json().get("error", {})
        if not isinstance(err, dict) or not err.get("message"):
            out.ok, out.error = False, f"no OpenAI error body: {r.text[:120]}"

    async def _stream(self, client: httpx.AsyncClient, path: str, kw: dict, kind: str,
                      out: Outcome) -> None:
        cut_after = 3 if kind == "cut_stream" else None
        async with client.stream("POST", path, **kw) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                out.ok = r.status_code in EXPECTED[kind]
                out.error = None if out.ok else r.text[:200]
                self._check_error_body(r, out)
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

    async def _slow_client(self, kind: str, out: Outcome) -> None:
        """A raw connection that sends part of a request (or nothing) and waits for the
        server to answer or close it."""
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            out.error = f"connect: {e}"
            return
        try:
            if kind == "half_head":
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Ty")
            elif kind == "stalled_body":
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 400\r\n\r\n{\"prompt\": ")
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), self.args.slow_client_wait)
            out.status = int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None
            out.ok = out.status in EXPECTED[kind]
            if not out.ok:
                out.error = data[:200].decode(errors="replace")
        except (TimeoutError, OSError) as e:
            out.error = f"not answered or closed within {self.args.slow_client_wait:g} s: " \
                        f"{type(e).__name__}"
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    # -- the run

    async def idle_health(self, client: httpx.AsyncClient, probes: int = 20) -> float:
        """The median /health latency of the idle server: the baseline the loaded one's is
        read against, so a slow machine is not taken for a stalled server."""
        took = []
        for _ in range(probes):
            t0 = time.perf_counter()
            await client.get("/health")
            took.append(time.perf_counter() - t0)
        return statistics.median(took)

    async def health_watch(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.args.base_url, timeout=30) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    await c.get("/health")
                self.health.append((t0, time.perf_counter() - t0))
                await asyncio.sleep(1.0)

    def _pattern(self, elapsed: float) -> str:
        if self.args.arrivals != "mixed":
            return self.args.arrivals
        return ("steady", "poisson", "bursty")[int(elapsed // self.args.phase) % 3]

    async def run(self) -> dict:
        args = self.args
        # A pooled connection is dropped by the client before the server may close it idle
        # (--header-timeout, --keep-alive-timeout): a request sent as the server closes gets
        # a reset, HTTP/1.1's keep-alive race (RFC 9112, 9.3.1), which says nothing about the
        # server under test but fails a request.
        limits = httpx.Limits(max_connections=args.concurrency + args.burst_size + 8,
                              keepalive_expiry=args.keepalive_expiry)
        async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout,
                                     limits=limits, headers=self.headers) as client:
            self.model = (await client.get("/v1/models")).json()["data"][0]["id"]
            self.health_idle = await self.idle_health(client)
            mix = {k: w for k, w in MIX.items() if k not in INJECTED or args.faults}
            kinds, weights = zip(*mix.items(), strict=True)
            good_weights = [mix[k] for k in GOOD]
            sem = asyncio.Semaphore(args.concurrency)
            tasks: set[asyncio.Task] = set()
            stop = asyncio.Event()
            watcher = asyncio.create_task(self.health_watch(stop))
            self.windows: list[dict] = []
            self.t_start = t = time.perf_counter()
            next_window, next_burst = t, t + args.burst_every

            async def run_one(kind: str, seed: int, held: bool) -> None:
                try:
                    self.outcomes.append(await self.one(client, kind, random.Random(seed)))
                finally:
                    if held:
                        sem.release()

            def launch(kind: str, held: bool) -> None:
                task = asyncio.create_task(run_one(kind, self.rng.randrange(2**32), held))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

            while t - self.t_start < args.duration:
                if t >= next_window:
                    self.windows.append({"start_s": round(t - self.t_start, 1),
                                         "rss_mb": rss_mb(self.pid)})
                    next_window += args.window
                pattern = self._pattern(t - self.t_start)
                if pattern == "bursty" and t >= next_burst:
                    for kind in self.rng.choices(GOOD, good_weights, k=args.burst_size):
                        launch(kind, held=False)  # on top of --concurrency
                    next_burst = t + args.burst_every
                gap = 1 / args.rate if pattern == "steady" else self.rng.expovariate(args.rate)
                await asyncio.sleep(gap)
                await sem.acquire()  # at --concurrency in flight, arrivals wait (no backlog)
                launch(self.rng.choices(kinds, weights)[0], held=True)
                t = time.perf_counter()
            await asyncio.gather(*tasks)
            elapsed = time.perf_counter() - self.t_start
            # Back to idle: nothing running or waiting, every block free, integrity clean.
            deadline = time.perf_counter() + 120
            while True:
                stats = (await client.get("/v1/engine/stats")).json()
                if stats["running"] == 0 and stats["waiting"] == 0 \
                        or time.perf_counter() > deadline:
                    break
                await asyncio.sleep(0.5)
            integrity = (await client.get("/v1/engine/integrity")).json()
            stop.set()
            await watcher
        return self.report(elapsed, stats, integrity)

    def report(self, elapsed: float, stats: dict, integrity: dict) -> dict:
        args, outcomes = self.args, self.outcomes
        for i, w in enumerate(self.windows):
            lo = self.t_start + w["start_s"]
            hi = lo + args.window
            ws = [o for o in outcomes if lo <= o.start < hi]
            ttft = [o.ttft * 1e3 for o in ws if o.ttft is not None and o.kind in GOOD]
            itl = [x * 1e3 for o in ws for x in o.itls]
            w.update(index=i, requests=len(ws), ok=sum(o.ok for o in ws),
                     shed_429=sum(o.kind in GOOD and o.status == 429 for o in ws),
                     ttft_p50_ms=pct(ttft, 0.5), ttft_p99_ms=pct(ttft, 0.99),
                     itl_p50_ms=pct(itl, 0.5), itl_p99_ms=pct(itl, 0.99),
                     health_worst_s=round(max((d for t, d in self.health if lo <= t < hi),
                                              default=0.0), 3))
        by_kind: dict[str, dict[str, int]] = {}
        for o in outcomes:
            k = by_kind.setdefault(o.kind, {})
            label = ("429" if o.status == 429 else "ok") if o.ok else \
                f"unexpected {o.status}" if o.status else "failed"
            k[label] = k.get(label, 0) + 1
        bad = [o for o in outcomes if not o.ok]
        server_errors = [o for o in outcomes if o.status is not None and o.status >= 500]
        good = [o for o in outcomes if o.kind in GOOD]
        return {
            "duration_s": round(elapsed, 1), "requests": len(outcomes),
            "ok": sum(o.ok for o in outcomes),
            "shed_429": sum(o.kind in GOOD and o.status == 429 for o in outcomes),
            "5xx": len(server_errors),
            "5xx_injected": sum(o.kind in INJECTED for o in server_errors),
            "not_ok": len(bad), "first_not_ok": [(o.kind, o.status, o.error) for o in bad[:5]],
            "by_kind": dict(sorted(by_kind.items())), "windows": self.windows,
            "health_worst_s": round(max((d for _, d in self.health), default=0.0), 3),
            "health_idle_s": round(self.health_idle, 4),
            "longest_silence_s": round(max((o.longest_silence for o in good), default=0.0), 2),
            "idle_after": {"running": stats["running"], "waiting": stats["waiting"]},
            "integrity": integrity,
            "leaked_blocks": integrity["kv_blocks"] - integrity["kv_free_blocks"],
        }


def passed(report: dict) -> bool:
    """Nothing unexpected: every request got what its kind must get (so no 5xx but the
    injected ones), the server idle again with every block free and its integrity clean."""
    return (report["not_ok"] == 0 and report["5xx"] == report["5xx_injected"]
            and report["leaked_blocks"] == 0 and report["integrity"]["ok"]
            and report["idle_after"] == {"running": 0, "waiting": 0})


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
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def run_soak(args: argparse.Namespace) -> dict:
    """Soak the server at --base-url (or one started with --spawn FLAGS, on --port, with
    KVSERVE_FAULTS from --faults-env), and return the report."""
    proc = None
    if args.spawn is not None:
        from kvserve.bench.spawn import spawn_server, stop_server

        env = dict(os.environ)
        if args.faults_env:
            env["KVSERVE_FAULTS"] = args.faults_env
        log = Path(args.server_log or f"/tmp/kvserve-soak-{args.port}.log")
        proc = spawn_server(shlex.split(args.spawn), args.port, log, env=env)
        args.base_url = f"http://127.0.0.1:{args.port}"
    try:
        return asyncio.run(Soak(args, proc.pid if proc else None).run())
    finally:
        if proc is not None:
            stop_server(proc)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("soak", help="a seeded soak of a server: good, slow, hostile "
                                           "(and injected-fault) requests, with a report",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--spawn", default=None, metavar="FLAGS",
                   help="start `kvserve serve FLAGS` on --port and soak it (RSS is read too)")
    p.add_argument("--port", type=int, default=8741)
    p.add_argument("--server-log", default=None, help="the spawned server's log file")
    p.add_argument("--faults", action="store_true",
                   help=f"the server injects request_error {FAULT_MARKER!r}: send requests "
                        "with that marker and expect their 500")
    p.add_argument("--faults-env", default=None, metavar="JSON",
                   help="KVSERVE_FAULTS for the spawned server (with request_error "
                        f"{FAULT_MARKER!r} it implies --faults)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    p.add_argument("--window", type=float, default=300.0, help="report window, seconds")
    p.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--arrivals", choices=["steady", "poisson", "bursty", "mixed"],
                   default="poisson")
    p.add_argument("--phase", type=float, default=60.0,
                   help="seconds of each pattern in turn with --arrivals mixed")
    p.add_argument("--burst-size", type=int, default=160,
                   help="requests sent at once by each burst")
    p.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts")
    p.add_argument("--slow-client-wait", type=float, default=60.0,
                   help="seconds a slow client waits for the server to answer or close")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--keepalive-expiry", type=positive_float, default=0.5,
                   help="seconds the client keeps an idle connection; keep it well below the "
                        "server's --header-timeout and --keep-alive-timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    p.set_defaults(func=cmd_soak)


def cmd_soak(args: argparse.Namespace) -> int:
    # checked here, not by a server that then fails to start
    if args.faults_env and Faults.parse(args.faults_env).request_error == FAULT_MARKER:
        args.faults = True
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        report = run_soak(args)
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"kvserve bench soak: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    ok = passed(report)
    print("PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1
