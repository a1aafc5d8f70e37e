"""The step-time budget and latency targets on a whole engine core (the tiny random model),
under a fake clock: time stands still but for each model step, which advances it by an
injected cost of the step's shape (a slow CPU's), so the start-up calibration, the step
sizing, admission, shedding and recovery all see that machine, quickly and exactly."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kvserve.engine.args import EngineArgs
from kvserve.engine.core import EngineCore
from kvserve.engine.startup import create_config
from kvserve.outputs import LATE_REFUSAL
from kvserve.request import Request
from kvserve.sample.sampling_params import SamplingParams
from kvserve.sched.scheduler import OVERRUN_STEPS
from kvserve.sched.slo import DEFAULT_ITL_BUDGET_S, DRIFT_MIN_SAMPLES, TARGET_MARGIN, StepShape
from kvserve.worker.model_runner import ModelRunner


def slow_cpu(shape: StepShape) -> float:
    """About the real Qwen2.5-Coder-1.5B Q4_K_M on 2 AVX2 cores: 70 ms a step, 12 ms a
    prompt token, 3 ms a decode row."""
    return 0.070 + 0.012 * shape.prefill_tokens + 0.003 * shape.decode_rows


@dataclass
class Machine:
    """The fake clock, and the cost each model step adds to it (times `slowdown`)."""

    cost: Callable[[StepShape], float]
    now: float = 1000.0
    slowdown: float = 1.0


@pytest.fixture
def machine(monkeypatch) -> Machine:
    m = Machine(slow_cpu)
    monkeypatch.setattr(time, "perf_counter", lambda: m.now)
    execute = ModelRunner.execute

    def timed(self, sched):
        out = execute(self, sched)
        m.now += m.cost(sched.shape) * m.slowdown
        return out

    monkeypatch.setattr(ModelRunner, "execute", timed)
    return m


_ids = itertools.count()


@dataclass
class Served:
    """What a client of one request saw: its token times, refusal or tokens."""

    req: Request
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    refused: str | None = None

    @property
    def ttft(self) -> float:
        return self.times[0] - self.req.arrival_time

    @property
    def max_gap(self) -> float:
        return max((b - a for a, b in itertools.pairwise(self.times)), default=0.0)


def engine(path, **kw) -> EngineCore:
    return EngineCore(create_config(EngineArgs(model=str(path), dtype="float32", block_size=4,
                                               num_kv_blocks=2048, **kw)))


def serve(core: EngineCore, m: Machine, arrivals: list[tuple[float, int, int]],
          shed: bool = False, on_step: Callable[[], None] | None = None) -> list[Served]:
    """Run `arrivals` (time after now, prompt tokens, output tokens) to the end, adding each
    when the clock reaches it (refused at once, as the server does with
    --shed-late-requests, when its predicted TTFT is over the target)."""
    start = m.now
    pending = sorted((at, i, prompt, out) for i, (at, prompt, out) in enumerate(arrivals))
    served: dict[str, Served] = {}
    ttft_target = core.config.scheduler.target_ttft_s
    while pending or core.has_unfinished_requests():
        while pending and start + pending[0][0] <= m.now:
            _, i, prompt, out = pending.pop(0)
            req = Request(f"r{next(_ids)}", [(i * 31 + k) % 300 + 10 for k in range(prompt)],
                          SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True),
                          frozenset(), out, arrival_time=m.now)
            s = served[req.request_id] = Served(req)
            predicted = core.predicted_ttft(prompt, out)
            if shed and ttft_target and predicted is not None and predicted > ttft_target:
                s.refused = "on arrival"
                continue
            core.add_request(req)
        if not core.has_unfinished_requests():
            m.now = start + pending[0][0]
            continue
        for o in core.step():
            s = served[o.request_id]
            if o.error is not None:
                assert o.error == LATE_REFUSAL
                s.refused = "queued"
            s.times += [m.now] * len(o.new_token_ids)
            s.tokens += o.new_token_ids
        core.record_step()
        core.check_integrity()
        if on_step is not None:
            on_step()
    return list(served.values())


@pytest.mark.slow
def test_default_budget_keeps_streams_flowing_beside_a_long_prompt(tiny_llama_dir, machine):
    """Four streams, then a long prompt: with default flags no step that carries a decode
    exceeds the default budget, and the long prompt finishes; with the budget off (the old
    default) one step computes the whole prompt and the streams stall for seconds. The
    tokens are the same either way: chunking never changes them."""
    arrivals = [(0.0, 8, 100)] * 4 + [(1.0, 400, 4)]
    core = engine(tiny_llama_dir)
    assert core.config.scheduler.target_itl_s == DEFAULT_ITL_BUDGET_S
    budgeted = serve(core, machine, arrivals)
    decode_steps = [s for s in core.steps if s.decode_tokens]
    assert decode_steps and max(s.total for s in decode_steps) <= DEFAULT_ITL_BUDGET_S
    streams, long = budgeted[:4], budgeted[4]
    assert len(long.tokens) == 4 and all(len(s.tokens) == 100 for s in streams)
    assert max(s.max_gap for s in streams) <= DEFAULT_ITL_BUDGET_S
    # the prompt ran in several chunks beside the decodes, not in one 4.8 s step
    assert sum(1 for s in core.steps if s.prefill_tokens and s.decode_tokens) >= 5

    off = engine(tiny_llama_dir, target_itl_ms=0)
    assert off.config.scheduler.target_itl_s is None
    plain = serve(off, machine, arrivals)
    assert max(s.max_gap for s in plain[:4]) > 4.0
    assert [s.tokens for s in plain] == [s.tokens for s in budgeted]
    # the long prompt's chunks pay the fixed cost again each step while the streams run
    assert long.ttft <= 1.25 * plain[4].ttft


def peak_running(core: EngineCore) -> tuple[Callable[[], None], Callable[[], int]]:
    """(a `serve` on_step callback, the most requests it saw running at once)."""
    peak = [0]

    def watch() -> None:
        peak[0] = max(peak[0], len(core.scheduler.running))

    return watch, lambda: peak[0]


def allowed_rows(core: EngineCore, prompt_share: int) -> int:
    """The most requests a step of their decodes and `prompt_share` prompt tokens fits in
    the planned ITL target, by the injected cost itself."""
    plan = TARGET_MARGIN * core.config.scheduler.target_itl_s
    return max(n for n in range(1, 65) if slow_cpu(StepShape(prompt_share, n)) <= plan)


def test_cold_engine_under_an_overload_burst_admits_what_the_targets_allow(
        tiny_llama_dir, machine):
    """A fresh engine with targets (the calibration is its only history) gets 16 requests in
    its first second, about twice what it can serve: it admits no more than the ITL target
    allows, refuses those predicted to miss the TTFT target, and the ones it serves meet
    both targets."""
    ttft, itl = 6.0, 0.150
    core = engine(tiny_llama_dir, target_ttft_ms=1e3 * ttft, target_itl_ms=1e3 * itl,
                  shed_late_requests=True)
    assert core.scheduler.sizing() == "fit" and core.scheduler.cost.calibrated
    # the calibration measured this machine, on its first steps: fixed, token, row
    assert core.scheduler.cost.coef[:3] == pytest.approx((0.070, 0.012, 0.003), rel=0.02)
    assert core.stats().num_steps == 0 and core.scheduler.num_preemptions == 0
    watch, most = peak_running(core)
    served = serve(core, machine, [(i / 16, 32, 32) for i in range(16)], shed=True,
                   on_step=watch)
    refused = [s for s in served if s.refused]
    good = [s for s in served if not s.refused]
    assert refused and len(good) >= 3
    assert most() <= allowed_rows(core, 4)
    for s in good:
        assert len(s.tokens) == 32
        assert s.ttft <= ttft and s.max_gap <= itl, (s.ttft, s.max_gap)


@pytest.mark.slow
def test_a_machine_that_slows_down_halfway_shrinks_the_batch_back(tiny_llama_dir, machine):
    """Requests arrive steadily; halfway the machine turns 2x slower (a neighbour's load).
    Within a bounded number of steps the batch is cut back to what the ITL target allows
    (the step records say what was done) and steps with decodes are back within it."""
    itl = 0.400
    core = engine(tiny_llama_dir, target_itl_ms=1e3 * itl, step_buffer_size=10_000)
    arrivals = [(i * 0.25, 16, 60) for i in range(40)]
    slow_at = 5.0
    start = machine.now
    marks: list[tuple[float, int]] = []  # (clock, step number) once slow

    def slow() -> None:
        if machine.slowdown == 1.0 and machine.now - start >= slow_at:
            machine.slowdown = 2.0
        if machine.slowdown > 1.0:
            marks.append((machine.now, core.stats().num_steps))

    served = serve(core, machine, arrivals, on_step=slow)
    assert all(len(s.tokens) == 60 for s in served)
    first = marks[0][1]
    after = [s for s in core.steps if s.step > first and s.decode_tokens]
    over = [s.step for s in after if s.total > itl]
    assert over, "the slowdown should show"
    # drift sees it after DRIFT_MIN_SAMPLES steps, recovery after OVERRUN_STEPS: then the
    # batch is within the target again, and stays there
    bound = first + OVERRUN_STEPS + DRIFT_MIN_SAMPLES + 4
    assert max(over) <= bound, (over, bound)
    assert sum(s.preempted + s.requeued for s in core.steps if s.step > first) > 0


def test_a_late_refusal_is_a_429():
    """A queued request refused as predicted to miss its TTFT target is a 429 to the client,
    like one refused on arrival; any other engine error stays a 500."""
    from kvserve.entrypoints.server.serving import failure

    assert failure(LATE_REFUSAL)[0] == 429
    assert failure("RuntimeError: boom") == (500, "request failed: RuntimeError: boom")


def test_an_infeasible_target_says_so_and_serves_within_the_ttft_target(
        tiny_llama_dir, machine, caplog):
    """One decode row alone (73 ms) is over a 50 ms target: the engine warns at start-up and
    in its stats, runs one request at a time (the shortest gaps this machine has), and with
    shedding, the requests it serves still meet the TTFT target."""
    import logging

    with caplog.at_level(logging.WARNING, logger="kvserve.engine.core"):
        core = engine(tiny_llama_dir, target_ttft_ms=3000, target_itl_ms=50,
                      shed_late_requests=True)
    assert any("infeasible" in r.getMessage() for r in caplog.records)
    budget = core.stats().as_json()["step_budget"]
    assert budget["sizing"] == "infeasible" and "infeasible" in budget["warning"]
    watch, most = peak_running(core)
    served = serve(core, machine, [(i / 8, 32, 16) for i in range(8)], shed=True,
                   on_step=watch)
    good = [s for s in served if not s.refused]
    assert most() == 1 and good and len(good) < len(served)
    assert all(s.ttft <= 3.0 and len(s.tokens) == 16 for s in good)


def test_default_budget_never_limits_admission(tiny_llama_dir, machine):
    """The default budget sizes prompt work beside decodes and nothing else: on a machine
    where a decode row costs about what a prompt token does (the real 1.5B on 2 cores: ~25 ms
    each), 16 requests at once all decode together, though their steps run over the budget,
    and none is sent back or preempted; an explicit --target-itl-ms of the same figure does
    limit them."""
    machine.cost = lambda s: 0.070 + 0.025 * (s.prefill_tokens + s.decode_rows)
    arrivals = [(0.0, 8, 30)] * 16
    most = {}
    for name, kw in (("default", {}), ("target", {"target_itl_ms": 500})):
        core = engine(tiny_llama_dir, **kw)
        assert core.config.scheduler.itl_admission == (name == "target")
        watch, peak = peak_running(core)
        served = serve(core, machine, arrivals, on_step=watch)
        assert all(len(s.tokens) == 30 for s in served)
        most[name] = peak()
        if name == "default":
            assert max(s.total for s in core.steps if s.decode_tokens) > DEFAULT_ITL_BUDGET_S
            assert core.scheduler.num_preemptions == 0
            assert not any(s.requeued or s.preempted for s in core.steps)
    assert most["default"] == 16 and most["target"] < 16


def test_a_restart_replays_the_calibration_kept_in_the_startup_cache(
        tiny_llama_dir, machine, monkeypatch, tmp_path, caplog):
    """With the start-up cache on, the first start's calibration steps are kept; a restart
    runs only the warm-up, whose last step agrees with them, and fits the same model from
    them. A machine now 2x slower disagrees: the restart calibrates anew (and replaces the
    entry), as it does over a damaged entry."""
    caplog.set_level(logging.INFO, logger="kvserve")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVSERVE_NO_WEIGHT_CACHE", "0")
    first = engine(tiny_llama_dir)
    assert not first.calibration_kept and first.scheduler.cost.calibrated
    (entry,) = (tmp_path / "calibration").glob("*.json")
    start = machine.now
    again = engine(tiny_llama_dir)
    warmup_only = machine.now - start
    assert again.calibration_kept and again.scheduler.cost.calibrated
    assert list(again.scheduler.cost.coef) == list(first.scheduler.cost.coef)
    assert again.itl_budget_default and again.config.scheduler.target_itl_s == \
        first.config.scheduler.target_itl_s
    start = machine.now
    machine.slowdown = 2.0
    slower = engine(tiny_llama_dir)
    assert not slower.calibration_kept
    assert machine.now - start > 2 * 2 * warmup_only  # the measured steps ran too
    assert slower.scheduler.cost.coef[:3] == pytest.approx(
        2 * first.scheduler.cost.coef[:3], rel=0.02)
    assert "calibrating anew" in caplog.text
    (replaced,) = (tmp_path / "calibration").glob("*.json")
    assert replaced == entry and engine(tiny_llama_dir).calibration_kept  # still 2x slow
    entry.write_text('{"header": {}, "steps": []}\n')
    caplog.clear()
    damaged = engine(tiny_llama_dir)
    assert not damaged.calibration_kept and "is unusable" in caplog.text
    machine.slowdown = 1.0
    other = engine(tiny_llama_dir, kv_cache_dtype="int8")  # another setting: another entry
    assert not other.calibration_kept
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 2
