"""The model-server protocol that Kubernetes gateways read (the Gateway API Inference
Extension's, which llm-d's and KServe's endpoint pickers use): the queue, batch and KV-cache
gauges under the vLLM names its document lists, equal to kvserve's own; and /ready, 200 only
when the server would take a request now (/health stays liveness)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import faults
from kvserve.engine.llm_engine import EngineArgs
from kvserve.engine.metrics import EngineMetrics
from kvserve.entrypoints.server import app as app_module
from kvserve.entrypoints.server.app import build_app
from kvserve.entrypoints.server.args import ServerArgs
from kvserve.stats import EngineStats
from tests.server_utils import run_server

# kvserve's gauge -> the name the protocol's document gives it (vLLM's), which the picker
# scrapes: TotalRunningRequests, TotalQueuedRequests, KVCacheUtilization
GATEWAY = {"kvserve:num_requests_running": "vllm:num_requests_running",
           "kvserve:num_requests_waiting": "vllm:num_requests_waiting",
           "kvserve:kv_cache_usage_perc": "vllm:kv_cache_usage_perc"}

Gauges = dict[str, tuple[dict[str, str], float]]


def _gauges(text: str) -> Gauges:
    """Every gauge of a /metrics page with its labels and value (one sample each)."""
    out: Gauges = {}
    for family in text_string_to_metric_families(text):
        if family.type != "gauge":
            continue
        for s in family.samples:
            out[s.name] = (s.labels, s.value)
    return out


def _stats(running: int, waiting: int, kv_usage: float) -> EngineStats:
    return EngineStats(num_steps=1, running=running, waiting=waiting, num_preemptions=0,
                       kv_usage=kv_usage, kv_blocks=64, kv_free_blocks=40, block_size=16)


def test_gateway_gauges_take_kvserves_values_at_every_snapshot():
    metrics = EngineMetrics("tiny")
    # distinct values, so a gauge fed from the wrong field shows
    for running, waiting, usage in ((3, 5, 0.375), (0, 2, 0.5), (0, 0, 0.0)):
        metrics.observe_stats(_stats(running, waiting, usage))
        got = _gauges(generate_latest(metrics.registry).decode())
        want = {"vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting,
                "vllm:kv_cache_usage_perc": usage}
        for ours, theirs in GATEWAY.items():
            assert got[theirs] == ({"model_name": "tiny"}, want[theirs]), theirs
            assert got[theirs] == got[ours], (theirs, ours)


def _unready(client, reason: str) -> None:
    r = client.get("/ready")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == reason


def _gated_build(monkeypatch, then: Callable) -> threading.Event:
    """The app's model load waits for the returned event, then calls `then(engine_args)`."""
    gate = threading.Event()

    def build(engine_args):
        assert gate.wait(60), "the test never opened the gate"
        return then(engine_args)

    monkeypatch.setattr(app_module, "build_engine", build)
    return gate


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.02)


def test_ready_is_503_while_the_model_loads_and_after_the_load_failed(monkeypatch):
    def fail(_engine_args):
        raise RuntimeError("no weights here (test)")

    gate = _gated_build(monkeypatch, fail)
    # with an API key too: a probe carries none, and /ready needs none
    app = build_app(EngineArgs(model="unused"),
                    ServerArgs(served_model_name="tiny", api_key="sesame"))
    with TestClient(app) as client:
        try:
            _unready(client, "model is loading")
            assert client.get("/v1/models").status_code == 401  # the key is asked elsewhere
        finally:
            gate.set()
        _wait_for(lambda: "failed" in client.get("/ready").text, "failed")
        _unready(client, "model failed to load: no weights here (test)")


@pytest.mark.slow
def test_ready_from_loading_to_serving_to_shutdown(tiny_llama_dir, monkeypatch):
    gate = _gated_build(monkeypatch, app_module.build_engine)
    app = build_app(EngineArgs(model=str(tiny_llama_dir), dtype="float32"), ServerArgs())
    with TestClient(app) as client:
        try:
            _unready(client, "model is loading")
        finally:
            gate.set()
        _wait_for(lambda: client.get("/ready").status_code == 200, "ready")
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert client.get("/ready").status_code == 200
    # The app's shutdown has run and stopped the engine. (Under uvicorn, SIGTERM closes the
    # listening socket before that, so a probe is refused a connection meanwhile.)
    _unready(client, "the server is shutting down")


@pytest.fixture
def slow_steps():
    """Every engine step sleeps 20 ms: a request with many tokens stays in the batch."""
    faults.install(faults.Faults(slow_step_s=0.02))
    yield
    faults.install(None)


def _scrape(url: str) -> Gauges:
    return _gauges(httpx.get(f"{url}/metrics", timeout=10).text)


def _consistent_scrape(url: str, check: Callable[[Gauges], bool], what: str) -> Gauges:
    """The first scrape in which `check` holds and each vllm: gauge equals kvserve's. A
    scrape can fall between the engine setting kvserve's gauges and the protocol's ones (the
    KV gauge moves as a request decodes), so a mismatch is only a failure if it lasts."""
    seen: list[Gauges] = []

    def ok() -> bool:
        got = _scrape(url)
        seen.append(got)
        return check(got) and all(got[t] == got[o] for o, t in GATEWAY.items())

    try:
        _wait_for(ok, what, timeout=20)
    except AssertionError as e:
        last = {n: seen[-1].get(n) for pair in GATEWAY.items() for n in pair}
        raise AssertionError(f"{e}; last scrape: {last}") from None
    return seen[-1]


@pytest.mark.slow
def test_gauges_match_and_ready_follows_the_queue(tiny_llama_dir, slow_steps):
    """One request running and one waiting (--max-num-seqs 1) with --max-waiting-requests 1:
    the queue is full, so /ready is 503 and the gauges say why; once both are gone, 200."""
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", max_num_seqs=1,
                      block_size=4, num_kv_blocks=128)
    body = {"prompt": "Go", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with run_server(args, max_waiting_requests=1) as (url, app):
        assert httpx.get(f"{url}/ready").status_code == 200
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as a:
            lines = a.iter_lines()  # keep a reference: dropping it closes the stream
            next(lines)  # a is running
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as b:
                assert b.status_code == 200  # b is accepted, and waits behind a
                got = _consistent_scrape(
                    url, lambda g: g["kvserve:num_requests_waiting"][1] == 1, "one waiting")
                assert got["vllm:num_requests_running"][1] == 1
                assert got["vllm:num_requests_waiting"][1] == 1
                assert got["vllm:kv_cache_usage_perc"][1] > 0
                for name in GATEWAY.values():
                    assert got[name][0]["model_name"] == app.state.kvserve.model_name
                r = httpx.get(f"{url}/ready")
                assert r.status_code == 503
                assert "--max-waiting-requests" in r.json()["error"]["message"]
        # both clients are gone: their requests are aborted, the queue empties
        _wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200, "ready again")
        got = _consistent_scrape(
            url, lambda g: g["kvserve:num_requests_running"][1] == 0, "idle")
        assert [got[t][1] for t in GATEWAY.values()] == [0, 0, 0]
