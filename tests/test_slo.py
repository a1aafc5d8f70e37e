"""Latency targets: the step cost model's fit, step sizing under an ITL target with a fake
(fixed) cost model, admission by the target, predicted TTFT, and goodput accounting."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.engine.metrics import EngineMetrics
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sample.sampling_params import SamplingParams
from kvserve.sched.scheduler import MIN_PROMPT_TOKENS, UNSURE_PROMPT_TOKENS, Scheduler
from kvserve.sched.slo import (
    LatencyTargets,
    StepShape,
    StepTimeModel,
    nonnegative_lstsq,
    prompt_attended,
)
from tests.test_scheduler import plan, step

_ids = itertools.count()


def make_req(prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(f"s{next(_ids)}", list(range(prompt_len)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset(),
                   max_tokens)


def make_sched(budget=256, max_seqs=32, itl_ms=None, ttft_ms=None, short_steps=True,
               num_blocks=2048) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False)
    ms = lambda v: None if v is None else v / 1e3  # noqa: E731
    return Scheduler(SchedulerConfig(max_seqs, budget, 4096, short_steps, ms(ttft_ms),
                                     ms(itl_ms)), kv)


# A CPU-like model: 20 ms fixed, 1 ms per prompt token, 2 ms per decode row, 0.01 ms per 1k
# attended pairs.
COEF = (0.020, 0.001, 0.002, 0.00001)


def test_fit_recovers_the_coefficients_of_noisy_steps():
    rng = random.Random(0)
    model = StepTimeModel()
    for _ in range(300):
        shape = StepShape(rng.choice([0, 0, 16, 64, 200]), rng.randint(0, 32),
                          rng.randint(0, 200_000))
        true = float(np.dot(COEF, shape.features()))
        model.observe(shape, true * rng.uniform(0.97, 1.03))
    assert model.coef is not None
    np.testing.assert_allclose(model.coef[:3], COEF[:3], rtol=0.1)
    big = StepShape(128, 16, 50_000)
    assert model.predict(big) == pytest.approx(np.dot(COEF, big.features()), rel=0.05)


def test_fit_is_unknown_until_enough_steps_and_never_negative():
    model = StepTimeModel(min_samples=16)
    for i in range(15):
        model.observe(StepShape(0, i + 1, 0), 0.01)
        assert model.predict(StepShape(0, 1, 0)) is None
    # time falling with decode rows: unconstrained least squares would cost a row < 0
    for i in range(40):
        model.observe(StepShape(0, i + 1, 0), 0.05 - 0.0005 * i)
    assert model.coef is not None and (model.coef >= 0).all()


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(x=st.lists(st.tuples(*[st.floats(0, 100)] * 3), min_size=4, max_size=30),
       y=st.lists(st.floats(-10, 10), min_size=30, max_size=30))
def test_nonnegative_lstsq_is_feasible_and_no_worse_than_any_single_column(x, y):
    a = np.array(x)
    b = np.array(y[:len(x)])
    c = nonnegative_lstsq(a, b)
    assert (c >= 0).all()
    err = np.sum((a @ c - b) ** 2)
    assert err <= np.sum(b * b) + 1e-6
    for j in range(a.shape[1]):
        col = a[:, j]
        if col @ col > 1e-9:
            t = max(col @ b / (col @ col), 0.0)
            assert err <= np.sum((col * t - b) ** 2) * (1 + 1e-6) + 1e-6


@settings(max_examples=100, deadline=None)
@given(decodes=st.integers(0, 64), context=st.integers(0, 3000),
       target_ms=st.floats(1, 400), limit=st.integers(0, 600))
def test_max_prefill_is_the_largest_prompt_that_fits(decodes, context, target_ms, limit):
    model = StepTimeModel()
    model.set(*COEF)
    base = StepShape(0, decodes, decodes * 500)
    got = model.max_prefill(base, target_ms / 1e3, limit, context)

    def t(p):
        return model.predict(StepShape(p, decodes, base.attended + prompt_attended(context, p)))

    if t(0) > target_ms / 1e3:
        assert got == 0
    else:
        assert 0 <= got <= limit and t(got) <= target_ms / 1e3
        assert got == limit or t(got + 1) > target_ms / 1e3


def _workload(sched: Scheduler, n: int, prompt: int, out_len: int) -> list[Request]:
    reqs = [make_req(prompt, out_len) for _ in range(n)]
    for r in reqs:
        sched.add_request(r)
    return reqs


def _schedules(itl_ms: float | None, fitted: bool) -> list[list[tuple[str, int, bool]]]:
    """Every step's plan for one fixed workload (request ids numbered afresh each time)."""
    global _ids
    _ids = itertools.count()
    sched = make_sched(budget=64, max_seqs=8, itl_ms=itl_ms)
    if fitted:
        sched.cost.set(*COEF)
    _workload(sched, 12, 40, 6)
    steps = []
    while sched.has_unfinished:
        steps.append(plan(step(sched)))
    return steps


def test_no_targets_schedule_as_before_even_with_a_fitted_model():
    """The cost model alone changes nothing: the same workload gives the same steps."""
    assert _schedules(None, fitted=False) == _schedules(None, fitted=True)


def test_steps_with_decodes_meet_the_itl_target_where_feasible():
    target_ms = 100.0
    sched = make_sched(budget=512, max_seqs=64, itl_ms=target_ms)
    sched.cost.set(*COEF)
    _workload(sched, 40, 200, 20)
    decoding_steps = most = 0
    while sched.has_unfinished:
        most = max(most, len(sched.running))
        out = step(sched)
        if any(not s.prefill for s in out.scheduled):
            decoding_steps += 1
            predicted = sched.cost.predict(out.shape)
            assert predicted is not None and predicted <= target_ms / 1e3 + 1e-9, plan(out)
        # admission keeps the batch where a step of all its decodes fits
        rows = len(sched.running)
        assert sched.cost.predict(StepShape(MIN_PROMPT_TOKENS, rows, 0)) <= target_ms / 1e3
    assert decoding_steps > 20
    assert 5 <= most <= 17  # not one request at a time; the cap: see the test below


def test_admission_keeps_the_steady_load_within_the_target():
    """Each request adds a decode row and its prompt spread over its output (200 / 20 = 10
    tokens a step), the prompt part capped at half of the 70 tokens a 90 ms step (the 100 ms
    target planned with its margin) holds: 20 ms + 35 + 2 ms a row fits 17 rows."""
    sched = make_sched(budget=512, max_seqs=64, itl_ms=100.0)
    sched.cost.set(0.020, 0.001, 0.002, 0.0)
    for k in range(30):
        fits = sched._fits_target(200, 20)
        assert fits == (k < 17), k
        sched.running.append(make_req(200, 20))
    del sched.running[15:]
    assert sched._fits_target(4, 100, extra=1)  # 17 rows: 20 + 35 + 34 = 89 ms
    assert not sched._fits_target(4, 100, extra=2)  # 18 rows: 91 ms


def test_prompts_progress_when_decodes_alone_exceed_the_target():
    """Requests admitted before the machine turned out slower decode in steps over the
    target: a running prompt still gets MIN_PROMPT_TOKENS of every step, so it is never
    starved. (Before the model is fitted, admission is one prompt at a time now, so the fit
    changes here instead of being made.)"""
    sched = make_sched(budget=512, max_seqs=32, itl_ms=60.0, short_steps=False)
    sched.cost.set(0.001, 0.0, 0.0001, 0.0)  # cheap: all 20 are admitted
    _workload(sched, 19, 4, 200)
    long = make_req(1000, 4)
    sched.add_request(long)
    step(sched)
    assert len(sched.running) == 20
    sched.cost.set(*COEF)  # now 20 + 19 x 2 ms > 60 ms
    while long.num_output_tokens == 0:
        before = long.num_computed_tokens
        out = step(sched)
        assert sum(1 for s in out.scheduled if not s.prefill) == 19
        assert long.num_computed_tokens - before == min(MIN_PROMPT_TOKENS, 1000 - before)


def test_a_target_no_step_can_meet_runs_one_request_at_a_time():
    """The fixed cost alone (20 ms) is over a 5 ms target. This used to fall back, silently,
    to scheduling with no target; now the scheduler gives the shortest gaps this machine can
    (the engine warns): one request at a time, its prompt in whole-budget steps."""
    steps = _schedules(5.0, fitted=True)
    assert all(len(p) == 1 for p in steps)
    assert len(steps) == 12 * 6  # each: its 40-token prompt in one step, then 5 decodes
    assert steps != _schedules(None, fitted=True)
    sched = make_sched(itl_ms=5.0)
    sched.cost.set(*COEF)
    assert sched.sizing() == "infeasible"
    sched.add_request(make_req(40))
    step(sched)
    # one seat, taken: a new request waits for it (2 ms a decode row, 7 tokens to go)
    assert sched.ttft.predict(40, 8) >= 7 * 0.022


def test_prompt_allowance_gives_prompts_what_the_target_leaves():
    target_ms = 100.0
    sched = make_sched(budget=512, max_seqs=64, itl_ms=target_ms, short_steps=False)
    sched.cost.set(0.020, 0.001, 0.002, 0.0)
    _workload(sched, 10, 4, 50)
    while any(r.num_output_tokens == 0 for r in sched.running) or sched.waiting:
        step(sched)  # the ten short prompts are in and decoding
    long = make_req(1000, 4)
    sched.add_request(long)
    out = step(sched)
    prompt = [s.num_new_tokens for s in out.scheduled if s.request is long]
    # planned to 90 ms: 20 ms + 10 decodes x 2 ms leaves 50 ms, 50 prompt tokens at 1 ms
    assert prompt == [50]


def test_untargeted_long_prompt_takes_the_whole_budget():
    sched = make_sched(budget=512, max_seqs=64, short_steps=False)
    sched.cost.set(0.020, 0.001, 0.002, 0.0)
    _workload(sched, 10, 4, 50)
    while any(r.num_output_tokens == 0 for r in sched.running) or sched.waiting:
        step(sched)
    long = make_req(1000, 4)
    sched.add_request(long)
    out = step(sched)
    assert [s.num_new_tokens for s in out.scheduled if s.request is long] == [502]


def test_predicted_ttft_counts_the_prompt_work_ahead_and_the_wait_for_seats():
    sched = make_sched(budget=100, max_seqs=3, short_steps=False)
    assert sched.ttft.predict(50, 8) is None  # no model yet
    sched.cost.set(0.0, 0.001, 0.0, 0.0)  # 1 ms per prompt token, nothing else
    assert sched.ttft.predict(50, 8) == pytest.approx(0.050)
    assert sched.ttft.predict(250, 8) == pytest.approx(0.250)  # three steps' worth
    _workload(sched, 2, 300, 4)  # a seat is left for it, behind 600 prompt tokens
    assert sched.ttft.predict(50, 8) == pytest.approx(0.650)
    # two more waiting: it would wait for seats, and no request has left yet; they are
    # waiting, not running, so nothing is known to leave: no wait for a seat is predicted
    _workload(sched, 2, 10, 4)
    assert sched.ttft.predict(50, 8) == pytest.approx(0.670)
    now = 1000.0
    sched.ttft.left.extend([now - 10, now - 5, now])  # 2 left in 10 s: a seat per 5 s
    # 2 ahead beyond the 3 seats (4 waiting + it - 3) x 5 s, then its 50 ms
    assert sched.ttft.predict(50, 8, now) == pytest.approx(2 * 5 + 0.05)
    sched.ttft.left.clear()
    sched.ttft.left.extend([now - 0.1, now - 0.05, now])  # a seat per 50 ms: tokens bind
    assert sched.ttft.predict(50, 8, now) == pytest.approx(0.670)


def test_before_any_request_left_the_wait_for_a_seat_follows_the_running_outputs():
    """No leave rate yet (the first requests of a run): the seats free as the running
    requests' max_tokens run out, a planned step (90% of the ITL target) per token."""
    sched = make_sched(budget=100, max_seqs=3, short_steps=False, itl_ms=100)
    sched.cost.set(0.0, 0.0001, 0.0001, 0.0)  # cheap: the target is feasible
    for out_len in (10, 30, 20):
        sched.add_request(make_req(4, out_len))
    step(sched)  # all three run, and each has its first token: 9, 29 and 19 to go
    assert len(sched.running) == 3 and not sched.waiting
    assert sched.ttft.drain_wait(1) == pytest.approx(0.09 * 9)
    assert sched.ttft.drain_wait(2) == pytest.approx(0.09 * 19)
    assert sched.ttft.drain_wait(4) == pytest.approx(0.09 * (9 + 29))  # a second round
    sched.add_request(make_req(4, 8))  # one waiting: a new request is second in line
    wait = sched.ttft.predict(4, 8)
    assert wait is not None and wait >= 0.09 * 19


def test_predicted_ttft_is_scaled_by_how_the_last_predictions_turned_out():
    """Each request's TTFT predicted on arrival is compared with its measured one; the
    median ratio of the last ones (at least 4, kept within [1, 8]) scales later
    predictions, so shedding tightens when the model has been optimistic."""
    sched = make_sched(budget=100, max_seqs=8, short_steps=False, ttft_ms=1000)
    sched.cost.set(0.0, 0.001, 0.0, 0.0)  # 1 ms per prompt token
    base = sched.ttft.predict(50, 8)
    assert base == pytest.approx(0.050) and sched.ttft.calibration == 1.0

    def served(ratio: float) -> None:
        req = make_req(50)
        sched.add_request(req)
        predicted = sched.ttft.predicted[req.request_id]
        sched.ttft.on_first_token(req, req.arrival_time + ratio * predicted)
        sched.waiting.remove(req)

    for ratio in (3.0, 2.0, 3.0):
        served(ratio)
    assert sched.ttft.calibration == 1.0  # 3 samples: too few to judge
    served(4.0)
    assert sched.ttft.calibration == pytest.approx(3.0)  # median of 2, 3, 3, 4
    assert sched.ttft.predict(50, 8) == pytest.approx(3.0 * base)
    for _ in range(32):
        served(20.0)
    assert sched.ttft.calibration == 8.0  # the window forgot the rest; capped
    for _ in range(32):
        served(0.5)
    assert sched.ttft.calibration == 1.0  # never more optimistic than the model
    req = make_req(50)
    sched.add_request(req)
    sched.finish(req, RequestStatus.FINISHED_ABORTED)  # no first token: no sample
    assert req.request_id not in sched.ttft.predicted
    no_target = make_sched(budget=100, short_steps=False)
    no_target.cost.set(0.0, 0.001, 0.0, 0.0)
    no_target.add_request(make_req(50))
    assert not no_target.ttft.predicted  # predictions are kept only under a TTFT target


def _output(rid: str, ttft: float, tpot: float | None, reason: str = "stop") -> RequestOutput:
    n = 1 if tpot is None else 5
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=ttft,
                       finished_time=ttft + (tpot or 0.0) * (n - 1), num_preemptions=0,
                       num_prompt_tokens=4, num_generation_tokens=n)
    c = CompletionOutput(0, "", list(range(n)), reason, num_output_tokens=n)
    return RequestOutput(rid, None, [1, 2, 3, 4], [c], True, m)


def test_goodput_counts_finished_requests_by_the_target_missed():
    metrics = EngineMetrics("m", targets=LatencyTargets(ttft_s=1.0, itl_s=0.1))
    for i, (ttft, tpot) in enumerate([(0.5, 0.05), (0.9, None), (2.0, 0.05), (0.5, 0.2),
                                      (3.0, 0.3)]):
        metrics.observe_output(_output(f"g{i}", ttft, tpot), now=100.0)
    metrics.observe_output(_output("aborted", 0.1, 0.01, "abort"), now=100.0)
    slo = metrics.dashboard(now=101.0)["slo"]
    assert slo == {"target_ttft_ms": 1000.0, "target_itl_ms": 100.0, "good": 2,
                   "missed_ttft": 1, "missed_itl": 1, "missed_both": 1,
                   "goodput_per_s": 0.2}
    text = metrics.registry.get_sample_value(
        "kvserve:goodput_requests_total", {"model_name": "m", "missed": "none"})
    assert text == 2
    assert EngineMetrics("m").dashboard()["slo"] is None
    assert LatencyTargets(ttft_s=1.0).missed(0.5, 99.0) == "none"  # ITL not targeted


def test_before_any_fit_a_target_admits_one_prompt_at_a_time():
    """No fit yet (no calibration, fewer than min_samples steps): never admission as if
    there were no target. One prompt at a time, and UNSURE_PROMPT_TOKENS of prompt work in a
    step with decodes."""
    sched = make_sched(budget=256, max_seqs=32, itl_ms=100.0, short_steps=False)
    assert sched.sizing() == "unsure"
    first = make_req(100, 50)
    sched.add_request(first)
    _workload(sched, 3, 100, 50)
    out = step(sched)
    assert plan(out) == [(first.request_id, 100, True)]  # alone: a whole-budget step
    out = step(sched)  # first decodes; the next prompt joins with a limited chunk
    assert [(s.num_new_tokens, s.prefill) for s in out.scheduled] == [
        (1, False), (UNSURE_PROMPT_TOKENS, True)]
    assert len(sched.running) == 2  # still one prompt at a time


def test_drift_scales_predictions_and_is_taken_into_the_fit():
    """A machine twice as slow: after a few steps predictions double (drift), and a refit
    takes it in with the fit's shape intact instead of blaming what the later steps held."""
    model = StepTimeModel(min_samples=16, refit=8)
    rng = random.Random(1)

    def run(n: int, slow: float) -> None:
        for _ in range(n):
            shape = StepShape(rng.choice([0, 32, 128]), rng.randint(1, 16), 0)
            model.observe(shape, slow * float(np.dot(COEF, shape.features())))

    run(64, 1.0)
    probe = StepShape(64, 8, 0)
    truth = float(np.dot(COEF, probe.features()))
    assert model.predict(probe) == pytest.approx(truth, rel=0.01)
    run(5, 2.0)
    assert model.drift == pytest.approx(2.0) and model.predict(probe) == pytest.approx(
        2 * truth, rel=0.01)
    run(3, 2.0)  # the eighth observation refits, with the older steps scaled by 2
    assert model.drift == 1.0
    np.testing.assert_allclose(model.coef[:3], 2 * np.array(COEF[:3]), rtol=0.01)
