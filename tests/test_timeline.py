"""Per-request timelines and the step profiler, on a tiny random model: events in order, the
breakdown adding up, preemptions and cache hits showing when forced, the bounded buffer."""

from __future__ import annotations

import functools
import random

import pytest

from kvserve.sample.sampling_params import SamplingParams
from tests.conftest import make_llm as make_tiny_llm

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


make_llm = functools.partial(make_tiny_llm, max_num_batched_tokens=32)  # 32-token steps


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


def events(timeline: dict, kind: str) -> list[dict]:
    return [e for e in timeline["samples"][0]["events"] if e["event"] == kind]


def check_consistent(t: dict) -> None:
    b = t["breakdown"]
    assert b["queue_time"] + b["prefill_time"] + b["decode_time"] == \
        pytest.approx(b["e2e_time"], abs=1e-3)
    assert b["queue_time"] + b["prefill_time"] == pytest.approx(b["ttft"], abs=1e-3)
    for sample in t["samples"]:
        ev = sample["events"]
        assert ev[0]["event"] == "arrival" and ev[-1]["event"] == "finished"
        times = [e["t"] for e in ev]
        assert times == sorted(times)
        assert [e["event"] for e in ev].count("first_token") == 1
        for e in ev:
            if e["event"] == "decode":
                assert e["t"] <= e["end"] and e["batch_min"] <= e["batch"] <= e["batch_max"]
    first_token = events(t, "first_token")[0]["t"]
    assert first_token == pytest.approx(b["ttft"], abs=1e-3)
    assert events(t, "finished")[0]["t"] == pytest.approx(b["e2e_time"], abs=1e-3)


def test_timeline_events_and_breakdown(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    ps = prompts(4)
    outs = llm.generate(ps, PARAMS)
    for p, o in zip(ps, outs, strict=True):
        t = llm.engine.request_timeline(o.request_id)
        check_consistent(t)
        assert t["finished"] and t["prompt_tokens"] == len(p)
        # every token the request computed is in exactly one prefill or decode event
        prefill = sum(e["tokens"] for e in events(t, "prefill"))
        decode = events(t, "decode")
        assert prefill == len(p)  # no cache hit, no preemption here
        assert len(decode) == 1 and decode[0]["steps"] == decode[0]["tokens"] == 11
        assert t["breakdown"]["prompt_tokens_computed"] == len(p)
        # the responses' timings are the same numbers
        assert o.metrics.as_dict() == t["breakdown"]


def test_preemption_and_cache_hits_appear(tiny_llama_dir):
    # 40 blocks of 4 cannot hold 8 requests of up to 71 tokens: some get preempted.
    llm = make_llm(tiny_llama_dir, num_kv_blocks=40)
    ps = prompts(8, seed=1)
    outs = llm.generate(ps, PARAMS)
    assert llm.engine.local_core.scheduler.num_preemptions > 0
    preempted = 0
    for o in outs:
        t = llm.engine.request_timeline(o.request_id)
        check_consistent(t)
        n = len(events(t, "preempted"))
        assert n == len(events(t, "resumed")) == t["breakdown"]["num_preemptions"]
        if n:
            preempted += 1
            assert t["breakdown"]["preempted_time"] > 0
            kinds = [e["event"] for e in t["samples"][0]["events"]]
            assert kinds.index("preempted") < kinds.index("resumed")
    assert preempted > 0
    # A prompt seen before: its full blocks come from the prefix cache.
    llm = make_llm(tiny_llama_dir)
    llm.generate([ps[0]], PARAMS)
    again = llm.generate([ps[0]], PARAMS)[0]
    t = llm.engine.request_timeline(again.request_id)
    hit = events(t, "prefix_hit")
    cached = (len(ps[0]) - 1) // 4 * 4
    assert hit == [{"t": hit[0]["t"], "event": "prefix_hit", "tokens": cached,
                    "tiers": {"device": cached}}]
    assert sum(e["tokens"] for e in events(t, "prefill")) == len(ps[0]) - cached
    assert t["breakdown"]["prompt_tokens_cached"] == cached


def test_speculative_rounds_in_the_timeline(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, speculative_config={
        "method": "draft_model", "model": str(tiny_llama_dir), "quantization": "none"})
    out = llm.generate(prompts(1, seed=2), PARAMS)[0]
    t = llm.engine.request_timeline(out.request_id)
    decode = events(t, "decode")
    assert sum(e["drafted"] for e in decode) == out.metrics.num_draft_tokens > 0
    assert sum(e["accepted"] for e in decode) == out.metrics.num_accepted_tokens
    # verified drafts make the decode events hold more tokens than steps
    assert sum(e["tokens"] for e in decode) == sum(e["steps"] for e in decode) + \
        sum(e["drafted"] for e in decode)


def test_timeline_buffer_is_bounded_and_unknown_ids_are_none(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, timeline_buffer_size=2)
    ids = [llm.generate([p], PARAMS)[0].request_id for p in prompts(3, seed=3)]
    assert llm.engine.request_timeline(ids[0]) is None  # expired
    assert all(llm.engine.request_timeline(i) is not None for i in ids[1:])
    assert llm.engine.request_timeline("no-such-request") is None
    # a running request has a timeline too, not finished yet
    llm.engine.add_request("live", prompts(1, seed=4)[0], PARAMS)
    llm.engine.step()
    live = llm.engine.request_timeline("live")
    assert live is not None and not live["finished"]
    assert [e["event"] for e in live["samples"][0]["events"]][:2] == ["arrival", "prefill"]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_step_profiler(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, step_buffer_size=5)
    ps = prompts(3, seed=5)
    llm.generate(ps, PARAMS)
    steps = list(llm.engine.local_core.steps)
    assert len(steps) == 5  # the newest five
    assert [s.step for s in steps] == list(range(steps[0].step, steps[0].step + 5))
    for s in steps:
        parts = s.draft + s.schedule + s.prepare + s.forward + s.sample + s.output
        assert s.forward > 0 and parts == pytest.approx(s.total, abs=1e-4)
        assert s.num_requests >= 1 and s.prefill_tokens + s.decode_tokens >= s.num_requests
    # the last steps only decode
    assert steps[-1].prefill_tokens == 0 and steps[-1].decode_tokens == steps[-1].num_requests
    first = make_llm(tiny_llama_dir)
    first.generate(ps, PARAMS)
    assert sum(s.prefill_tokens for s in first.engine.local_core.steps) == sum(map(len, ps))


def test_timelines_off(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, timeline_buffer_size=0, step_buffer_size=0,
                   num_kv_blocks=40)
    outs = llm.generate(prompts(8, seed=1), PARAMS)
    assert llm.engine.local_core.scheduler.num_preemptions > 0  # resuming works without events
    assert llm.engine.request_timeline(outs[0].request_id) is None
    assert not llm.engine.local_core.steps
    assert all(o.metrics.ttft is not None and o.metrics.e2e_time for o in outs)


def test_abort_and_failure_reasons_in_the_timeline(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    eng = llm.engine
    eng.add_request("a", prompts(1, seed=6)[0], PARAMS)
    eng.add_request("b", prompts(1, seed=7)[0], PARAMS)
    eng.step()
    eng.abort_request("a")
    eng.abort_request("b", "RuntimeError: boom")
    while eng.has_unfinished_requests():
        eng.step()
    a, b = eng.request_timeline("a"), eng.request_timeline("b")
    assert events(a, "finished") == [{"t": events(a, "finished")[0]["t"], "event": "finished",
                                      "reason": "abort"}]
    assert events(b, "finished")[0]["error"] == "RuntimeError: boom"
    times = [e["t"] for e in a["samples"][0]["events"]]
    assert times == sorted(times)
