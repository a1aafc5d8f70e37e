"""The dashboard's time series: the ring (bounded, ordered, the `seconds` filter), the
per-interval latencies taken from EngineMetrics, the recorder's start and stop, and
GET /v1/engine/history on a tiny model (samples each second, `slo` carried through, bad
parameters as OpenAI-style 400s)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import httpx
import pytest

from kvserve.engine.llm_engine import EngineArgs
from kvserve.engine.metrics import EngineMetrics
from kvserve.entrypoints.server.errors import APIError
from kvserve.entrypoints.server.history import History, HistoryRecorder, percentiles
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.stats import EngineStats, SpecState
from tests.server_utils import run_server

SLO = {"target_ttft_ms": 500.0, "target_itl_ms": None, "good": 3, "missed_ttft": 1,
       "missed_itl": 0, "missed_both": 0, "goodput_per_s": 0.5}


def test_ring_is_bounded_and_ordered():
    h = History(interval_s=1.0, keep_s=5.0)
    for t in range(8):
        h.add({"time": 100.0 + t})
    assert [s["time"] for s in h.since()] == [103.0, 104.0, 105.0, 106.0, 107.0]
    assert History(interval_s=0.5, keep_s=600).since() == []
    assert History(interval_s=0.5, keep_s=600)._ring.maxlen == 1200


def test_seconds_keeps_only_the_newest():
    h = History(keep_s=600)
    for t in range(10):
        h.add({"time": 1000.0 + t})
    assert [s["time"] for s in h.since(3, now=1009.5)] == [1007.0, 1008.0, 1009.0]
    assert h.since(0.1, now=1020.0) == []
    assert len(h.since(1e9, now=1009.5)) == 10
    body = h.as_json()
    assert body["object"] == "list" and body["interval_s"] == 1.0 and len(body["data"]) == 10


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_seconds_are_refused(seconds):
    with pytest.raises(APIError) as e:
        History().as_json(seconds)
    assert e.value.status == 400 and e.value.param == "seconds"


def test_percentiles_nearest_rank_in_ms():
    assert percentiles([]) is None
    assert percentiles([0.003, 0.001, 0.002]) == {"p50": 2.0, "p99": 3.0, "count": 3}
    values = [i / 1000 for i in range(1, 101)]  # 1 .. 100 ms
    assert percentiles(values) == {"p50": 51.0, "p99": 100.0, "count": 100}


# ------------------------------------------------------------------ recorder, no server


def _output(rid: str, tokens: int, finished: bool, ttft: float = 0.1) -> RequestOutput:
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=ttft,
                       finished_time=1.0 if finished else None, num_preemptions=0,
                       num_prompt_tokens=4, num_generation_tokens=tokens)
    out = CompletionOutput(index=0, text="", token_ids=[0] * tokens,
                           finish_reason="length" if finished else None,
                           num_output_tokens=tokens)
    return RequestOutput(rid, None, [0] * 4, [out], finished, m)


@dataclass
class FakeEngine:
    """What the recorder uses of AsyncEngine: the published stats and call()."""

    stats: EngineStats | None
    calls: int = 0

    async def call(self, fn):
        self.calls += 1
        return fn(None)


def _stats(running: int = 2, waiting: int = 1) -> EngineStats:
    return EngineStats(num_steps=1, running=running, waiting=waiting, num_preemptions=0,
                       kv_usage=0.123456, kv_blocks=100, kv_free_blocks=88, block_size=4)


def test_a_sample_has_the_intervals_latencies_only():
    metrics = EngineMetrics("m")
    engine = FakeEngine(_stats())
    metrics.observe_output(_output("old", 1, False), now=0.0)
    metrics.observe_output(_output("old", 2, True, ttft=9.0), now=1.0)  # before the recorder
    recorder = HistoryRecorder(metrics, lambda: engine)
    first = asyncio.run(recorder.sample())
    assert first is not None and first["ttft_ms"] is None and first["itl_ms"] is None
    assert (first["running"], first["waiting"], first["kv_usage"]) == (2, 1, 0.1235)
    assert first["slo"] is None and first["time"] == pytest.approx(time.time(), abs=5)

    metrics.observe_output(_output("a", 1, False), now=10.0)
    metrics.observe_output(_output("a", 3, False), now=10.02)  # 2 tokens: 2 gaps of 10 ms
    metrics.observe_output(_output("a", 4, True, ttft=0.25), now=10.05)  # a gap of 30 ms
    second = asyncio.run(recorder.sample())
    assert second["ttft_ms"] == {"p50": 250.0, "p99": 250.0, "count": 1}
    assert second["itl_ms"] == {"p50": 10.0, "p99": 30.0, "count": 3}
    assert asyncio.run(recorder.sample())["itl_ms"] is None  # nothing new since


def test_new_values_are_found_in_a_full_deque():
    """Past maxlen the deque's length stays put while its values move: the count of new
    values comes from the histogram observed alongside."""
    metrics = EngineMetrics("m")
    recorder = HistoryRecorder(metrics, lambda: FakeEngine(_stats()))
    t, tokens = 0.0, 1
    metrics.observe_output(_output("r", tokens, False), now=t)
    for _ in range(metrics.recent_itl.maxlen + 10):  # 1 ms gaps, overflowing the deque
        t, tokens = t + 0.001, tokens + 1
        metrics.observe_output(_output("r", tokens, False), now=t)
    asyncio.run(recorder.sample())
    for _ in range(5):
        t, tokens = t + 0.007, tokens + 1
        metrics.observe_output(_output("r", tokens, False), now=t)
    itl = asyncio.run(recorder.sample())["itl_ms"]
    assert itl["count"] == 5 and itl["p50"] == pytest.approx(7.0)


def _spec_state(drafts: int, accepted: int, drafts_at: tuple, accepted_at: tuple) -> SpecState:
    return SpecState(method="ngram", num_speculative_tokens=3, max_batch_size=8,
                     min_acceptance=0.0, num_drafts=drafts, num_accepted=accepted,
                     num_rounds=drafts_at[0] if drafts_at else 0, num_steps_off=0,
                     drafts_at=drafts_at, accepted_at=accepted_at)


def test_a_sample_has_the_intervals_draft_acceptance():
    """`spec` counts only the drafts verified since the last sample, overall and at each
    draft position (None where none was verified); None without speculation."""
    engine = FakeEngine(_stats())
    recorder = HistoryRecorder(EngineMetrics("m"), lambda: engine)
    assert asyncio.run(recorder.sample())["spec"] is None
    engine.stats = replace(_stats(), spec=_spec_state(6, 4, (3, 2, 1), (3, 1, 0)))
    first = asyncio.run(recorder.sample())["spec"]
    assert first == {"drafts": 6, "acceptance": round(4 / 6, 4),
                     "acceptance_at": [1.0, 0.5, 0.0]}
    # then 4 drafts at position 1, 2 at position 2 (both held), none deeper
    engine.stats = replace(_stats(), spec=_spec_state(12, 8, (7, 4, 1), (5, 3, 0)))
    second = asyncio.run(recorder.sample())["spec"]
    assert second == {"drafts": 6, "acceptance": round(4 / 6, 4),
                      "acceptance_at": [0.5, 1.0, None]}
    third = asyncio.run(recorder.sample())["spec"]
    assert third == {"drafts": 0, "acceptance": None, "acceptance_at": [None, None, None]}


def test_slo_is_carried_through(monkeypatch):
    metrics = EngineMetrics("m")
    plain = metrics.dashboard
    monkeypatch.setattr(metrics, "dashboard", lambda **kw: {**plain(**kw), "slo": SLO})
    sample = asyncio.run(HistoryRecorder(metrics, lambda: FakeEngine(_stats())).sample())
    assert sample["slo"] == SLO


def test_no_samples_while_loading_and_a_clean_stop():
    engine: FakeEngine | None = None
    recorder = HistoryRecorder(EngineMetrics("m"), lambda: engine, History(interval_s=0.02))

    async def scenario() -> None:
        nonlocal engine
        recorder.start()
        await asyncio.sleep(0.1)  # five intervals
        assert recorder.history.since() == []  # the model is loading
        engine = FakeEngine(_stats())
        deadline = time.monotonic() + 10  # no bound on how soon: a loaded machine is slow
        while len(recorder.history.since()) < 2:
            assert time.monotonic() < deadline, "no samples once the engine was up"
            await asyncio.sleep(0.02)
        await recorder.stop()
        n = len(recorder.history.since())
        await asyncio.sleep(0.1)
        assert len(recorder.history.since()) == n  # stopped: nothing more

    asyncio.run(scenario())
    times = [s["time"] for s in recorder.history.since()]
    assert times == sorted(times)


# ------------------------------------------------------------------------ the route


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=4,
                      num_kv_blocks=256)
    with run_server(args) as (url, app):
        yield url, app


def _history(url: str, **params) -> httpx.Response:
    return httpx.get(f"{url}/v1/engine/history", params=params, timeout=10)


def _wait_samples(url: str, n: int, timeout: float = 30.0) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        data = _history(url).json()["data"]
        if len(data) >= n:
            return data
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} samples after {timeout} s")


@pytest.mark.slow
def test_route_samples_each_second(server):
    url, _ = server
    for i in range(3):
        r = httpx.post(f"{url}/v1/completions", json={
            "prompt": f"hello {i}", "max_tokens": 8, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
    before = len(_history(url).json()["data"])
    data = _wait_samples(url, before + 3)
    body = _history(url).json()
    assert body["object"] == "list" and body["interval_s"] == 1.0
    times = [s["time"] for s in data]
    assert times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(0.5 < g < 3.0 for g in gaps), gaps
    last = data[-1]
    assert set(last) == {"time", "running", "waiting", "kv_usage", "output_tokens_per_s",
                         "ttft_ms", "itl_ms", "slo", "spec"}
    assert last["slo"] is None or isinstance(last["slo"], dict)
    assert last["spec"] is None  # this server does not speculate
    # the three requests' latencies landed in some interval, each counted once
    assert sum((s["ttft_ms"] or {"count": 0})["count"] for s in data) == 3
    asked = time.time()
    recent = _history(url, seconds=2.5).json()["data"]
    assert 1 <= len(recent) <= 3 and recent[0]["time"] >= asked - 2.5


@pytest.mark.slow
def test_route_carries_slo(server, monkeypatch):
    url, app = server
    metrics = app.state.kvserve.metrics
    plain = metrics.dashboard
    monkeypatch.setattr(metrics, "dashboard", lambda **kw: {**plain(**kw), "slo": SLO})
    start = time.time()
    deadline = start + 20
    while time.time() < deadline:
        fresh = _history(url, seconds=2).json()["data"]
        if fresh and fresh[-1]["time"] > start + 0.1:
            assert fresh[-1]["slo"] == SLO
            return
        time.sleep(0.2)
    raise AssertionError("no sample after slo was set")


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_route_refuses_bad_seconds(server, value):
    url, _ = server
    r = _history(url, seconds=value)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["param"] == "seconds" or "seconds" in err["message"]
