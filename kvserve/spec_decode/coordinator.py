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
cost model's until they vary in size), and a draft step's, fixed and per request, to the
recent draft steps (the drafter's own timings per token run, else whole proposals timed
as their mean step; while those are all of one size, a request's share as a row's in a
one-row target step). A new request's acceptance starts from all requests' recent one, so
a batch of new requests does not draft in full on a drafter that reads this traffic badly.
Draft tokens are added in order of that probability while the expected tokens per second of
the step still rise: a draft with probability q joins a step of expected E tokens in T
seconds when q / c > E / T, c its cost; that is done for each depth the step could draft
to, and the best depth wins. So a step never drafts where speculation would be slower by
these measures (nor where it expects less than `min_gain` more tokens a second: the costs
are fitted, and a margin keeps their error from making it slower), a request whose text the
drafter reads well drafts deeper, and a batch shares its draft steps. A request left
without drafts probes as above, where a probe would pay if it were sure to be accepted (see
_depths).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
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


# Decode steps, and draft steps, whose times the depth rule fits their costs to.
STEP_WINDOW = 64
# How many verified drafts a new request's prior acceptance weighs, taken from the recent
# acceptance of all requests.
PRIOR_WEIGHT = 2.0


def fit_line(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope >= 0) of the least-squares line through (x, y) points, or None while
    they hold fewer than two values of x."""
    pts = list(points)
    if len({x for x, _ in pts}) < 2:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = max(sum((x - mx) * (y - my) for x, y in pts) / sxx, 0.0)
    return my - slope * mx, slope


def choose_depths(p: list[float], limits: list[int], step: float, row: float, draft: float,
                  budget: int, draft_row: float = 0.0, first: list[float] | None = None,
                  min_gain: float = 0.0) -> list[int]:
    """Draft tokens per request (see the module docstring): request i's j-th draft is
    accepted with probability p[i] ** j. A step of len(p) decode rows takes `step` seconds;
    a draft costs a verify row (`row`) and a row of a draft step (`draft_row`), and every
    draft step (one token for each request drafting that far) `draft` more: drafting to
    depth L costs L draft steps, whoever drafts. For each L, drafts of depth at most L are
    taken in order of probability while that probability over their cost exceeds the
    step's expected tokens per second, at most limits[i] for request i and `budget` in
    all; the L whose step has the most expected tokens per second wins. first[i]: what
    request i's first draft costs besides (a draft model catching up on the tokens verified
    while it paused); a request whose first draft does not pay drafts nothing. No drafts at
    all unless the best step's rate beats the step without drafts by `min_gain` (a fraction):
    a margin for what these costs do not model."""
    first = first if first is not None else [0.0] * len(p)
    offers = sorted(((p[i] ** j, j, i) for i in range(len(p))
                     for j in range(1, limits[i] + 1)), key=lambda o: -o[0])
    cost = row + draft_row
    best, best_rate = [0] * len(p), len(p) / step
    for depth in range(1, max(limits, default=0) + 1):
        tokens, seconds, left = float(len(p)), step + depth * draft, budget
        depths = [0] * len(p)
        for gain, j, i in offers:
            if left <= 0:
                break
            if j > depth or depths[i] != j - 1:
                continue  # past this depth, or its earlier draft was not taken
            c = cost + (first[i] if j == 1 else 0.0)
            if gain * seconds <= tokens * c:
                continue
            depths[i] += 1
            tokens, seconds, left = tokens + gain, seconds + c, left - 1
        if max(depths) == depth and tokens / seconds > best_rate:
            best, best_rate = depths, tokens / seconds
    return best if best_rate > (1 + min_gain) * len(p) / step else [0] * len(p)


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
        self._steps: deque[tuple[int, float]] = deque(maxlen=STEP_WINDOW)
        # Draft steps (tokens or requests in the step, seconds): the drafter's own, else whole
        # proposals timed, each as its mean draft step.
        self.draft_steps: deque[tuple[float, float]] = drafter.draft_steps \
            if drafter.draft_steps is not None else deque(maxlen=STEP_WINDOW)
        # All requests' recent acceptance: a new request's prior (see _new_state).
        self._everyone = _DraftState()
        drafter.allocate(kv)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step (no prompt work) of `rows` rows, drafts included, took `seconds`
        besides drafting."""
        self._steps.append((rows, seconds))

    def step_cost(self) -> tuple[float, float] | None:
        """(seconds, seconds a row) of a decode step, least squares over the recent steps, or
        None while they do not tell a row's cost (all of one size)."""
        return fit_line(self._steps)

    def draft_cost(self, row_share: float) -> tuple[float, float] | None:
        """(seconds, seconds a request) of a draft step, least squares over the recent ones;
        None before any. While they are all of one size, a request's share of the step is
        taken to be `row_share` (a row's share of a one-row target step)."""
        fitted = fit_line(self.draft_steps)
        if fitted is not None:  # a noisy fit's intercept may dip below zero: no step is free
            return max(fitted[0], 0.0), fitted[1]
        if not self.draft_steps:
            return None
        rows, seconds = self.draft_steps[-1]
        fixed = seconds / (1 + rows * row_share)
        return fixed, fixed * row_share

    def _new_state(self) -> _DraftState:
        """A request's first acceptance estimate: everyone's recent one, weighing
        PRIOR_WEIGHT drafts (1.0 before any verification)."""
        e = self._everyone
        return _DraftState(acceptance=e.acceptance, hits=PRIOR_WEIGHT * e.p,
                           misses=PRIOR_WEIGHT * (1 - e.p))

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
        states = {}
        for r in decoding:
            if r.request_id not in self._state:
                self._state[r.request_id] = self._new_state()
            states[r.request_id] = self._state[r.request_id]
        depths, probe_every = self._depths(decoding, states)
        reqs, ks = [], []
        budget = cfg.max_draft_tokens
        for r in sorted(decoding, key=lambda r: -states[r.request_id].acceptance):
            st = states[r.request_id]
            k = min(depths[r.request_id], r.max_tokens - r.num_output_tokens - 1, budget)
            if st.acceptance < cfg.min_acceptance or k < 1:
                st.idle_steps += 1
                if probe_every is None or st.idle_steps < probe_every:
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
            if depth and self.drafter.draft_steps is None:
                # the mean draft step of the proposal: its mean requests, its mean time
                rows = sum(len(r.draft_token_ids) for r in reqs) / depth
                self.draft_steps.append((rows, (time.perf_counter() - t0) / depth))

    def _depths(self, decoding: list[Request], states: dict[str, _DraftState]
                ) -> tuple[dict[str, int], int | None]:
        """How far each request may draft this step: num_speculative_tokens, or with
        adaptive_depth what choose_depths finds worth its cost (once the step cost model
        predicts and a draft has been timed); and after how many steps without drafts a
        request probes (None: not in this step). With adaptive_depth only where a one-token
        draft would pay in this step if it were sure to be accepted, and every
        probe_interval steps times the batch's requests, so that a step verifies about one
        probe in probe_interval whatever the batch: with many rows in a step a probe's
        verify row and draft cost more than its token can bring (at 32 requests, each
        probing every 8 steps cost the 1.5B ~5%). Alone, a request always probes, so
        speculation never stays off for good."""
        cfg = self.config
        full = {r.request_id: cfg.num_speculative_tokens for r in decoding}
        if not cfg.adaptive_depth or not self.draft_steps:
            return full, cfg.probe_interval
        rows = len(decoding)
        fitted = self.step_cost()
        if fitted is not None:  # measured on this machine, in this run
            fixed, row = fitted
        else:  # until then, the step cost model's prediction
            one = self._step_seconds(1) if self._step_seconds else None
            two = self._step_seconds(2) if self._step_seconds else None
            if one is None or two is None:
                return full, cfg.probe_interval
            row = max(two - one, 0.0)
            fixed = one - row
        step = fixed + row * rows
        # Where draft steps were all of one size: a request's share of one as a row's is of
        # a one-row target step.
        draft = self.draft_cost(row / (fixed + row) if fixed + row > 0 else 0.0)
        assert draft is not None  # draft_steps is not empty
        limits = [max(0, min(cfg.num_speculative_tokens, r.max_tokens - r.num_output_tokens - 1))
                  for r in decoding]
        # A draft model's catch-up on tokens verified while it paused, at its cost a token.
        first = [self.drafter.catchup_tokens(r) * draft[1] for r in decoding]
        depths = choose_depths([states[r.request_id].p for r in decoding], limits, step, row,
                               draft[0], cfg.max_draft_tokens, draft[1], first, cfg.min_gain)
        probes = step > rows * (row + draft[1] + draft[0])
        return ({r.request_id: k for r, k in zip(decoding, depths, strict=True)},
                cfg.probe_interval * rows if probes else None)

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        """Count a verification of `drafted` drafts of which the first `accepted` held."""
        self.stats.count(drafted, accepted)
        req.timeline.add_spec(drafted, accepted)
        # Moving average over about the last acceptance_window drafts: each draft token
        # moves the rate 1/window of the way towards 1 (accepted) or 0.
        if req.request_id not in self._state:
            self._state[req.request_id] = self._new_state()
        keep = (1 - 1 / self.config.acceptance_window) ** drafted
        for st in (self._state[req.request_id], self._everyone):
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
