"""Time to first token, predicted for a request queued now: the step cost model (slo) applied
to the prompt work ahead and the wait for a seat, scaled by how the last requests' predictions
turned out. The scheduler keeps one and tells it of arrivals, first tokens and departures;
`--shed-late-requests` refuses what it predicts late, and the server's 429 quotes it."""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import TYPE_CHECKING

from kvserve.request import Request
from kvserve.sched.slo import TARGET_MARGIN, StepShape, prompt_attended

if TYPE_CHECKING:
    from kvserve.sched.scheduler import Scheduler

# Requests leaving the batch per second are measured over this many seconds, for the
# predicted wait for a seat.
LEAVE_RATE_WINDOW = 30.0
# Predicted TTFTs are scaled by the median ratio of measured to predicted TTFT of the last
# this many requests that got a first token (from their prediction on arrival), kept within
# [1, TTFT_CALIBRATION_MAX]: queueing the model does not see (requests admitted together,
# steps over plan) makes it optimistic, and shedding on an optimistic prediction admits
# requests that then miss the target.
TTFT_CALIBRATION_WINDOW = 32
TTFT_CALIBRATION_MIN_SAMPLES = 4
TTFT_CALIBRATION_MAX = 8.0


class TTFTPredictor:
    """One scheduler's TTFT predictions: what it reads of the scheduler (its queues, seats,
    step sizing and cost model) it reads live, when asked."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.left: deque[float] = deque(maxlen=512)  # times requests left the batch
        self.predicted: dict[str, float] = {}  # request id -> uncalibrated TTFT on arrival
        self.ratios: deque[float] = deque(maxlen=TTFT_CALIBRATION_WINDOW)

    def on_arrival(self, req: Request) -> None:
        """Keep `req`'s prediction on arrival, to compare with its first token."""
        predicted = self.uncalibrated(req.num_prompt_tokens, req.max_tokens)
        if predicted is not None and predicted > 0:
            self.predicted[req.request_id] = predicted

    def on_first_token(self, req: Request, now: float) -> None:
        """A request's first token came at `now`: how far off its predicted TTFT was."""
        predicted = self.predicted.pop(req.request_id, None)
        if predicted is not None:
            self.ratios.append((now - req.arrival_time) / predicted)

    @property
    def calibration(self) -> float:
        """The factor predicted TTFTs are scaled by (see TTFT_CALIBRATION_WINDOW)."""
        if len(self.ratios) < TTFT_CALIBRATION_MIN_SAMPLES:
            return 1.0
        ratios = sorted(self.ratios)
        mid = len(ratios) // 2
        median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
        return min(max(median, 1.0), TTFT_CALIBRATION_MAX)

    def on_leave(self, now: float) -> None:
        """A running request left the batch at `now` (its seat is free)."""
        self.left.append(now)

    def forget(self, req: Request) -> None:
        """`req` will get no first token here (finished, aborted, refused)."""
        self.predicted.pop(req.request_id, None)

    def forget_history(self) -> None:
        """Forget departures and how past predictions turned out (the start-up calibration's)."""
        self.left.clear()
        self.ratios.clear()

    def predict(self, num_tokens: int, max_tokens: int, now: float | None = None,
                       position: int | None = None) -> float | None:
        """Seconds from now to the first token of a request of `num_tokens` prompt tokens
        (and `max_tokens`) if it were queued now (or were at `position` in the queue):
        `uncalibrated`, scaled by how the last requests' predictions compared with their
        measured TTFTs (`calibration`)."""
        predicted = self.uncalibrated(num_tokens, max_tokens, now, position)
        return None if predicted is None else predicted * self.calibration

    def uncalibrated(self, num_tokens: int, max_tokens: int, now: float | None = None,
                      position: int | None = None) -> float | None:
        """The model's TTFT for a request queued now, behind the whole queue or the first
        `position` requests of it. Whichever bound binds:
        - seats: the requests ahead of it beyond the seats free now (under the ITL target,
          the seats the target allows) wait for running requests to leave, at the rate they
          left over the last LEAVE_RATE_WINDOW seconds (before two have left: when the
          running requests' remaining outputs end, drain_wait), and then it computes its
          prompt;
        - prompt throughput: the prompt tokens ahead of it (waiting, and running prompts'
          rest) and its own, at the rate the step sizing gives prompts.
        None while the step cost model is not fitted."""
        s = self.scheduler
        if s.cost.coef is None:
            return None
        now = time.perf_counter() if now is None else now
        while self.left and self.left[0] < now - LEAVE_RATE_WINDOW:
            self.left.popleft()
        free = s._seats()
        sizing = s.sizing() if s.config.itl_admission else "off"
        if sizing == "fit":
            free = next((n for n in range(free)
                         if not s._fits_target(num_tokens, max_tokens, n)), free)
        elif sizing == "infeasible":
            free = min(free, 0 if s.running else 1)
        queue = list(s.waiting) if position is None else list(s.waiting)[:position]
        ahead = len(queue) + 1 - free
        seat_wait = 0.0
        if ahead > 0 and len(self.left) >= 2:
            span = max(now - self.left[0], 1e-3)
            seat_wait = ahead * span / (len(self.left) - 1)
        elif ahead > 0:
            seat_wait = self.drain_wait(ahead)
        gaps = (r.num_tokens - r.num_computed_tokens
                for r in itertools.chain(queue, s.running))
        ahead_tokens = sum(g for g in gaps if g > 1)
        return max(seat_wait + self.prompt_seconds(num_tokens),
                   self.prompt_seconds(ahead_tokens + num_tokens))

    def drain_wait(self, ahead: int) -> float:
        """Seconds until the `ahead`-th seat frees if running requests leave when their
        max_tokens run out, a step per token (at the ITL target's planned step under a
        feasible target, else the running batch's predicted decode step), and each request
        admitted into a freed seat in turn runs as long as the longest of them."""
        s = self.scheduler
        if not s.running:
            return 0.0
        left = sorted(max(r.max_tokens - r.num_output_tokens, 1) for r in s.running)
        target = s.config.target_itl_s
        if target is not None and s._target_feasible():
            step = TARGET_MARGIN * target
        else:
            context = sum(r.num_tokens for r in s.running)
            step = s.cost.predict(StepShape(0, len(s.running), context)) or 0.0
        rounds, index = divmod(ahead - 1, len(left))
        return step * (left[index] + rounds * left[-1])

    def prompt_seconds(self, tokens: int) -> float:
        """Predicted seconds to compute `tokens` prompt tokens: in steps of the last targeted
        allowance at the ITL target while requests decode, else in whole-budget steps."""
        s = self.scheduler
        target = s.config.target_itl_s
        if target is not None and s.running and s.prompt_allowance:
            return -(-tokens // s.prompt_allowance) * TARGET_MARGIN * target
        budget = s.config.max_num_batched_tokens
        steps, rest = divmod(tokens, budget)
        full = s.cost.predict(StepShape(budget, 0, prompt_attended(0, budget)))
        last = s.cost.predict(StepShape(rest, 0, prompt_attended(0, rest))) if rest else 0.0
        assert full is not None and last is not None
        return steps * full + last
