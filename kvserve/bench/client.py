"""The load generator behind `kvserve bench serve`: its settings, one streamed request timed
from the client's side, arrivals, the run, and the server's model and drafting counters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx
import numpy as np

from kvserve.bench.datasets import (
    SampleRequest,
)


class BenchError(ValueError):
    """A problem that makes the benchmark impossible (bad option, unreachable server); the CLI
    prints it and exits with 2."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """How to reach the server and how to load it."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape of the arrival intervals; 1.0 = Poisson
    max_concurrency: int | None = None
    warmup: int = 1
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout: float = 600.0  # seconds, per request, whole stream included
    goodput: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms
    seed: int = 0
    progress: bool = True

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return join_url(self.base_url, self.endpoint)

    def validate(self) -> None:
        if not self.request_rate > 0:
            raise BenchError("--request-rate must be > 0 (inf sends all requests at once)")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise BenchError("--burstiness must be a positive number")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError("--max-concurrency must be at least 1")
        if self.warmup < 0:
            raise BenchError("--warmup must be >= 0")
        if not self.timeout > 0:
            raise BenchError("--timeout must be > 0")
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchError(f"--base-url must start with http:// or https:// "
                             f"(got {self.base_url!r})")


def join_url(base_url: str, path: str) -> str:
    """base + path, tolerating a base that already ends in /v1 (a common way to write it)."""
    base = base_url.rstrip("/")
    path = "/" + path.lstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        path = path[3:]
    return base + path


@dataclass
class RequestRecord:
    """What one request did. Times are in seconds; `start` is relative to the benchmark start.

    `prompt_len` is the server's usage.prompt_tokens when it sent one, else the dataset's count.
    `output_tokens` is usage.completion_tokens when sent, else the number of content chunks.
    """

    prompt_len: int | None
    max_tokens: int
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2el: float | None = None
    output_tokens: int = 0
    content_chunks: int = 0
    usage_reported: bool = False
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    server_timings: dict[str, Any] | None = None  # kvserve's "timings" (queue, prefill, ...)
    response_id: str | None = None  # the stream's "id" (kvserve trace ID shows its timeline)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def as_json(self) -> dict[str, Any]:
        ms = lambda s: None if s is None else round(s * 1e3, 3)
        return {
            "success": self.success, "error": self.error, "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens, "output_len": self.output_tokens,
            "usage_reported": self.usage_reported, "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "start_s": round(self.start, 6), "ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot),
            "e2el_ms": ms(self.e2el), "itl_ms": [ms(x) for x in self.itl],
            "server_timings": self.server_timings, "response_id": self.response_id,
        }


def build_payload(cfg: ServeBenchConfig, model: str, req: SampleRequest) -> dict[str, Any]:
    """The JSON body of one streaming request (--extra-body fields override ours)."""
    body: dict[str, Any] = {"model": model}
    if cfg.chat:
        messages = [{"role": "system", "content": req.system}] if req.system else []
        body["messages"] = [*messages, {"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.text
    body.update(max_tokens=req.output_len, temperature=cfg.temperature, stream=True,
                stream_options={"include_usage": True})
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # a vLLM / llama.cpp / kvserve extension to the OpenAI API
    body.update(cfg.extra_body)
    return body


def _chunk_text(obj: dict[str, Any], chat: bool) -> tuple[str, str | None]:
    """(text, finish_reason) of one streamed chunk; ("", None) for a usage-only chunk."""
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "", None
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        # Reasoning models stream their thinking separately; it is generated text all the same.
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    else:
        text = choice.get("text") or ""
    return text, choice.get("finish_reason")


def _sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def send_request(
    client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str, req: SampleRequest,
    headers: dict[str, str],
) -> RequestRecord:
    """Stream one request and time it. Never raises (but for cancellation): failures are
    returned as a record with `error` set."""
    rec = RequestRecord(prompt_len=req.prompt_len, max_tokens=req.output_len)
    payload = build_payload(cfg, model, req)
    sent = time.perf_counter()
    last = sent
    try:
        async with asyncio.timeout(cfg.timeout), client.stream(
            "POST", cfg.url, json=payload, headers=headers
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                rec.error = f"HTTP {resp.status_code}: {_short(body)}"
                return rec
            ctype = resp.headers.get("content-type", "")
            if ctype.startswith("application/json"):
                body = (await resp.aread()).decode("utf-8", errors="replace")
                rec.error = f"expected an event stream, got {ctype}: {_short(body)}"
                return rec
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                data = _sse_data(line)
                if not data:
                    continue
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    continue
                if obj.get("error"):
                    rec.error = f"error event: {_short(json.dumps(obj['error']))}"
                    return rec
                if rec.response_id is None and isinstance(obj.get("id"), str):
                    rec.response_id = obj["id"]
                if isinstance(obj.get("timings"), dict):  # kvserve's server-side breakdown
                    rec.server_timings = obj["timings"]
                usage = obj.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    rec.usage_reported = True
                    rec.output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_len = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
                text, finish = _chunk_text(obj, cfg.chat)
                rec.finish_reason = finish or rec.finish_reason
                if text:
                    if rec.content_chunks == 0:
                        rec.ttft = now - sent
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.content_chunks += 1
        rec.e2el = time.perf_counter() - sent
    except TimeoutError:
        rec.error = f"timed out after {cfg.timeout:g} s"
    except Exception as exc:  # any failure of one request is that request's result
        rec.error = f"{type(exc).__name__}: {_short(str(exc)) or 'no message'}"
    if rec.error is None and rec.content_chunks == 0:
        rec.error = "empty output (no text in the stream)"
    if rec.error is None and not rec.usage_reported:
        rec.output_tokens = rec.content_chunks  # one token per chunk, see the module docstring
    return rec


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (s from the start) of n requests: 0, then gamma-distributed gaps with mean
    1/rate and shape `burstiness` (1 = exponential gaps, a Poisson process; smaller = burstier).
    All zeros for an infinite rate."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


class Progress:
    """A one-line progress bar on a terminal, redrawn in place; a line per 10% otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.tty = self.stream.isatty()
        self.done = 0
        self.failed = 0
        self.t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = 0

    def update(self, success: bool) -> None:
        self.done += 1
        self.failed += not success
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw > 0.1 or self.done == self.total:
                self._last_draw = now
                self.stream.write("\r" + self.line(now))
        elif (decile := self.done * 10 // self.total) > self._last_decile:
            self._last_decile = decile
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def line(self, now: float) -> str:
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        return (f"[{bar}] {self.done}/{self.total} requests, {self.failed} failed, "
                f"{now - self.t0:.1f} s")

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    duration: float
    peak_concurrency: int


async def run_load(
    client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str,
    requests: Sequence[SampleRequest], headers: dict[str, str], progress: Progress | None = None,
) -> RunOutcome:
    """Send every request at its arrival time (at most max_concurrency in flight) and wait for
    all of them. Duration runs from the first arrival to the last completion."""
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    in_flight = peak = 0
    t0 = time.perf_counter()

    async def one(offset: float, req: SampleRequest) -> RequestRecord:
        nonlocal in_flight, peak
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit or contextlib.nullcontext():
            in_flight += 1
            peak = max(peak, in_flight)
            start = time.perf_counter() - t0
            try:
                rec = await send_request(client, cfg, model, req, headers)
            finally:
                in_flight -= 1
        rec.start = start
        if progress is not None:
            progress.update(rec.success)
        return rec

    records = await asyncio.gather(*(one(float(o), r) for o, r in zip(offsets, requests,
                                                                       strict=True)))
    return RunOutcome(list(records), time.perf_counter() - t0, peak)


def make_client(cfg: ServeBenchConfig, transport: httpx.AsyncBaseTransport | None = None,
                ) -> httpx.AsyncClient:
    # No pool limit: the benchmark, not httpx, decides how many requests are in flight (httpx's
    # default of 100 connections would silently queue the rest and time them out).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: a proxy from the environment would sit between us and the server.
    return httpx.AsyncClient(transport=transport, limits=limits, trust_env=False,
                             timeout=httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0)))


def auth_headers(cfg: ServeBenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def fetch_model(client: httpx.AsyncClient, cfg: ServeBenchConfig) -> str | None:
    """The first model id of GET /v1/models (None if the server answers without one).

    Raises BenchError naming the URL when the server cannot be reached; an HTTP error is only an
    error when the model name is needed (cfg.model is None).
    """
    url = join_url(cfg.base_url, "/v1/models")
    try:
        resp = await client.get(url, headers=auth_headers(cfg), timeout=min(cfg.timeout, 30.0))
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach the server at {cfg.base_url} "
                         f"({type(exc).__name__}: {exc or 'no answer'})") from exc
    if cfg.model is not None:
        return cfg.model
    try:
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPStatusError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"could not read a model name from {url} ({_short(str(exc))}); "
                         f"pass --model") from exc


_SPEC_RE = re.compile(r'^kvserve:spec_decode_(\w+?)(?:_total)?(?:\{([^}]*)\})? ([-0-9.e+]+)$',
                      re.MULTILINE)


async def fetch_spec_counters(client: httpx.AsyncClient, cfg: ServeBenchConfig
                              ) -> dict[str, float] | None:
    """kvserve's speculative-decoding counters from /metrics ("name" or "name@position");
    None when the server has no such metrics (not kvserve, or no speculation)."""
    try:
        resp = await client.get(join_url(cfg.base_url, "/metrics"), headers=auth_headers(cfg))
        if resp.status_code != 200:
            return None
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    for name, labels, value in _SPEC_RE.findall(resp.text):
        if name == "config" or name.endswith("_created"):
            continue
        pos = re.search(r'position="(\d+)"', labels or "")
        key = name + (f"@{pos.group(1)}" if pos else "")
        out[key] = out.get(key, 0.0) + float(value)  # summed over replicas (their label)
    return out or None


def spec_summary(before: dict[str, float] | None, after: dict[str, float] | None
                 ) -> dict[str, Any] | None:
    """What the run's speculation did: drafts, draft and accepted tokens, acceptance rate,
    mean acceptance length (tokens per verifying step: accepted + 1), and the acceptance
    rate at each draft position."""
    if after is None:
        return None
    before = before or {}
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    drafts, tokens = d.get("num_drafts", 0.0), d.get("num_draft_tokens", 0.0)
    accepted = d.get("num_accepted_tokens", 0.0)
    positions = sorted(int(k.split("@")[1]) for k in d if k.startswith("num_draft_tokens_per_pos@"))
    per_pos = [d.get(f"num_accepted_tokens_per_pos@{i}", 0.0)
               / d[f"num_draft_tokens_per_pos@{i}"] if d[f"num_draft_tokens_per_pos@{i}"]
               else None for i in positions]
    return {"drafts": int(drafts), "draft_tokens": int(tokens), "accepted_tokens": int(accepted),
            "acceptance_rate": accepted / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate_per_position": per_pos,
            "steps_without_speculation": int(d.get("num_steps_off", 0.0))}
