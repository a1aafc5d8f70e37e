"""Latency targets: a model of what a step costs, fitted online from the steps that ran.

A step's time is modelled as linear in what it computes:

    seconds = c0 + c1 * prefill_tokens + c2 * decode_rows + c3 * attended / 1024

- c0, the fixed part: reading every weight once (memory-bound), launching the step;
- c1, each prompt (or recompute) token: its matmul rows, compute-bound;
- c2, each decode row (drafts included): a matmul row and its sampling;
- c3, attention: the (query, key) pairs the step's queries attend to, in thousands.

The coefficients come from a least-squares fit over the last `window` steps the engine
recorded, constrained to be non-negative (a negative cost would let the scheduler buy time by
adding work). The fit is what the scheduler asks when it sizes a step's prompt work under
`--target-itl-ms` (see `Scheduler.schedule`), so it follows this machine and this model, their
load and their noise. A server seeds it before it reports healthy with a short calibration
(`EngineCore.calibrate`: a few steps of the shapes the scheduler asks about), so the targets
hold from the first request. A window of 512 steps is slow to follow a machine that slows
down (a neighbour's load), and a fit over steps from before and after would blame the
slowdown on whatever the later steps held more of. So predictions are the fit times a drift
factor, the median of measured / fitted time over the last DRIFT_WINDOW steps; when it is
off by more than DRIFT_REBASE at a refit (or the scheduler sees steps over its target), the
older steps are scaled by it (`rebase`), as if they had run on the machine as it is now.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

_ATTN_UNIT = 1024.0  # attended pairs per unit of c3, so the four coefficients are comparable
# Steps whose measured / fitted time ratios scale predictions (StepTimeModel.drift), and its
# bounds: a few steps are enough to see a slowdown, and a median of 8 ignores one odd step.
DRIFT_WINDOW = 8
DRIFT_MIN_SAMPLES = 3
DRIFT_BOUNDS = (0.5, 8.0)
DRIFT_REBASE = 0.1
# The default step-time budget of steps that carry decodes (`--target-itl-ms` unset): 500 ms,
# a pause a reader of a stream barely notices (a long prompt beside four streams on a 2-core
# CPU: gaps near the budget instead of the whole prompt's time, for a little more TTFT,
# most of it the streams' own decoding: benchmarks/RESULTS.md); or, on a machine where one decode
# step of one request is slower than a quarter of that, four such steps, so the budget always
# leaves room for prompt work and more rows.
DEFAULT_ITL_BUDGET_S = 0.5
DEFAULT_ITL_DECODE_STEPS = 4


# Steps are planned to this share of the ITL target: what a client sees between two tokens
# also holds the server's own work between steps and the cost model's error.
TARGET_MARGIN = 0.9


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as the cost model sees it."""

    prefill_tokens: int = 0
    decode_rows: int = 0
    attended: int = 0  # (query, key) pairs over all rows

    def features(self) -> tuple[float, float, float, float]:
        return 1.0, float(self.prefill_tokens), float(self.decode_rows), \
            self.attended / _ATTN_UNIT


def prompt_attended(context: int, tokens: int) -> int:
    """(query, key) pairs of `tokens` prompt tokens computed after `context` cached ones."""
    return tokens * context + tokens * (tokens + 1) // 2


class StepTimeModel:
    """Step time as a non-negative linear function of `StepShape`, refitted every `refit`
    observations over the last `window` of them. `predict` is None until `min_samples` steps
    were seen, and the scheduler then behaves as it does with no target."""

    def __init__(self, window: int = 512, min_samples: int = 16, refit: int = 8) -> None:
        self.window, self.min_samples, self.refit = window, min_samples, refit
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.coef: np.ndarray | None = None
        self.calibrated = False  # fitted by a calibration run (fit_now), not min_samples
        self._ratios: deque[float] = deque(maxlen=DRIFT_WINDOW)  # measured / fitted

    def observe(self, shape: StepShape, seconds: float) -> None:
        fitted = self._fitted(shape)
        if fitted is not None and fitted > 0:
            self._ratios.append(seconds / fitted)
        self._x.append(shape.features())
        self._y.append(seconds)
        self._since_fit += 1
        if len(self._y) >= self.min_samples and (self.coef is None
                                                 or self._since_fit >= self.refit):
            self._fit()

    @property
    def samples(self) -> list[tuple[tuple[float, ...], float]]:
        """The steps observed within the window, oldest first: (features, seconds)."""
        return list(zip(self._x, self._y, strict=True))

    def add_samples(self, samples: list[tuple[tuple[float, ...], float]]) -> None:
        """Take steps measured before (`samples` of an earlier model, as the calibration
        cache keeps them) as if observed now; fit with fit_now."""
        for x, y in samples:
            self._x.append(tuple(x))
            self._y.append(float(y))

    def fit_now(self) -> None:
        """Fit on what was observed so far (a calibration run's steps, fewer than
        min_samples but chosen to tell the fixed cost, a prompt token and a decode row
        apart) and start predicting. Their short contexts say nothing of attention, whose
        column would only soak up noise: c3 is 0 until the online refits see longer ones."""
        if len(self._y) < 2:
            raise ValueError("a calibration needs at least two steps")
        self._since_fit = 0
        x = np.array(self._x, dtype=np.float64)[:, :3]
        self.coef = np.append(nonnegative_lstsq(x, np.array(self._y, dtype=np.float64)), 0.0)
        self.calibrated = True
        self._ratios.clear()

    def rebase(self, recent: int | None = None) -> None:
        """Take the drift into the fit: judge it by the last `recent` steps only (all of the
        window by default; the scheduler passes the steps it saw over its target), scale
        the steps before them by it, and refit; the drift starts again from 1."""
        ratios = list(self._ratios)[-(recent or DRIFT_WINDOW):]
        self._ratios.clear()
        if len(ratios) < DRIFT_MIN_SAMPLES or self.coef is None:
            return
        drift = min(max(float(np.median(ratios)), DRIFT_BOUNDS[0]), DRIFT_BOUNDS[1])
        old = len(self._y) - len(ratios)
        for i in range(old):
            self._y[i] *= drift
        self._fit()

    @property
    def drift(self) -> float:
        """The median of measured / fitted time over the last DRIFT_WINDOW steps (1 before
        DRIFT_MIN_SAMPLES of them), within DRIFT_BOUNDS."""
        if len(self._ratios) < DRIFT_MIN_SAMPLES:
            return 1.0
        return min(max(float(np.median(self._ratios)), DRIFT_BOUNDS[0]), DRIFT_BOUNDS[1])

    def _fit(self) -> None:
        if self._ratios and abs(self.drift - 1.0) > DRIFT_REBASE:
            self.rebase()  # which fits
            return
        self._since_fit = 0
        x = np.array(self._x, dtype=np.float64)
        y = np.array(self._y, dtype=np.float64)
        self.coef = nonnegative_lstsq(x, y)

    def _fitted(self, shape: StepShape) -> float | None:
        if self.coef is None:
            return None
        return float(np.dot(self.coef, shape.features()))

    def predict_features(self, x: tuple[float, ...]) -> float | None:
        """The fit's seconds for a step of features `x` (StepShape.features), no drift."""
        return None if self.coef is None else float(np.dot(self.coef, x))

    def predict(self, shape: StepShape) -> float | None:
        """Seconds `shape` is predicted to take: the fit, scaled by `drift`; None unfitted."""
        fitted = self._fitted(shape)
        return None if fitted is None else fitted * self.drift

    def set(self, c0: float, c1: float, c2: float, c3: float) -> None:
        """Fix the coefficients (seconds; c3 per 1024 attended pairs), as tests do."""
        self.coef = np.array([c0, c1, c2, c3], dtype=np.float64)
        self.min_samples = 1 << 62  # and keep them: no refit from observations
        self._ratios.clear()

    def max_prefill(self, base: StepShape, target: float, limit: int, context: int) -> int:
        """The most prompt tokens (at most `limit`) that can join `base` (the step's decodes)
        with the predicted step time within `target`; 0 when not even one fits. The prompt
        tokens are assumed to follow `context` cached tokens of one request."""
        if self.coef is None:
            return limit
        # predict()'s drift once, not a median of the window per probe: this runs every
        # decode step, and its dozen medians were ~2% of a step of the default model.
        drift = self.drift

        def fits(p: int) -> bool:
            shape = StepShape(base.prefill_tokens + p, base.decode_rows,
                              base.attended + prompt_attended(context, p))
            return self._fitted(shape) * drift <= target  # type: ignore[operator]

        lo, hi = 0, limit  # fits(lo) is assumed; find the largest p that fits
        if not fits(0):
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo


def default_itl_budget(cost: StepTimeModel) -> float:
    """The step-time budget (seconds) with no --target-itl-ms: DEFAULT_ITL_BUDGET_S, or
    DEFAULT_ITL_DECODE_STEPS predicted steps of one decode row where that is longer."""
    one_row = cost.predict(StepShape(0, 1, 1))
    return max(DEFAULT_ITL_BUDGET_S, DEFAULT_ITL_DECODE_STEPS * (one_row or 0.0))


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |x c - y| subject to c >= 0, for a handful of columns: least squares over every
    subset of columns (feasible here: 4 columns, 15 subsets), the best feasible one kept. A
    tiny ridge keeps collinear columns (steps that all look alike) from blowing up."""
    n = x.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y * y))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = x[:, cols]
            gram = sub.T @ sub + 1e-9 * np.eye(k)
            c = np.linalg.solve(gram, sub.T @ y)
            if np.any(c < 0):
                continue
            err = float(np.sum((sub @ c - y) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(n)
                best[list(cols)] = c
    return best


@dataclass(frozen=True)
class LatencyTargets:
    """What counts as a good request: time to first token and time per output token after
    the first (vLLM's goodput terms), each None when not targeted."""

    ttft_s: float | None = None
    itl_s: float | None = None

    def __bool__(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None

    def missed(self, ttft: float | None, tpot: float | None) -> str:
        """'none', 'ttft', 'itl' or 'both': which targets a finished request missed."""
        late = self.ttft_s is not None and ttft is not None and ttft > self.ttft_s
        slow = self.itl_s is not None and tpot is not None and tpot > self.itl_s
        return "both" if late and slow else "ttft" if late else "itl" if slow else "none"
