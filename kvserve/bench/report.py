"""What a `kvserve bench serve` run reports: per-metric statistics, goodput against latency
targets, the printed table and the saved JSON."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.bench.client import BenchError, RequestRecord, ServeBenchConfig

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


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


def config_json(cfg: ServeBenchConfig) -> dict[str, Any]:
    out = asdict(cfg)
    out.pop("api_key")  # never write a secret into a results file
    out["request_rate"] = rate_str(cfg.request_rate)
    out["endpoint_type"] = "chat" if cfg.chat else "completions"
    return out


def rate_str(rate: float) -> str | float:
    return "inf" if math.isinf(rate) else rate


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
