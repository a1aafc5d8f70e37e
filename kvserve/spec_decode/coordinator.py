"""Speculative decoding in the engine: when to draft, for whom and how far, and what
verification showed.

The adaptive policy (SpecConfig): no drafts when the batch is larger than max_batch_size (the
step is compute-bound there, and verification would cost more than it saves); otherwise the
decoding requests draft in order of their recent acceptance, each at most
num_speculative_tokens and never past its max_tokens, within max_draft_tokens for the step.
A request whose acceptance fell below min_acceptance drafts one token every probe_interval
steps, so it can come back when its text becomes predictable again.

The coordinator owns the per-request draft state (acceptance, idle steps); the drafter owns
its own (hidden states, a draft model's KV). `Request` keeps only the draft tokens that the
scheduler schedules and the runner verifies.
"""

from __future__ import annotations

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


class SpecCoordinator:
    def __init__(self, config: SpecConfig, drafter: Drafter, kv: KVCacheManager) -> None:
        self.config = config
        self.drafter = drafter
        self.stats = SpecStats()
        self._state: dict[str, _DraftState] = {}
        drafter.allocate(kv)

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
        reqs, ks = [], []
        budget = cfg.max_draft_tokens
        for r in sorted(decoding, key=lambda r: -states[r.request_id].acceptance):
            st = states[r.request_id]
            k = min(cfg.num_speculative_tokens, r.max_tokens - r.num_output_tokens - 1, budget)
            if st.acceptance < cfg.min_acceptance:
                st.idle_steps += 1
                if st.idle_steps < cfg.probe_interval:
                    continue
                k = min(k, 1)
            if k >= 1:
                st.idle_steps = 0
                reqs.append(r)
                ks.append(k)
                budget -= k
        if reqs:
            self.drafter.propose(reqs, ks)

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        """Count a verification of `drafted` drafts of which the first `accepted` held."""
        self.stats.count(drafted, accepted)
        req.timeline.add_spec(drafted, accepted)
        # Moving average over about the last acceptance_window drafts: each draft token
        # moves the rate 1/window of the way towards 1 (accepted) or 0.
        st = self._state.setdefault(req.request_id, _DraftState())
        keep = (1 - 1 / self.config.acceptance_window) ** drafted
        st.acceptance = keep * st.acceptance + (1 - keep) * accepted / drafted

    def observe_hidden(self, req: Request, hidden: torch.Tensor | None) -> None:
        """The target's final hidden state at the row that sampled the newest token."""
        if hidden is not None:
            self.drafter.take_hidden(req, hidden)

    def forget(self, req: Request) -> None:
        self._state.pop(req.request_id, None)
        self.drafter.forget(req)
