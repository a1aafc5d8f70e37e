"""Continuous batching under one token budget per step.

Every request closes part of its gap `num_tokens - num_computed_tokens` each time it is
scheduled. Running requests go first, in arrival order, so decodes are never starved by a new
prompt; waiting requests are admitted in arrival order with whatever budget is left, a long
prompt in chunks. When the KV pool runs dry the most recently arrived running request is
preempted by recompute: its blocks are freed and it restarts from the waiting queue later,
keeping the tokens it already generated.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this step completes the request's known tokens, so a new token is sampled.
    samples: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def check_request(self, req: Request) -> None:
        """Raise ValueError if `req` could never be served within the configured limits."""
        need = req.num_prompt_tokens + req.max_tokens
        if need > self.config.max_model_len:
            raise ValueError(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.max_tokens}) = "
                f"{need} exceeds max_model_len {self.config.max_model_len}")
        blocks = -(-need // self.kv.block_size)
        if blocks > self.kv.num_blocks:
            raise ValueError(
                f"request needs up to {blocks} KV blocks ({need} tokens) but the cache holds "
                f"{self.kv.num_blocks}; raise --kv-cache-memory or lower max_tokens")

    def add_request(self, req: Request) -> None:
        self.check_request(req)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.perf_counter()

        # 1. Running requests, decodes before unfinished prompt chunks so that a long prompt
        # never delays the next token of a request already streaming.
        granted: set[str] = set()
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = max((r for r in self.running if r.request_id not in granted),
                             key=lambda r: r.arrival_time)
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._grant(req, n, now))
                granted.add(req.request_id)
                budget -= n

        # 2. Waiting requests, in arrival order, while budget, seats and blocks last. No
        # admissions in a step that had to preempt: memory is short.
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hit = self.kv.get_computed_blocks(req)
            num_hit = hit.num_blocks * self.kv.block_size
            n = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hit):
                break
            self.waiting.popleft()
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._grant(req, n, now))
            budget -= n
        return out

    def _grant(self, req: Request, n: int, now: float) -> ScheduledRequest:
        if req.timeline.first_scheduled is None:
            req.timeline.first_scheduled = now
        return ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.timeline.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance the counters of what ran; called before new tokens are appended."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) wherever it is and release its blocks."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.kv.forget(req)
