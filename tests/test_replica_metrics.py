"""Metrics and dashboard figures across replicas, without Ray: every /metrics sample carries a
`replica` label, several replicas' pages merge into one valid page, and the ingress' sums of
/v1/engine/stats and /v1/engine/history (kvserve.entrypoints.ray_serve.aggregate) add what
adds, recompute ratios from the sums and bound percentiles by the slowest replica's. The
same through two replicas on Ray: tests/test_ray_serve.py."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.args import EngineArgs
from kvserve.entrypoints.ray_serve.aggregate import sum_histories, sum_stats
from kvserve.entrypoints.server.metrics_text import exposition, merge
from tests.server_utils import openai_client, run_server


def _page(replica: str, requests: int, seconds: float) -> bytes:
    r = CollectorRegistry()
    Counter("kvserve:request_success", "Finished requests", ["model_name", "finished_reason"],
            registry=r).labels("m", "stop").inc(requests)
    Histogram("kvserve:e2e_request_latency_seconds", "End to end", ["model_name"],
              buckets=(1.0, 2.0), registry=r).labels("m").observe(seconds)
    return exposition(r, replica)


def _samples(page: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(page.decode()) for s in f.samples
            if not s.name.endswith("_created")}


def test_every_sample_carries_its_replica_and_pages_merge_into_one():
    a, b = _page("r1", 3, 0.5), _page("r2", 4, 1.5)
    assert all(dict(labels)["replica"] == "r1" for _, labels in _samples(a))
    merged = merge([a, b])
    text = merged.decode()
    # each family's help and type once, as Prometheus' text format requires
    assert text.count("# TYPE kvserve:request_success_total counter") == 1
    assert text.count("# TYPE kvserve:e2e_request_latency_seconds histogram") == 1
    got = _samples(merged)
    assert got == {**_samples(a), **_samples(b)}  # nothing lost, nothing changed
    total = sum(v for (name, _), v in got.items() if name == "kvserve:request_success_total")
    assert total == 7
    inf = {dict(labels)["replica"]: v for (name, labels), v in got.items()
           if name == "kvserve:e2e_request_latency_seconds_bucket"
           and dict(labels)["le"] == "1.0"}
    assert inf == {"r1": 1.0, "r2": 0.0}


def _stats(running, blocks, usage, queried, hits, p99, tokens_s, arrival) -> dict:
    return {"model": "m", "running": running, "waiting": 1,
            "kv": {"usage": usage, "blocks": blocks, "free_blocks": int(blocks * (1 - usage)),
                   "block_size": 16,
                   "tiers": [{"name": "host", "blocks": 5, "capacity_blocks": 10,
                              "loads": 1, "saves": 2}]},
            "prefix_cache": {"queried_tokens": queried, "hit_tokens": {"device": hits},
                             "hit_rate": hits / queried},
            "spec_decode": None, "step_cost": {"fixed_ms": 1.0}, "step_budget": {},
            "output_tokens_per_s": tokens_s,
            "ttft_ms": {"p50": p99 / 2, "p90": p99 - 1, "p99": p99}, "itl_ms": None,
            "slo": None,
            "recent": [{"id": f"req-{arrival}", "arrival_unix": arrival, "segments": []}]}


def test_stats_add_counts_and_recompute_ratios():
    one = _stats(running=2, blocks=100, usage=0.5, queried=1000, hits=900, p99=40.0,
                 tokens_s=10.0, arrival=2.0)
    two = _stats(running=3, blocks=100, usage=0.1, queried=3000, hits=300, p99=90.0,
                 tokens_s=5.5, arrival=1.0)
    s = sum_stats([one, two])
    assert (s["replicas"], s["running"], s["waiting"]) == (2, 5, 2)
    assert s["kv"]["blocks"] == 200 and s["kv"]["usage"] == pytest.approx(0.3)
    assert s["kv"]["tiers"] == [{"name": "host", "blocks": 10, "capacity_blocks": 20,
                                 "loads": 2, "saves": 4}]
    # 1200 of 4000 tokens, not the mean of 0.9 and 0.1
    assert s["prefix_cache"]["hit_rate"] == pytest.approx(0.3)
    assert s["output_tokens_per_s"] == pytest.approx(15.5)
    assert s["ttft_ms"] == {"p50": 45.0, "p90": 89.0, "p99": 90.0}  # the slowest replica's
    assert s["itl_ms"] is None and s["step_cost"] is None
    assert [r["id"] for r in s["recent"]] == ["req-1.0", "req-2.0"]  # oldest first
    with pytest.raises(ValueError):
        sum_stats([])


def _sample(t, running, tokens, ttft=None, spec=None) -> dict:
    return {"time": t, "running": running, "waiting": 0, "kv_usage": 0.2 * running,
            "output_tokens_per_s": tokens, "ttft_ms": ttft, "itl_ms": None, "slo": None,
            "spec": spec}


def test_histories_sum_sample_by_interval():
    a = {"object": "list", "interval_s": 1.0, "data": [
        _sample(100.1, 1, 10.0, {"p50": 5.0, "p99": 9.0, "count": 3},
                {"drafts": 10, "acceptance": 0.5, "acceptance_at": [0.8, 0.2]}),
        _sample(101.1, 2, 20.0)]}
    b = {"object": "list", "interval_s": 1.0, "data": [
        _sample(100.6, 3, 5.0, {"p50": 7.0, "p99": 8.0, "count": 2},
                {"drafts": 30, "acceptance": 0.9, "acceptance_at": [1.0]}),
        _sample(100.9, 4, 6.0),  # a second sample of b in [100, 101): its newest counts
        _sample(102.2, 1, 1.0)]}
    h = sum_histories([a, b])
    assert [s["time"] for s in h["data"]] == [100.9, 101.1, 102.2]
    first = h["data"][0]
    assert (first["replicas"], first["running"], first["output_tokens_per_s"]) == (2, 5, 16.0)
    assert first["kv_usage"] == pytest.approx(0.5)  # mean of 0.2 and 0.8
    assert first["ttft_ms"] == {"p50": 5.0, "p99": 9.0, "count": 3}  # b's newest had none
    assert h["data"][1]["replicas"] == 1 and h["data"][1]["running"] == 2

    spec = sum_histories([a, {**b, "data": [b["data"][0]]}])["data"][0]["spec"]
    assert spec["drafts"] == 40
    assert spec["acceptance"] == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)
    assert spec["acceptance_at"] == [pytest.approx((0.8 * 10 + 1.0 * 30) / 40), 0.2]


def test_a_plain_server_is_replica_zero(tiny_llama_dir):
    with run_server(EngineArgs(model=str(tiny_llama_dir), dtype="float32"),
                    served_model_name="tiny") as (url, _):
        openai_client(url).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert httpx.get(f"{url}/v1/engine/replicas").json() == {
            "object": "list", "data": [{"id": "0"}]}
        families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        samples = [s for f in families for s in f.samples]
        assert samples and all(s.labels.get("replica") == "0" for s in samples)
