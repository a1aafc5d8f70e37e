"""The dashboard's time series: a recorder that, once a second, records what the dashboard
shows into a ring covering the last ten minutes (`GET /v1/engine/history`).

A sample is JSON-ready:
    {"time": unix seconds, "running": int, "waiting": int, "kv_usage": fraction,
     "output_tokens_per_s": over the sample's interval,
     "ttft_ms": {"p50", "p99", "count"} | None, "itl_ms": {"p50", "p99", "count"} | None,
     "slo": EngineMetrics.dashboard()["slo"] when it has one, else None,
     "spec": {"drafts", "acceptance", "acceptance_at": [per draft position]} | None}
TTFT and ITL are percentiles of what was observed during that interval only (None when
nothing was), not of the metrics' rolling windows, so a change shows up in the next sample.
So are the draft acceptances of speculative decoding (`spec`: None without speculation;
rates are None where nothing was verified).

Cost: the batch and KV figures come from the snapshot the engine thread publishes after each
step (no wait); only the new latencies are copied on the engine thread, between two steps,
where EngineMetrics takes them, so the copy and its count agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine.metrics import EngineMetrics
from kvserve.entrypoints.server.errors import APIError
from kvserve.stats import SpecState

log = logging.getLogger(__name__)


@dataclass
class History:
    """A bounded ring of samples, oldest first: the last `keep_s` seconds at one sample per
    `interval_s`."""

    interval_s: float = 1.0
    keep_s: float = 600.0
    _ring: deque[dict] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ring = deque(maxlen=max(1, round(self.keep_s / self.interval_s)))

    def add(self, sample: dict) -> None:
        """Append a sample; its "time" must not be older than the last one's."""
        self._ring.append(sample)

    def since(self, seconds: float | None = None, now: float | None = None) -> list[dict]:
        """Samples of the last `seconds` (all of them when None), oldest first."""
        samples = list(self._ring)
        if seconds is None:
            return samples
        start = (time.time() if now is None else now) - seconds
        # newest last: walk back only over the samples wanted
        i = len(samples)
        while i > 0 and samples[i - 1]["time"] >= start:
            i -= 1
        return samples[i:]

    def as_json(self, seconds: float | None = None) -> dict:
        """The route's body; a `seconds` that is not a positive finite number is a 400."""
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise APIError(400, f"seconds must be a positive number, not {seconds}", "seconds")
        return {"object": "list", "interval_s": self.interval_s, "data": self.since(seconds)}


def _count(histogram) -> int:
    """Observations so far in a labelled prometheus Histogram."""
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_count"):
                return int(s.value)
    return 0


def percentiles(values: list[float]) -> dict | None:
    """p50 and p99 (nearest rank, in ms, as the dashboard's cards) and how many values."""
    if not values:
        return None
    v = sorted(values)
    rank = lambda q: v[min(len(v) - 1, int(q * len(v)))]
    return {"p50": round(1e3 * rank(0.50), 3), "p99": round(1e3 * rank(0.99), 3),
            "count": len(v)}


@dataclass
class _Tail:
    """What one of EngineMetrics' recent-value deques gained since the last read. The deque
    drops its oldest values once full, so its length says nothing; the histogram observed
    alongside it (one observation per value appended) counts them."""

    values: deque[float]
    histogram: object
    seen: int = field(init=False)  # the histogram's count at the last read

    def __post_init__(self) -> None:
        self.seen = _count(self.histogram)

    def take(self) -> list[float]:
        """The values appended since the last call (on the thread that appends them)."""
        total = _count(self.histogram)
        new = min(max(total - self.seen, 0), len(self.values))
        self.seen = total
        # from the right end: deque indexing is O(1) there, so this costs O(new values)
        return [self.values[i] for i in range(-new, 0)]


class HistoryRecorder:
    """Fills a History once per `history.interval_s` while the engine serves; start() on the
    event loop, stop() before the engine stops."""

    def __init__(self, metrics: EngineMetrics, engine: Callable[[], AsyncEngine | None],
                 history: History | None = None) -> None:
        self.metrics, self.engine = metrics, engine
        self.history = history or History()
        self._ttft = _Tail(metrics.recent_ttft, metrics.ttft)
        self._itl = _Tail(metrics.recent_itl, metrics.itl)
        self._task: asyncio.Task | None = None
        self._spec_seen: SpecState | None = None  # the totals at the last sample

    def _spec(self, st: SpecState | None) -> dict | None:
        """Draft acceptance since the last sample: overall and at each draft position."""
        if st is None:
            return None
        seen, self._spec_seen = self._spec_seen, st
        old_drafts = seen.num_drafts if seen else 0
        old_accepted = seen.num_accepted if seen else 0
        old_at = list(zip(seen.drafts_at, seen.accepted_at, strict=True)) if seen else []
        drafts = st.num_drafts - old_drafts
        at = []
        for i, (d, a) in enumerate(zip(st.drafts_at, st.accepted_at, strict=True)):
            d0, a0 = old_at[i] if i < len(old_at) else (0, 0)
            at.append(round((a - a0) / (d - d0), 4) if d > d0 else None)
        return {"drafts": drafts, "acceptance": round((st.num_accepted - old_accepted) / drafts,
                                                      4) if drafts else None,
                "acceptance_at": at}

    async def sample(self) -> dict | None:
        """One sample now, or None while the engine is loading or dead."""
        engine = self.engine()
        if engine is None or engine.stats is None:
            return None
        try:
            ttft, itl = await engine.call(lambda _: (self._ttft.take(), self._itl.take()))
        except EngineDeadError:
            return None
        stats = engine.stats  # the newest snapshot, replaced whole by the engine thread
        recent = self.metrics.dashboard(window=self.history.interval_s)
        return {"time": round(time.time(), 3), "running": stats.running,
                "waiting": stats.waiting, "kv_usage": round(stats.kv_usage, 4),
                "output_tokens_per_s": recent["output_tokens_per_s"],
                "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl),
                "slo": recent.get("slo"), "spec": self._spec(stats.spec)}

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            # On a schedule, not sleep(interval) after each sample, so samples stay evenly
            # spaced; after a late one (a long step held the engine thread) skip, not catch up.
            due = max(due + self.history.interval_s, loop.time())
            await asyncio.sleep(due - loop.time())
            try:
                sample = await self.sample()
            except Exception:  # a dashboard aid must never take the server down
                log.exception("history sample failed")
                continue
            if sample is not None:
                self.history.add(sample)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="kvserve-history")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
