"""Scheduler with toy sizes (block size 4): chunked prefill under a token budget, decodes
first, admission against free blocks, preemption by recompute and resume."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sample.sampling_params import SamplingParams
from kvserve.sched.scheduler import SHORT_STEP_TOKENS, Scheduler

_ids = itertools.count()


def make_req(prompt_len: int, max_tokens: int = 4, first_token: int = 0) -> Request:
    prompt = [first_token + i for i in range(prompt_len)]
    return Request(f"r{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens),
                   frozenset(), max_tokens)


def make_sched(num_blocks=32, budget=16, max_seqs=8, max_len=256, caching=False,
               short_steps=True):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len, short_steps), kv)


def step(sched: Scheduler):
    """One engine step without a model: every sampling request gets token 7."""
    out = sched.schedule()
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.samples:
            s.request.append_token(7)
            status = s.request.check_stop_token()
            if status is not None:
                sched.finish(s.request, status)
    sched.kv.check_integrity()
    return out


def plan(out) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled]


def test_long_prompt_is_chunked_under_the_budget():
    sched = make_sched(budget=8)
    r = make_req(20)
    sched.add_request(r)
    assert plan(step(sched)) == [(r.request_id, 8, False)]
    assert r.block_ids == [0, 1]
    assert plan(step(sched)) == [(r.request_id, 8, False)]
    assert r.block_ids == [0, 1, 2, 3]
    assert plan(step(sched)) == [(r.request_id, 4, True)]
    assert r.block_ids == [0, 1, 2, 3, 4]  # room for the sampled token 21
    assert r.output_token_ids == [7]
    assert plan(step(sched)) == [(r.request_id, 1, True)]


def test_decodes_go_first_and_a_long_prompt_fills_the_rest():
    sched = make_sched(budget=8)
    a = make_req(3, max_tokens=10)
    sched.add_request(a)
    step(sched)  # a prefilled, now decoding
    b = make_req(30)
    sched.add_request(b)
    for _ in range(3):
        out = step(sched)
        assert plan(out)[0] == (a.request_id, 1, True)  # never stalled
        assert plan(out)[1][:2] == (b.request_id, 7)
    assert b.num_computed_tokens == 21


def test_running_prefill_chunk_does_not_delay_a_decode_behind_it():
    sched = make_sched(budget=6)
    a = make_req(2, max_tokens=10)
    sched.add_request(a)
    step(sched)  # a is decoding
    b = make_req(40)
    sched.add_request(b)
    step(sched)
    # Put the prompt chunk ahead of the decode in running order (as a resume after
    # preemption can): the decode must still be served first.
    sched.running = [b, a]
    out = step(sched)
    assert plan(out) == [(a.request_id, 1, True), (b.request_id, 5, False)]


def test_max_num_seqs_caps_running_requests():
    sched = make_sched(budget=64, max_seqs=2)
    reqs = [make_req(4) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert [p[0] for p in plan(out)] == [reqs[0].request_id, reqs[1].request_id]
    assert list(sched.waiting) == [reqs[2]]


def test_admission_waits_for_free_blocks():
    sched = make_sched(num_blocks=4, budget=64)
    a, b = make_req(12, max_tokens=1), make_req(8, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)  # a takes 3 blocks + needs none more; b needs 2, only 1 free
    assert plan(out) == [(a.request_id, 12, True)]
    assert a.status == RequestStatus.FINISHED_LENGTH
    out = step(sched)
    assert plan(out) == [(b.request_id, 8, True)]
    assert sched.kv.num_free_blocks == 4


def test_preemption_of_latest_arrival_and_resume_with_same_tokens():
    sched = make_sched(num_blocks=5, budget=64)
    a, b = make_req(7, max_tokens=8), make_req(7, max_tokens=8, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # each holds 2 blocks (8 slots), 1 free
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    preempted = []
    while sched.has_unfinished:
        out = step(sched)
        preempted += out.preempted
        assert sched.kv.num_free_blocks + sum(
            len(r.block_ids) for r in sched.running) == 5
    assert preempted and preempted[0] is b  # the later arrival goes
    assert b.timeline.num_preemptions >= 1
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert sched.kv.num_free_blocks == 5


def test_preempted_request_resumes_from_its_generated_tokens():
    sched = make_sched(num_blocks=4, budget=64)
    a, b = make_req(4, max_tokens=9), make_req(4, max_tokens=9, first_token=20)
    sched.add_request(a)
    sched.add_request(b)
    while not b.timeline.num_preemptions:
        step(sched)
    generated = list(b.output_token_ids)
    assert b.num_computed_tokens == 0 and b.block_ids == []
    while b.status != RequestStatus.RUNNING:
        step(sched)
    # Recompute covers prompt and earlier output in one prefill, then sampling continues.
    assert b.output_token_ids[:len(generated)] == generated


def test_prompt_plus_max_tokens_over_limit_is_an_error():
    sched = make_sched(max_len=16)
    with pytest.raises(ValueError, match="max_model_len 16"):
        sched.add_request(make_req(10, max_tokens=7))


def test_request_larger_than_the_cache_is_an_error():
    sched = make_sched(num_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_req(10, max_tokens=1))


def test_prefix_hits_skip_computed_tokens():
    sched = make_sched(budget=64, caching=True)
    a = make_req(10, max_tokens=1)
    sched.add_request(a)
    step(sched)
    b = make_req(10, max_tokens=2)  # same prompt
    sched.add_request(b)
    out = step(sched)
    assert plan(out) == [(b.request_id, 2, True)]  # 8 tokens from cache, 2 computed
    assert b.block_ids[:2] == [0, 1]


@pytest.mark.parametrize("short_steps", [True, False])
def test_short_prompt_after_a_cache_hit_does_not_wait_for_a_long_prompt(short_steps):
    sched = make_sched(num_blocks=64, budget=16, caching=True, short_steps=short_steps)
    seen = make_req(12, max_tokens=1, first_token=100)
    sched.add_request(seen)
    step(sched)  # its three blocks are now cached
    long = make_req(60, max_tokens=1)
    sched.add_request(long)
    assert plan(step(sched)) == [(long.request_id, 16, False)]
    hit = Request("hit", list(range(100, 112)) + [5], SamplingParams(max_tokens=2),
                  frozenset(), 2)
    sched.add_request(hit)
    # 12 of its 13 tokens are cached: its last token goes ahead of the long prompt's chunk,
    # in a step of its own when short prompt steps are on.
    if short_steps:
        assert plan(step(sched)) == [("hit", 1, True)]
        assert plan(step(sched)) == [("hit", 1, True), (long.request_id, 15, False)]
    else:
        assert plan(step(sched)) == [("hit", 1, True), (long.request_id, 15, False)]


def test_short_prompts_never_take_more_than_half_the_budget():
    sched = make_sched(num_blocks=64, budget=16, max_seqs=16, short_steps=False)
    long = make_req(60, max_tokens=1)
    sched.add_request(long)
    step(sched)
    shorts = [make_req(3, max_tokens=1, first_token=200 + 10 * i) for i in range(6)]
    for r in shorts:
        sched.add_request(r)
    out = plan(step(sched))
    spent_short = sum(n for rid, n, _ in out if rid != long.request_id)
    assert 0 < spent_short <= 8
    assert (long.request_id, 16 - spent_short, False) in out


def test_short_prompt_steps_alternate_with_the_rest():
    """A step of short prompt work alone is never followed by another: decodes and long
    prompts get every other step, and in it at least half the budget."""
    sched = make_sched(num_blocks=128, budget=16, max_seqs=32)
    long = make_req(60, max_tokens=1)
    decode = make_req(3, max_tokens=20, first_token=500)
    sched.add_request(decode)
    step(sched)  # decode's prompt
    sched.add_request(long)
    step(sched)  # decode's token and long's first chunk
    for _ in range(4):
        shorts = [make_req(3, max_tokens=1, first_token=1000 + 10 * next(_ids)) for _ in range(6)]
        for r in shorts:  # more short prompts than one step takes
            sched.add_request(r)
        alone = {rid for rid, _, _ in plan(step(sched))}
        assert alone and alone <= {r.request_id for r in shorts}
        left = long.num_tokens - long.num_computed_tokens
        rest = {rid: n for rid, n, _ in plan(step(sched))}
        assert rest[decode.request_id] == 1
        assert rest[long.request_id] >= min(left, 7)  # half of what the decode left


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(st.tuples(st.sampled_from(["add", "abort", "step"]),
                              st.integers(1, 30), st.integers(1, 12)),
                    min_size=1, max_size=40),
    budget=st.integers(1, 24), num_blocks=st.integers(8, 20), caching=st.booleans())
def test_random_workloads_finish_and_never_leak(events, budget, num_blocks, caching):
    sched = make_sched(num_blocks=num_blocks, budget=budget, max_seqs=4, caching=caching)
    live: list[Request] = []
    for op, a, b in events:
        if op == "add":
            r = make_req(a, max_tokens=b, first_token=a % 3)
            try:
                sched.add_request(r)
            except ValueError:
                continue  # could never fit: rejected up front
            live.append(r)
        elif op == "abort" and live:
            r = live[a % len(live)]
            if not r.status.finished:
                sched.finish(r, RequestStatus.FINISHED_ABORTED)
        else:
            step(sched)
        sched.kv.check_integrity()
    for _ in range(2000):
        if not sched.has_unfinished:
            break
        step(sched)
    assert not sched.has_unfinished, "requests stuck"
    for r in live:
        assert r.status.finished
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens
    assert sched.kv.num_free_blocks == num_blocks


def test_short_prompts_present_together_are_served_in_steps_of_about_32_tokens():
    """Short work waiting at once goes out in consecutive steps of SHORT_STEP_TOKENS or a
    little more, so the first prompts do not wait for the last; short work arriving during
    that run waits for the normal step after it."""
    assert SHORT_STEP_TOKENS == 32
    sched = make_sched(num_blocks=256, budget=64, max_seqs=32)
    decode = make_req(3, max_tokens=30, first_token=500)
    sched.add_request(decode)
    step(sched)  # its prompt, a short step
    step(sched)  # its first decode, a normal step
    shorts = [make_req(12, max_tokens=2, first_token=1000 + 20 * i) for i in range(6)]
    for r in shorts:
        sched.add_request(r)
    first = plan(step(sched))
    assert first == [(r.request_id, 12, True) for r in shorts[:3]]  # 36 >= 32 tokens
    late = make_req(12, max_tokens=2, first_token=3000)
    sched.add_request(late)
    second = plan(step(sched))
    assert second == [(r.request_id, 12, True) for r in shorts[3:]]
    normal = {rid: n for rid, n, _ in plan(step(sched))}
    assert normal[decode.request_id] == 1
    assert all(normal[r.request_id] == 1 for r in shorts)  # their second tokens
    assert normal[late.request_id] == 12  # with the decodes, after the run
