"""`kvserve bench serve`: load-test an OpenAI-compatible server and report what clients see.

Works against any server that streams `/v1/completions` or `/v1/chat/completions` as server-sent
events (kvserve, vLLM, llama.cpp's llama-server). Everything is measured on the client from the
SSE stream, so the figures include HTTP and serialization time:

  TTFT   send -> first chunk carrying non-empty text
  ITL    gaps between successive chunks carrying text (several tokens in one chunk count once)
  TPOT   (E2E - TTFT) / (output tokens - 1), per request
  E2E    send -> end of the stream

Output tokens come from the final `usage` chunk (requested with stream_options.include_usage);
a server that sends none is assumed to stream one token per content chunk, which is how vLLM,
llama-server and kvserve stream but is only an approximation for servers that batch tokens.
Input tokens likewise come from `usage.prompt_tokens` when sent (so they include BOS and chat
template tokens), else from the dataset's count.

Arrivals follow a gamma process with mean interval 1/rate (burstiness 1 = Poisson), optionally
capped at --max-concurrency requests in flight. A failed request (HTTP error, error event,
exception, timeout, no text) is recorded with its message; it never stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import httpx
import numpy as np

from kvserve.bench.datasets import (
    DATASETS,
    DatasetConfig,
    SampleRequest,
    load_requests,
    load_tokenizer,
)
from kvserve.settings import positive_float

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


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


# ------------------------------------------------------------------------------ one request


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


# -------------------------------------------------------------------------------- the load


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
        out[name + (f"@{pos.group(1)}" if pos else "")] = float(value)
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


@dataclass
class BenchResult:
    config: dict[str, Any]
    model: str
    summary: Summary
    records: list[RequestRecord]
    spec_decode: dict[str, Any] | None = None  # spec_summary of the timed run

    def as_json(self) -> dict[str, Any]:
        return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "model": self.model,
                "config": self.config, "summary": asdict(self.summary),
                "spec_decode": self.spec_decode,
                "requests": [r.as_json() for r in self.records]}


async def benchmark(
    cfg: ServeBenchConfig, requests: Sequence[SampleRequest],
    transport: httpx.AsyncBaseTransport | None = None, model: str | None = None,
) -> BenchResult:
    """Warm up, run the timed load and summarise it. `model` skips the GET /v1/models lookup
    (already done by the caller); `transport` lets tests replace the network."""
    cfg.validate()
    if not requests:
        raise BenchError("no requests to send")
    headers = auth_headers(cfg)
    async with make_client(cfg, transport) as client:
        model = model or await fetch_model(client, cfg)
        assert model is not None
        if cfg.warmup:
            warm = [requests[i % len(requests)] for i in range(cfg.warmup)]
            warm_cfg = replace(cfg, request_rate=math.inf)
            outcome = await run_load(client, warm_cfg, model, warm, headers)
            if not any(r.success for r in outcome.records):
                raise BenchError(f"the warm-up request failed: {outcome.records[0].error} "
                                 f"(POST {cfg.url}, model {model!r})")
        spec_before = await fetch_spec_counters(client, cfg)
        progress = Progress(len(requests), enabled=cfg.progress)
        try:
            outcome = await run_load(client, cfg, model, requests, headers, progress)
        finally:
            progress.close()
        spec = spec_summary(spec_before, await fetch_spec_counters(client, cfg))
    summary = summarize(outcome.records, outcome.duration, cfg.goodput, outcome.peak_concurrency)
    return BenchResult(config=config_json(cfg), model=model, summary=summary,
                       records=outcome.records, spec_decode=spec)


def config_json(cfg: ServeBenchConfig) -> dict[str, Any]:
    out = asdict(cfg)
    out.pop("api_key")  # never write a secret into a results file
    out["request_rate"] = _rate_str(cfg.request_rate)
    out["endpoint_type"] = "chat" if cfg.chat else "completions"
    return out


def _rate_str(rate: float) -> str | float:
    return "inf" if math.isinf(rate) else rate


# --------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Stats:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    p90: float
    p99: float
    max: float
    count: int

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Stats | None:
        """None when there are no values (e.g. TPOT when every output was one token)."""
        if len(values_ms) == 0:
            return None
        a = np.asarray(values_ms, dtype=np.float64)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])  # linear interpolation
        return cls(mean=float(a.mean()), median=float(p50), std=float(a.std()), p90=float(p90),
                   p99=float(p99), max=float(a.max()), count=int(a.size))


@dataclass(frozen=True)
class Summary:
    """Every figure of the report. Token totals and latencies cover successful requests."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_concurrency: int
    short_outputs: int  # successful requests that generated fewer tokens than max_tokens
    # Share of input tokens the server reports as served from its prefix cache
    # (usage.prompt_tokens_details.cached_tokens); None when the server does not report it.
    prefix_cache_hit_rate: float | None
    goodput: float | None  # req/s meeting every SLO; None without --goodput
    good_requests: int | None
    slos_ms: dict[str, float]
    ttft_ms: Stats | None
    tpot_ms: Stats | None
    itl_ms: Stats | None
    e2el_ms: Stats | None
    errors: dict[str, int]  # distinct error message -> count


def meets_slos(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO. A one-token output has no TPOT and cannot
    miss a TPOT target."""
    if not rec.success:
        return False
    observed = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.e2el}
    return all((observed[k] or 0.0) * 1e3 <= slo for k, slo in slos_ms.items())


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slos_ms: dict[str, float] | None = None, peak_concurrency: int = 0) -> Summary:
    slos_ms = dict(slos_ms or {})
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    good = sum(meets_slos(r, slos_ms) for r in ok) if slos_ms else None
    errors = Counter(r.error for r in records if r.error is not None)
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_len]
    hit_rate = (sum(r.cached_tokens or 0 for r in reported)
                / sum(r.prompt_len or 0 for r in reported)) if reported else None
    return Summary(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=per_s(len(ok)), output_throughput=per_s(total_out),
        total_token_throughput=per_s(total_in + total_out), peak_concurrency=peak_concurrency,
        short_outputs=sum(r.output_tokens < r.max_tokens for r in ok),
        prefix_cache_hit_rate=hit_rate,
        goodput=None if good is None else per_s(good), good_requests=good, slos_ms=slos_ms,
        ttft_ms=Stats.of([r.ttft * 1e3 for r in ok if r.ttft is not None]),
        tpot_ms=Stats.of([t * 1e3 for r in ok if (t := r.tpot) is not None]),
        itl_ms=Stats.of([x * 1e3 for r in ok for x in r.itl]),
        e2el_ms=Stats.of([r.e2el * 1e3 for r in ok if r.e2el is not None]),
        errors=dict(errors.most_common()),
    )


def parse_goodput(spec: Sequence[str]) -> dict[str, float]:
    """"ttft:500 tpot:50 e2el:2000" (or comma separated, or several arguments) -> SLOs in ms."""
    slos: dict[str, float] = {}
    for item in " ".join(spec).replace(",", " ").split():
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in GOODPUT_METRICS:
            raise BenchError(f"invalid --goodput item {item!r}: expected METRIC:MS with METRIC "
                             f"one of {', '.join(GOODPUT_METRICS)}, e.g. ttft:500 tpot:50")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not (ms > 0 and math.isfinite(ms)):
            raise BenchError(f"invalid --goodput item {item!r}: the SLO must be a positive "
                             f"number of milliseconds")
        if key in slos:
            raise BenchError(f"invalid --goodput: {key} given twice")
        slos[key] = ms
    if not slos:
        raise BenchError("--goodput needs at least one METRIC:MS item, e.g. ttft:500")
    return slos


# ---------------------------------------------------------------------------------- report

_WIDTH = 50
_LABELS = {"ttft_ms": ("Time to First Token", "TTFT"),
           "tpot_ms": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl_ms": ("Inter-token Latency", "ITL"),
           "e2el_ms": ("End-to-end Latency", "E2EL")}


def format_report(result: BenchResult) -> str:
    """The human-readable result table (vLLM's layout, so the numbers compare at a glance)."""
    s, cfg = result.summary, result.config
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label}{text:>{max(_WIDTH - len(label), len(text) + 1)}}")

    row("Model:", result.model)
    row("Endpoint:", "chat" if cfg["endpoint_type"] == "chat" else "completions")
    row("Successful requests:", s.completed)
    row("Failed requests:", s.failed)
    row("Maximum request concurrency:", cfg["max_concurrency"] or "unlimited")
    row("Peak concurrent requests:", s.peak_concurrency)
    rate = cfg["request_rate"]
    row("Request rate configured (RPS):", rate if rate == "inf" else float(rate))
    row("Burstiness factor:", float(cfg["burstiness"]))
    row("Benchmark duration (s):", s.duration_s)
    row("Total input tokens:", s.total_input_tokens)
    row("Total generated tokens:", s.total_output_tokens)
    if s.prefix_cache_hit_rate is not None:
        row("Prefix cache hit rate (%):", 100.0 * s.prefix_cache_hit_rate)
    row("Request throughput (req/s):", s.request_throughput)
    if s.goodput is not None:
        row("Request goodput (req/s):", s.goodput)
        row("Requests meeting SLOs:", f"{s.good_requests}/{s.completed + s.failed}")
        row("SLOs (ms):", " ".join(f"{k}:{v:g}" for k, v in s.slos_ms.items()))
    row("Output token throughput (tok/s):", s.output_throughput)
    row("Total token throughput (tok/s):", s.total_token_throughput)
    for key, (title, short) in _LABELS.items():
        lines.append(f" {title} ".center(_WIDTH, "-"))
        stats: Stats | None = getattr(s, key)
        if stats is None:
            row(f"{short} (ms):", "n/a")
            continue
        row(f"Mean {short} (ms):", stats.mean)
        row(f"Median {short} (ms):", stats.median)
        row(f"Std {short} (ms):", stats.std)
        row(f"P90 {short} (ms):", stats.p90)
        row(f"P99 {short} (ms):", stats.p99)
        row(f"Max {short} (ms):", stats.max)
    sp = result.spec_decode
    if sp is not None:
        lines.append(" Speculative Decoding ".center(_WIDTH, "-"))
        row("Drafts:", sp["drafts"])
        row("Draft tokens:", sp["draft_tokens"])
        row("Accepted tokens:", sp["accepted_tokens"])
        if sp["acceptance_rate"] is not None:
            row("Acceptance rate (%):", 100.0 * sp["acceptance_rate"])
            row("Mean acceptance length:", sp["mean_acceptance_length"])
            row("Per-position acceptance (%):", " ".join(
                "-" if r is None else f"{100 * r:.1f}" for r in sp["acceptance_rate_per_position"]))
        row("Steps without speculation:", sp["steps_without_speculation"])
    lines.append("=" * _WIDTH)
    if s.short_outputs:
        lines.append(f"note: {s.short_outputs} requests generated fewer tokens than max_tokens "
                     f"(does the server honour ignore_eos?)")
    for message, count in list(s.errors.items())[:5]:
        lines.append(f"error ({count}x): {message}")
    if len(s.errors) > 5:
        lines.append(f"... and {len(s.errors) - 5} more distinct errors")
    return "\n".join(lines)


def save_result(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.as_json(), indent=2) + "\n", encoding="utf-8")
    return out


# ------------------------------------------------------------------------------------- CLI


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"top_p\": 0.9}'")
    return value


def _goodput_arg(text: str) -> str:
    try:
        parse_goodput([text])
    except BenchError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("invalid --goodput ")) from None
    return text


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench serve` to the kvserve command line; returns the `bench` parser."""
    bench = subparsers.add_parser("bench", help="benchmarks against a running server")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (kvserve, vLLM, llama-server)",
        description="Send streaming requests to an OpenAI-compatible server at a chosen rate and "
                    "report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput.")

    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions (any path ending in "
                        "chat/completions is sent chat messages)")
    g.add_argument("--model", default=None,
                   help="model name sent in requests (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None,
                   help="sent as a Bearer token (default: $OPENAI_API_KEY if set)")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                   choices=DATASETS)
    d.add_argument("--num-prompts", type=int, default=None,
                   help="number of prompts (default 64; shared-prefix: groups x prompts-per-group"
                        "; jsonl: the first N lines)")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrivals")
    d.add_argument("--tokenizer", default=None,
                   help="tokenizer for random prompts: .gguf file, Hugging Face directory or "
                        "model short name (default: kvserve's default model)")
    d.add_argument("--random-input-len", type=int, default=256)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    d.add_argument("--random-prefix-len", type=int, default=0,
                   help="random tokens shared by every prompt, before its own input")
    d.add_argument("--shared-prefix-groups", type=int, default=4)
    d.add_argument("--prompts-per-group", type=int, default=16)
    d.add_argument("--system-prompt-len", type=int, default=512)
    d.add_argument("--question-len", type=int, default=64)
    d.add_argument("--output-len", type=int, default=128,
                   help="output tokens for shared-prefix, and for jsonl lines without one")
    d.add_argument("--dataset-path", default=None,
                   help="jsonl: one {\"prompt\": ..., \"output_len\": ...} object per line")

    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=positive_float, default=math.inf,
                    help="requests per second (default inf: send all at once)")
    lo.add_argument("--burstiness", type=positive_float, default=1.0,
                    help="gamma shape of arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier")
    lo.add_argument("--max-concurrency", type=int, default=None,
                    help="most requests in flight (default: unlimited)")
    lo.add_argument("--warmup", type=int, default=1,
                    help="requests sent (and not counted) before the timed run")

    r = p.add_argument_group("requests")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate exactly max_tokens (a vLLM/llama.cpp "
                        "extension)")
    r.add_argument("--extra-body", type=_json_object, default={},
                   help="JSON object merged into every request body")
    r.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds allowed per request, whole stream included")

    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", type=_goodput_arg, default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    o.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG plots there: TTFT and ITL distributions, throughput and "
                        "requests in flight over time, a waterfall of sampled requests")
    o.add_argument("--save-result", default=None, metavar="PATH",
                   help="write config, summary and per-request records as JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_bench_serve)
    from kvserve.bench.soak import add_parser as add_soak_parser

    add_soak_parser(sub)
    return bench


def configs_from(args: argparse.Namespace) -> tuple[ServeBenchConfig, DatasetConfig]:
    cfg = ServeBenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, warmup=args.warmup,
        temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=args.extra_body,
        timeout=args.timeout, goodput=parse_goodput(args.goodput) if args.goodput else {},
        seed=args.seed, progress=not args.no_progress)
    data = DatasetConfig(
        name=args.dataset, num_prompts=args.num_prompts, seed=args.seed, tokenizer=args.tokenizer,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len,
        shared_prefix_groups=args.shared_prefix_groups, prompts_per_group=args.prompts_per_group,
        system_prompt_len=args.system_prompt_len, question_len=args.question_len,
        output_len=args.output_len, dataset_path=args.dataset_path)
    return cfg, data


def cmd_bench_serve(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None,
                    ) -> int:
    """Run the benchmark the parsed arguments describe. Exit code 0, or 1 when every request
    failed; bad input raises BenchError / DatasetError (the CLI turns them into exit code 2)."""
    # httpx logs every request at INFO; thousands of those lines would bury the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg, data = configs_from(args)
    cfg.validate()
    data.validate()  # before contacting the server or loading a tokenizer: fail fast

    async def resolve() -> str | None:
        async with make_client(cfg, transport) as client:
            return await fetch_model(client, cfg)

    model = asyncio.run(resolve())
    tokenizer = load_tokenizer(data.tokenizer) if data.needs_tokenizer else None
    requests = load_requests(data, tokenizer)
    print(f"kvserve bench: {len(requests)} {data.name} prompts -> POST {cfg.url} "
          f"(model {model!r}, rate {_rate_str(cfg.request_rate)}, "
          f"max concurrency {cfg.max_concurrency or 'unlimited'})", file=sys.stderr)
    result = asyncio.run(benchmark(cfg, requests, transport=transport, model=model))
    result.config["dataset"] = asdict(data)
    print(format_report(result))
    if args.save_result:
        print(f"results written to {save_result(result, args.save_result)}", file=sys.stderr)
    if args.plot:
        from kvserve.bench.plots import plot_bench

        for path in plot_bench(result.records, args.plot):
            print(f"plot written to {path}", file=sys.stderr)
    return 0 if result.summary.completed else 1
