"""Speculative decoding in the engine: when to draft, for whom and how far, and what
verification showed.

The adaptive policy (SpecConfig): no drafts when the batch is larger than max_batch_size (the
step is compute-bound there, and verification would cost more than it saves); otherwise the
decoding requests draft in order of their recent acceptance, each at most
num_speculative_tokens and never past its max_tokens, within max_draft_tokens for the step.
A request whose acceptance fell below min_acceptance drafts one token every probe_interval
steps, so it can come back when its text becomes predictable again.

With adaptive_depth, how far each request drafts follows from costs: its j-th draft token is
accepted with probability p^j (p: its per-token acceptance, estimated from its recent
verifications), and costs a verify row plus a row of a draft step; each draft step (one
token for every request drafting that far) costs its own time once, however many requests
share it. A target step's time and a row's are fitted to the recent decode steps (the step
cost model's until they vary in size); a draft step's time is the drafter's measure, else
whole proposals timed over their depth, and a row of it is charged the share of a row in a
target step. Draft tokens are added in order of that probability while the expected tokens
per second of the step still rise: a draft with probability q joins a step of expected E
tokens in T seconds when q / c > E / T, c its cost; that is done for each depth the step
could draft to, and the best depth wins. So a step never drafts where speculation would be
slower by these measures, a request whose text the drafter reads well drafts deeper, and a
batch shares its draft steps. A request left without drafts probes as above.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import SpecConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.spec_decode.base import Drafter
from kvserve.stats import SpecStats


@dataclass
class _DraftState:
    acceptance: float = 1.0  # moving average of the acceptance rate
    idle_steps: int = 0  # decode steps without drafts since the last probe
    # Discounted counts of accepted drafts and of rejections (a verification that stopped
    # before its last draft): p = hits / (hits + misses), a draft token's acceptance.
    hits: float = 2.0
    misses: float = 0.0

    @property
    def p(self) -> float:
        return self.hits / (self.hits + self.misses)


# How fast the measured draft time follows new measurements.
DRAFT_TIME_WEIGHT = 0.2
# Decode steps whose time the depth rule fits a step's cost to (rows -> seconds).
STEP_WINDOW = 64


def choose_depths(p: list[float], limits: list[int], step: float, row: float, draft: float,
                  budget: int, draft_row: float = 0.0) -> list[int]:
    """Draft tokens per request (see the module docstring): request i's j-th draft is
    accepted with probability p[i] ** j. A step of len(p) decode rows takes `step` seconds;
    a draft costs a verify row (`row`) and a row of a draft step (`draft_row`), and every
    draft step (one token for each request drafting that far) `draft` more: drafting to
    depth L costs L draft steps, whoever drafts. For each L, drafts of depth at most L are
    taken in order of probability while that probability over their cost exceeds the
    step's expected tokens per second, at most limits[i] for request i and `budget` in
    all; the L whose step has the most expected tokens per second wins."""
    offers = sorted(((p[i] ** j, j, i) for i in range(len(p))
                     for j in range(1, limits[i] + 1)), key=lambda o: -o[0])
    cost = row + draft_row
    best, best_rate = [0] * len(p), len(p) / step
    for depth in range(1, max(limits, default=0) + 1):
        tokens, seconds, left = float(len(p)), step + depth * draft, budget
        depths = [0] * len(p)
        for gain, j, i in offers:
            if left <= 0 or gain * seconds <= tokens * cost:
                break
            if j <= depth:
                depths[i] += 1
                tokens, seconds, left = tokens + gain, seconds + cost, left - 1
        if max(depths) == depth and tokens / seconds > best_rate:
            best, best_rate = depths, tokens / seconds
    return best


class SpecCoordinator:
    def __init__(self, config: SpecConfig, drafter: Drafter, kv: KVCacheManager,
                 step_seconds: Callable[[int], float | None] | None = None) -> None:
        """`step_seconds(rows)`: the step cost model's prediction for a step of that many
        decode rows (None while it has none), which adaptive_depth weighs drafts against."""
        self.config = config
        self.drafter = drafter
        self.stats = SpecStats()
        self._state: dict[str, _DraftState] = {}
        self._step_seconds = step_seconds
        self.draft_seconds: float | None = None  # a draft step's time, measured
        self._steps: deque[tuple[int, float]] = deque(maxlen=STEP_WINDOW)
        drafter.allocate(kv)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step (no prompt work) of `rows` rows, drafts included, took `seconds`
        besides drafting."""
        self._steps.append((rows, seconds))

    def step_cost(self) -> tuple[float, float] | None:
        """(seconds, seconds a row) of a decode step, least squares over the recent steps, or
        None while they do not tell a row's cost (all of one size)."""
        if len({r for r, _ in self._steps}) < 2:
            return None
        n = len(self._steps)
        mx = sum(r for r, _ in self._steps) / n
        my = sum(t for _, t in self._steps) / n
        sxx = sum((r - mx) ** 2 for r, _ in self._steps)
        row = max(sum((r - mx) * (t - my) for r, t in self._steps) / sxx, 0.0)
        return my - row * mx, row

    @property
    def needs_hidden(self) -> bool:
        """Whether the runner must hand back each sampled row's final hidden state."""
        return self.drafter.needs_hidden

    def propose(self, running: list[Request]) -> None:
        """Drafts for the running requests that decode in the coming step."""
        cfg = self.config
        decoding = [r for r in running if r.status == RequestStatus.RUNNING
                    and r.num_computed_tokens == r.num_tokens - 1]
        if not decoding:
            return
        if len(running) > cfg.max_batch_size:
            self.stats.num_steps_off += 1
            return
        states = {r.request_id: self._state.setdefault(r.request_id, _DraftState())
                  for r in decoding}
        depths = self._depths(decoding, states)
        reqs, ks = [], []
        budget = cfg.max_draft_tokens
        for r in sorted(decoding, key=lambda r: -states[r.request_id].acceptance):
            st = states[r.request_id]
            k = min(depths[r.request_id], r.max_tokens - r.num_output_tokens - 1, budget)
            if st.acceptance < cfg.min_acceptance or k < 1:
                st.idle_steps += 1
                if st.idle_steps < cfg.probe_interval:
                    continue
                k = min(r.max_tokens - r.num_output_tokens - 1, budget, 1)
            if k >= 1:
                st.idle_steps = 0
                reqs.append(r)
                ks.append(k)
                budget -= k
        if reqs:
            t0 = time.perf_counter()
            self.drafter.propose(reqs, ks)
            depth = max(len(r.draft_token_ids) for r in reqs)
            if depth:
                took = (time.perf_counter() - t0) / depth
                self.draft_seconds = took if self.draft_seconds is None else \
                    self.draft_seconds + DRAFT_TIME_WEIGHT * (took - self.draft_seconds)

    def _depths(self, decoding: list[Request], states: dict[str, _DraftState]
                ) -> dict[str, int]:
        """How far each request may draft this step: num_speculative_tokens, or with
        adaptive_depth what choose_depths finds worth its cost (once the step cost model
        predicts and a draft has been timed)."""
        cfg = self.config
        full = {r.request_id: cfg.num_speculative_tokens for r in decoding}
        draft = self.drafter.step_seconds if self.drafter.step_seconds is not None \
            else self.draft_seconds
        if not cfg.adaptive_depth or draft is None:
            return full
        rows = len(decoding)
        fitted = self.step_cost()
        if fitted is not None:  # measured on this machine, in this run
            step, row = fitted[0] + fitted[1] * rows, fitted[1]
        else:  # until then, the step cost model's prediction
            step = self._step_seconds(rows) if self._step_seconds else None
            more = self._step_seconds(rows + 1) if self._step_seconds else None
            if step is None or more is None:
                return full
            row = max(more - step, 0.0)
        limits = [max(0, min(cfg.num_speculative_tokens, r.max_tokens - r.num_output_tokens - 1))
                  for r in decoding]
        # A row of a draft step costs what a row does in a target step, in proportion.
        draft_row = draft * row / step if step > 0 else 0.0
        depths = choose_depths([states[r.request_id].p for r in decoding], limits, step, row,
                               draft, cfg.max_draft_tokens, draft_row)
        return {r.request_id: k for r, k in zip(decoding, depths, strict=True)}

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        """Count a verification of `drafted` drafts of which the first `accepted` held."""
        self.stats.count(drafted, accepted)
        req.timeline.add_spec(drafted, accepted)
        # Moving average over about the last acceptance_window drafts: each draft token
        # moves the rate 1/window of the way towards 1 (accepted) or 0.
        st = self._state.setdefault(req.request_id, _DraftState())
        keep = (1 - 1 / self.config.acceptance_window) ** drafted
        st.acceptance = keep * st.acceptance + (1 - keep) * accepted / drafted
        st.hits = keep * st.hits + accepted
        st.misses = keep * st.misses + (1 if accepted < drafted else 0)

    def observe_hidden(self, req: Request, hidden: torch.Tensor | None) -> None:
        """The target's final hidden state at the row that sampled the newest token."""
        if hidden is not None:
            self.drafter.take_hidden(req, hidden)

    def forget(self, req: Request) -> None:
        self._state.pop(req.request_id, None)
        self.drafter.forget(req)
