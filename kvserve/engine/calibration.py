"""The start-up calibration of an engine core's step cost model: a few short requests run
through the engine's own steps (or their steps replayed from the start-up cache, checked by a
step now), the fit that sizes steps under the ITL target, and the default step budget set
from it. EngineCore runs it once, before the first request."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import torch

from kvserve import faults, kernels
from kvserve.engine.calibration_cache import CalibrationCache, agrees
from kvserve.kernels import build_spec
from kvserve.models.weight_cache import code_versions
from kvserve.request import Request
from kvserve.sample.sampling_params import SamplingParams
from kvserve.sched.scheduler import MIN_PROMPT_TOKENS, Scheduler
from kvserve.sched.slo import TARGET_MARGIN, StepShape, StepTimeModel, default_itl_budget

log = logging.getLogger("kvserve.engine.core")  # its lines are the core's start-up report


# The start-up calibration's workload (EngineCore.calibrate): a warm-up request whose steps
# are not kept (the first steps touch every weight's pages), then CALIBRATION_ROWS requests of
# CALIBRATION_PROMPT tokens admitted together with outputs of 2, 3, ... tokens: a step of
# prompt work, then decode steps of CALIBRATION_ROWS rows down to one. They tell the fixed
# cost, a prompt token and a decode row apart, on the shapes the scheduler asks about, with
# little prompt work (the step that costs most on a slow machine).
CALIBRATION_ROWS = 4
# Prompt tokens of each measured request; the warm-up's prompt is CALIBRATION_WARMUP_PROMPT
# (any step touches every weight). The prompt step is the calibration's dearest on a slow
# machine (a 1B model on 2 AVX2 cores), so its prompts are as short as a fit allows.
CALIBRATION_PROMPT = 4
CALIBRATION_WARMUP_PROMPT = 1


def calibration_requests(vocab_size: int) -> tuple[Request, list[Request]]:
    """The warm-up request and the measured ones (see CALIBRATION_ROWS)."""

    def req(i: int, prompt: int, out: int) -> Request:
        ids = [(7919 * (i * 64 + k) + 1) % vocab_size for k in range(prompt)]
        sp = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        return Request(f"calibration-{i}", ids, sp, frozenset(), out)

    return req(0, CALIBRATION_WARMUP_PROMPT, 2), [req(i + 1, CALIBRATION_PROMPT, i + 2)
                                           for i in range(CALIBRATION_ROWS)]


class StartupCalibration:
    """EngineCore's start-up calibration, as its methods: they read and reset the core's
    parts (scheduler, KV cache, step records) and run its own steps, so EngineCore sets the
    attributes below and its parts before it calls `calibrate`."""

    scheduler: Scheduler
    calibration_seconds: float | None
    calibration_kept: bool
    itl_budget_default: bool

    def calibrate(self) -> float:
        """Seed the step cost model before the first request (CALIBRATION_ROWS,
        above): run the calibration requests through the engine's own steps, fit
        the model on every step but the warm-up's, and forget they ran. Returns seconds."""
        t0 = time.perf_counter()
        warmup, measured = calibration_requests(self.vocab_size)
        saved = faults.install(None)  # a test's injected faults are for its own requests
        # Its blocks are neither looked up nor hashed: nothing of it is kept in the prefix
        # cache or written to its tiers. Its steps are the token budget's, whatever the
        # targets (with no fit, a target would admit one prompt at a time).
        caching, self.kv.enable_prefix_caching = self.kv.enable_prefix_caching, False
        sched = self.scheduler
        config = sched.config
        sched.config = dataclasses.replace(config, target_itl_s=None, shed_late_requests=False)
        cache = self._calibration_cache()
        try:
            self.add_request(warmup)
            self._run_to_end()
            (probe, seconds), = self.scheduler.cost.samples[-1:]  # the warm-up's last step
            self.scheduler.cost = cost = StepTimeModel()
            kept = cache.load() if cache is not None else None
            if kept is not None:
                check = StepTimeModel()
                check.add_samples(kept)
                check.fit_now()
                predicted = check.predict_features(probe)
                if agrees(seconds, predicted):
                    cost.add_samples(kept)
                else:
                    log.info("step cost: the steps kept in the start-up cache predict %.1f ms "
                             "for a step measured at %.1f ms now; calibrating anew",
                             1e3 * (predicted or 0.0), 1e3 * seconds)
                    kept = None
            self.calibration_kept = kept is not None
            if kept is None:
                for req in measured:
                    self.add_request(req)
                self._run_to_end()
                if cache is not None:
                    cache.save(cost.samples)
        finally:
            faults.install(saved)
            self.kv.enable_prefix_caching = caching
            sched.config = config
        cost.fit_now()
        sched.forget_history()
        self.kv.stats.queries = 0
        self.kv.stats.hits.clear()
        self.steps.clear()
        self._num_steps = 0
        seconds = time.perf_counter() - t0
        self.calibration_seconds = seconds
        return seconds

    def _calibration_cache(self) -> CalibrationCache | None:
        """Where this engine's calibration is kept: its model and what the engine was asked
        for that changes a step's time, on this machine (kernels, threads, CPU)."""
        if self.workers is not None or self.config.device.type != "cpu":
            return None  # other ranks' and devices' times are not this process's to judge
        c = self.config
        setting = {"dtype": str(c.dtype), "quantization": self.quantization,
                   "kv_cache_dtype": c.cache.kv_cache_dtype, "block_size": c.cache.block_size,
                   "speculative": self._speculative_config}
        machine = {"kernels": kernels.loaded_build_id(), "cpu": build_spec.cpu_tag(),
                   "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                   "torch": torch.__version__, "layers": code_versions()["code"]}
        return CalibrationCache.at(Path(c.model), setting, machine)

    def _resolve_itl_budget(self) -> None:
        """Set the default step budget (kvserve.sched.slo.default_itl_budget) from the calibrated
        model, and log what the model predicts and what the ITL target allows a step."""
        sched, cost = self.scheduler, self.scheduler.cost
        if self.itl_budget_default:
            config = dataclasses.replace(sched.config, target_itl_s=default_itl_budget(cost),
                                         itl_admission=False)
            sched.config = config
            self.config = dataclasses.replace(self.config, scheduler=config)
        c = cost.coef
        assert c is not None
        assert self.calibration_seconds is not None
        log.info("step cost calibrated in %.2f s%s: fixed %.1f ms, a prompt token %.2f ms, a "
                 "decode row %.2f ms, 1k attended pairs %.3f ms", self.calibration_seconds,
                 " (the steps kept in the start-up cache, checked by a step now)"
                 if self.calibration_kept else "",
                 1e3 * c[0], 1e3 * c[1], 1e3 * c[2], 1e3 * c[3])
        target = sched.config.target_itl_s
        if target is None:
            return
        how = "default" if self.itl_budget_default else "--target-itl-ms"
        if sched.sizing() == "infeasible":
            log.warning(self.itl_warning())
            return
        budget = sched.config.max_num_batched_tokens
        prompt = cost.max_prefill(StepShape(0, 1, 1), TARGET_MARGIN * target, budget, 0)
        if not sched.config.itl_admission:
            log.info("ITL target %.0f ms (default; --target-itl-ms 0: off): a step with a "
                     "decode holds up to %d prompt tokens (of the %d-token budget); steps of "
                     "prompts alone take the whole budget, admission is not limited",
                     1e3 * target, prompt, budget)
            return
        rows = next((n for n in range(1, sched.config.max_num_seqs + 1) if cost.predict(
            StepShape(MIN_PROMPT_TOKENS, n + 1, 0)) > TARGET_MARGIN * target),  # type: ignore
                    sched.config.max_num_seqs)
        log.info("ITL target %.0f ms (%s; --target-itl-ms 0: off): a step with decodes holds "
                 "up to %d decode rows, or one row and %d prompt tokens (of the %d-token "
                 "budget); steps of prompts alone take the whole budget", 1e3 * target, how,
                 rows, prompt, budget)

    def itl_warning(self) -> str | None:
        """Why the ITL target cannot be met, when the model predicts that it cannot."""
        sched = self.scheduler
        target = sched.config.target_itl_s
        if target is None or sched.sizing() != "infeasible":
            return None
        one = sched.cost.predict(StepShape(MIN_PROMPT_TOKENS, 1, MIN_PROMPT_TOKENS + 1))
        assert one is not None
        return (f"ITL target {1e3 * target:.0f} ms is infeasible here: one decode row with "
                f"{MIN_PROMPT_TOKENS} prompt tokens is predicted to take {1e3 * one:.0f} ms "
                f"(planned to {100 * TARGET_MARGIN:.0f}% of the target); " +
                ("requests run one at a time" if sched.config.itl_admission else
                 f"prompts progress by {MIN_PROMPT_TOKENS} tokens a step beside decodes"))
