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
load and their noise, with no calibration run.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

_ATTN_UNIT = 1024.0  # attended pairs per unit of c3, so the four coefficients are comparable


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


class StepCostModel:
    """Step time as a non-negative linear function of `StepShape`, refitted every `refit`
    observations over the last `window` of them. `predict` is None until `min_samples` steps
    were seen, and the scheduler then behaves as it does with no target."""

    def __init__(self, window: int = 512, min_samples: int = 16, refit: int = 8) -> None:
        self.window, self.min_samples, self.refit = window, min_samples, refit
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.coef: np.ndarray | None = None

    def observe(self, shape: StepShape, seconds: float) -> None:
        self._x.append(shape.features())
        self._y.append(seconds)
        self._since_fit += 1
        if len(self._y) >= self.min_samples and (self.coef is None
                                                 or self._since_fit >= self.refit):
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        x = np.array(self._x, dtype=np.float64)
        y = np.array(self._y, dtype=np.float64)
        self.coef = nonnegative_lstsq(x, y)

    def predict(self, shape: StepShape) -> float | None:
        if self.coef is None:
            return None
        return float(np.dot(self.coef, shape.features()))

    def set(self, c0: float, c1: float, c2: float, c3: float) -> None:
        """Fix the coefficients (seconds; c3 per 1024 attended pairs), as tests do."""
        self.coef = np.array([c0, c1, c2, c3], dtype=np.float64)
        self.min_samples = 1 << 62  # and keep them: no refit from observations

    def max_prefill(self, base: StepShape, target: float, limit: int, context: int) -> int:
        """The most prompt tokens (at most `limit`) that can join `base` (the step's decodes)
        with the predicted step time within `target`; 0 when not even one fits. The prompt
        tokens are assumed to follow `context` cached tokens of one request."""
        if self.coef is None:
            return limit

        def fits(p: int) -> bool:
            shape = StepShape(base.prefill_tokens + p, base.decode_rows,
                              base.attended + prompt_attended(context, p))
            return self.predict(shape) <= target  # type: ignore[operator]

        lo, hi = 0, limit  # fits(lo) is assumed; find the largest p that fits
        if not fits(0):
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo


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
