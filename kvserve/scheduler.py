"""Continuous batching under one token budget per step.

Every request closes part of its gap `num_tokens - num_computed_tokens` each time it is
scheduled. Short prompt work (after a prefix-cache hit, or a prompt's last chunk) gets steps of
its own, in runs that serve what was waiting when the run began, between normal steps. In a
normal step decodes go first, in arrival order, so they are never starved by a new prompt; a
decoding request's gap includes its speculative drafts, which cost budget like any other
token. Short prompt work goes next with up to half the remaining budget, then the rest in
arrival order: running prompts' chunks, then new requests, a long prompt in chunks. When the
KV pool runs dry the most recently arrived running request is preempted by recompute: its
blocks are freed and it restarts from the waiting queue later, keeping the tokens it already
generated.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager, KVTransfers
from kvserve.request import Request, RequestStatus

# Short prompt steps stop adding prompts at this many tokens: from about 32 rows the matmuls
# here are compute-bound, their time linear in rows, so a bigger step would only make its
# first prompts wait for its last.
SHORT_STEP_TOKENS = 32


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this step completes the request's known tokens, so a new token is sampled.
    samples: bool
    # Of the new tokens, how many are drafts to verify (the last ones).
    num_drafts: int = 0
    prefill: bool = False  # prompt work (or recompute), not a decode


@dataclass
class ShortStepRun:
    """The one state the scheduler carries from step to step besides its queues: the run of
    short prompt steps in progress (see `Scheduler.schedule`, part 0)."""

    backlog: set[str] = field(default_factory=set)  # short work left of the current run
    last_step_short: bool = False  # the previous step was one of the run's


@dataclass
class _Step:
    """What one call of `schedule` builds up: its output and what is left of its budget."""

    out: SchedulerOutput
    budget: int
    now: float
    granted: set[str] = field(default_factory=set)  # requests scheduled in this step
    isolating: bool = False  # a step for one suspect request (see Scheduler.quarantine)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # prefix-cache tier copies the step needs before its forward (done by the engine core)
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)

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
        self.short_run = ShortStepRun()
        self.num_suspects = 0  # requests with `suspect` set; at 0 a step skips their search

    def check_request(self, req: Request) -> None:
        """Raise ValueError if `req` could never be served within the configured limits."""
        need = req.num_prompt_tokens + req.max_tokens
        if need > self.config.max_model_len:
            raise ValueError(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.max_tokens}) = "
                f"{need} exceeds max_model_len {self.config.max_model_len}")
        blocks = self.kv.blocks_for(need, self.config.max_num_batched_tokens)
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
        step = _Step(SchedulerOutput(), self.config.max_num_batched_tokens, time.perf_counter())
        if self._isolate(step):
            return self._finish(step)
        out, run = step.out, self.short_run
        short = self.config.max_num_batched_tokens // 4
        is_short = lambda r: r.num_tokens - self.kv.num_pool_hit_tokens(r) <= short  # noqa: E731
        prompts = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]

        # 0. Short prompt work (a question after a cached system prompt, the last chunk of a
        # prompt) runs in steps of its own: on a CPU a step's parts run one after another, so
        # decodes or a long chunk riding along would delay these first tokens by their whole
        # cost, and the work left out waits about as long as it would have in a shared step.
        # The short work present when such a run starts is served in steps of about
        # SHORT_STEP_TOKENS, so the first prompts need not wait for the last; then comes a
        # normal step, so decodes are never starved by short work arriving all the time.
        if self.config.short_prompt_steps:
            if not run.backlog and not run.last_step_short:
                run.backlog = {r.request_id for r in prompts
                               if r.num_tokens - r.num_computed_tokens <= short}
                run.backlog.update(
                    r.request_id for r in itertools.islice(self.waiting, self._seats())
                    if is_short(r))
            if run.backlog:
                backlog = run.backlog
                self._short_prompts(
                    [r for r in prompts if r.request_id in backlog],
                    lambda r: r.request_id in backlog and is_short(r), short, step,
                    stop_at=SHORT_STEP_TOKENS)
                backlog.difference_update(s.request.request_id for s in out.scheduled)
                # What could not be scheduled now (no seats, no blocks) leaves the backlog.
                if not out.scheduled:
                    backlog.clear()
                else:
                    backlog.intersection_update(
                        {r.request_id for r in prompts} | {r.request_id for r in self.waiting})
                    run.last_step_short = True
                    return self._finish(step)
        run.last_step_short = False

        # 1. Decodes first, in arrival order, so that a long prompt never delays the next
        # token of a request already streaming.
        prompt_ids = {r.request_id for r in prompts}
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or req.request_id in prompt_ids:
                continue  # preempted earlier in this loop, or prompt work
            if step.budget > 0:
                self._run(req, step)

        # 2. Short prompt work goes next, in arrival order, using at most half of what is
        # left: one long cold prompt then no longer holds up every short one's first token,
        # and short ones can never starve it.
        spend = step.budget // 2
        keep, step.budget = step.budget - spend, spend
        self._short_prompts(prompts, is_short, short, step)
        step.budget += keep

        # 3. The rest, in arrival order: running prompts, then new requests.
        for req in prompts:
            if (req.status == RequestStatus.RUNNING and req.request_id not in step.granted
                    and step.budget > 0):
                self._run(req, step)
        self._admit(step)
        return self._finish(step)

    def _isolate(self, step: _Step) -> bool:
        """A step holding only the first suspect request, when it can run (a waiting one
        needs its blocks free; until then it waits and the others run without it)."""
        if not self.num_suspects:
            return False
        for req in self.running:
            if req.suspect:
                self._run(req, step)
                return bool(step.out.scheduled)
        first = next((r for r in self.waiting if r.suspect), None)
        if first is None:
            return False
        step.isolating = True
        self._admit(step, lambda r: r is first)
        step.isolating = False
        return bool(step.out.scheduled)

    def quarantine(self, out: SchedulerOutput) -> list[Request]:
        """After the model step of `out` raised: which of its requests failed it. A request
        alone in the step, or failing a second step, is given back to be failed. The others
        lose their K/V (as in a preemption) and each runs next in a step of its own, so one
        request whose step raises cannot take the requests batched with it down too."""
        if len(out.scheduled) == 1:
            return [out.scheduled[0].request]
        guilty = []
        now = time.perf_counter()
        for s in reversed(out.scheduled):  # appendleft: keeps their arrival order
            req = s.request
            req.num_failed_steps += 1
            if req.num_failed_steps > 1:
                guilty.append(req)
                continue
            req.suspect = True
            self.num_suspects += 1
            self.running.remove(req)
            self._preempt(req, now)
            req.timeline.add(now, "step_failed")
        return guilty[::-1]

    def _short_prompts(self, prompts: list[Request], is_short: Callable[[Request], bool],
                       short: int, step: _Step, stop_at: int | None = None) -> None:
        """Schedule the prompt work that ends in a first token within `short` tokens: running
        prompts' last chunks, then waiting requests (after their prefix-cache hit); with
        `stop_at`, no more once the step holds that many tokens."""
        full = lambda: stop_at is not None and step.out.num_tokens >= stop_at  # noqa: E731
        for req in prompts:
            if (req.status == RequestStatus.RUNNING and not full()
                    and req.num_tokens - req.num_computed_tokens <= min(short, step.budget)):
                self._run(req, step)
        self._admit(step, lambda r: not full() and is_short(r))

    def _finish(self, step: _Step) -> SchedulerOutput:
        out = step.out
        out.kv_transfers = self.kv.take_transfers()
        batch = len(out.scheduled)
        for s in out.scheduled:
            req = s.request
            s.prefill = (req.num_computed_tokens < req.num_prompt_tokens
                         or req.num_tokens - req.num_computed_tokens > 1)
            req.timeline.add_step(step.now, s.prefill, s.num_new_tokens, batch)
        return out

    def _run(self, req: Request, step: _Step) -> None:
        """Schedule a running request for as much of its gap as the budget allows (drafts
        that do not fit are dropped), preempting the latest arrivals not yet scheduled this
        step (possibly itself) until it fits; drafts go before anyone is preempted."""
        n = min(req.num_tokens_with_drafts - req.num_computed_tokens, step.budget)
        while not self.kv.allocate_slots(req, n):
            if req.draft_token_ids:
                req.clear_drafts()
                n = min(req.num_tokens - req.num_computed_tokens, step.budget)
                continue
            victim = max((r for r in self.running if r.request_id not in step.granted),
                         key=lambda r: r.arrival_time)
            self.running.remove(victim)
            self._preempt(victim, step.now)
            step.out.preempted.append(victim)
            if victim is req:
                return
        self._grant(req, n, step)

    def _admit(self, step: _Step,
               wanted: Callable[[Request], bool] | None = None) -> None:
        """Admit waiting requests (those `wanted`, else all) in arrival order while budget,
        seats and blocks last. No admissions in a step that had to preempt: memory is short.
        The scan looks at most at as many requests as there are free seats."""
        now = step.now
        for req in list(itertools.islice(self.waiting, self._seats())):
            if (step.budget <= 0 or step.out.preempted
                    or len(self.running) >= self.config.max_num_seqs):
                return
            if wanted is not None and not wanted(req) or req.suspect and not step.isolating:
                continue
            hit = self.kv.get_computed_blocks(req)
            num_hit = hit.num_blocks * self.kv.block_size
            n = min(req.num_tokens - req.num_computed_tokens - num_hit, step.budget)
            if not self.kv.allocate_slots(req, n, hit):
                return
            self.waiting.remove(req)
            req.num_computed_tokens += num_hit
            if req.status == RequestStatus.PREEMPTED:
                assert req.timeline.preempted_at is not None
                req.timeline.preempted_time += now - req.timeline.preempted_at
                req.timeline.add(now, "resumed")
            if num_hit:
                req.timeline.add(now, "prefix_hit", tokens=num_hit,
                                 tiers=hit.tokens_by_tier(self.kv.block_size))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._grant(req, n, step)

    def _seats(self) -> int:
        return max(self.config.max_num_seqs - len(self.running), 0)

    def _grant(self, req: Request, n: int, step: _Step) -> None:
        """Put `n` of the request's tokens in the step."""
        if req.timeline.first_scheduled is None:
            req.timeline.first_scheduled = step.now
        num_drafts = req.num_computed_tokens + n - req.num_tokens
        if num_drafts < len(req.draft_token_ids):  # the budget cut some drafts off
            req.draft_token_ids = req.draft_token_ids[:max(num_drafts, 0)]
            if req.draft_probs is not None:
                req.draft_probs = req.draft_probs[:max(num_drafts, 0)]
        step.out.scheduled.append(ScheduledRequest(req, n, num_drafts >= 0, max(num_drafts, 0)))
        step.granted.add(req.request_id)
        step.budget -= n

    def _preempt(self, req: Request, now: float) -> None:
        req.timeline.preempted_at = now
        req.timeline.add(now, "preempted", tokens_lost=req.num_computed_tokens)
        req.clear_drafts()
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.timeline.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def recompute_failed_loads(self, out: SchedulerOutput, failed: set[int]) -> None:
        """Loads into the pool blocks `failed` found no good copy in any tier: the requests of
        this step holding one lose their K/V as in a preemption (counted as one) and compute
        it again when they are next admitted; the rest of the step runs as scheduled."""
        self.kv.drop_failed_loads(failed)
        now = time.perf_counter()
        keep = []
        for s in out.scheduled:
            req = s.request
            if not any(b in failed for table in (req.block_ids, *req.group_tables)
                       for b in table):
                keep.append(s)
                continue
            req.timeline.add(now, "kv_load_failed")
            self.running.remove(req)
            self._preempt(req, now)
            out.preempted.append(req)
        out.scheduled = keep

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance the counters of what ran; called before new tokens are appended. Drafts
        count as computed here; `rollback` takes the rejected ones back out."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        if len(out.scheduled) == 1 and out.scheduled[0].request.suspect:
            out.scheduled[0].request.suspect = False  # it ran alone and did not fail
            self.num_suspects -= 1

    def rollback(self, req: Request) -> None:
        """After verification appended the accepted tokens: K/V is valid only up to the
        token before the newest (the newest has not been through the model), so rejected
        drafts leave num_computed_tokens, and blocks held only for them go back."""
        req.clear_drafts()
        if req.num_computed_tokens >= req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1
        self.kv.trim(req, req.num_tokens)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) wherever it is and release its blocks."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if req.suspect:  # aborted (or failed) before it ran alone
            req.suspect = False
            self.num_suspects -= 1
        self.kv.free(req)
        self.kv.forget(req)
