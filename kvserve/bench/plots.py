"""PNG plots of a serving benchmark and of one request's timeline (matplotlib, no display).

`plot_bench` draws what the client measured: TTFT and ITL distributions, output throughput and
requests in flight over time, and a waterfall of sampled requests. Where the server is kvserve
its per-request `timings` split the time before the first token into queue and prefill, and
preempted requests are marked. `plot_timeline` draws one request's server-side timeline
(`GET /v1/requests/{id}/timeline`, see `kvserve trace`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

from kvserve.request import timeline_segments

matplotlib.use("Agg")  # files only; never a window

import matplotlib.pyplot as plt  # noqa: E402  (after the backend choice)

COLORS = {"queue": "#bbbbbb", "prefill": "#e8a33d", "decode": "#4c8cbf",
          "preempted": "#d9534f", "ttft": "#e8a33d"}


def _token_times(rec) -> list[float]:
    """Seconds since the run started at which each streamed chunk arrived."""
    if rec.ttft is None:
        return []
    t = rec.start + rec.ttft
    out = [t]
    for gap in rec.itl:
        t += gap
        out.append(t)
    return out


def plot_bench(records: Sequence[Any], outdir: str | Path, sample: int = 40,
               seed: int = 0) -> list[Path]:
    """Write latency.png, throughput.png and waterfall.png under `outdir`; return the paths."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.success]
    paths = []

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.hist([1e3 * r.ttft for r in ok if r.ttft is not None], bins=40, color=COLORS["ttft"])
    a.set(title="Time to first token", xlabel="ms", ylabel="requests")
    b.hist([1e3 * x for r in ok for x in r.itl], bins=60, color=COLORS["decode"])
    b.set(title="Inter-token latency", xlabel="ms", ylabel="gaps", yscale="log")
    paths.append(_save(fig, outdir / "latency.png"))

    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    end = max((r.start + (r.e2el or 0.0) for r in ok), default=1.0)
    bins = max(1, int(end) + 1)
    counts = [0] * bins
    for r in ok:
        times = _token_times(r)
        per_chunk = r.output_tokens / len(times) if times else 0
        for t in times:
            counts[min(int(t), bins - 1)] += per_chunk
    a.bar(range(bins), counts, width=1.0, align="edge", color=COLORS["decode"])
    a.set(title="Output throughput", ylabel="tokens/s")
    edges = sorted([(r.start, 1) for r in ok] + [(r.start + (r.e2el or 0.0), -1) for r in ok])
    xs, ys, n = [0.0], [0], 0
    for t, d in edges:
        n += d
        xs.append(t)
        ys.append(n)
    b.step(xs, ys, where="post", color="#333333")
    b.set(title="Requests in flight", xlabel="seconds since the start", ylabel="requests")
    paths.append(_save(fig, outdir / "throughput.png"))

    shown = sorted(random.Random(seed).sample(ok, min(sample, len(ok))), key=lambda r: r.start)
    fig, ax = plt.subplots(figsize=(11, max(3.0, 0.25 * len(shown) + 1)))
    for i, r in enumerate(shown):
        st = r.server_timings or {}
        ttft, e2el = r.ttft or 0.0, r.e2el or 0.0
        queue = min(st.get("queue_time") or 0.0, ttft)
        ax.barh(i, queue, left=r.start, color=COLORS["queue"])
        ax.barh(i, ttft - queue, left=r.start + queue, color=COLORS["prefill"])
        ax.barh(i, e2el - ttft, left=r.start + ttft, color=COLORS["decode"])
        if st.get("num_preemptions"):
            ax.plot(r.start + e2el, i, "x", color=COLORS["preempted"], markersize=8)
    ax.set(title=f"Waterfall of {len(shown)} requests (queue, prefill to first token, decode; "
                 "x = preempted)", xlabel="seconds since the start", ylabel="request")
    ax.invert_yaxis()
    paths.append(_save(fig, outdir / "waterfall.png"))
    return paths


def plot_timeline(timeline: dict, path: str | Path) -> Path:
    """One request's waterfall from its timeline JSON."""
    segs = timeline_segments(timeline["samples"][0]["events"])
    fig, ax = plt.subplots(figsize=(11, 2.6))
    for kind, start, end in segs:
        ax.barh(0, max(end - start, 1e-4), left=start, color=COLORS[kind], label=kind)
    events = timeline["samples"][0]["events"]
    for e in events:
        if e["event"] == "first_token":
            ax.axvline(e["t"], color="black", linestyle="--", linewidth=1, label="first token")
        elif e["event"] == "prefix_hit":
            ax.annotate(f"cache hit {e['tokens']} tokens", (e["t"], 0.45), fontsize=8)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper right", fontsize=8, ncol=5)
    b = timeline["breakdown"]
    ax.set(yticks=[], xlabel="seconds after arrival",
           title=f"{timeline['id']}: queue {1e3 * (b['queue_time'] or 0):.1f} ms, prefill "
                 f"{1e3 * (b['prefill_time'] or 0):.1f} ms, decode "
                 f"{1e3 * (b['decode_time'] or 0):.1f} ms, {b['num_preemptions']} preemptions")
    return _save(fig, Path(path))


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
