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

With a target for inter-token latency (`SchedulerConfig.target_itl_s`; the engine sets a
default step-time budget, kvserve.sched.slo.default_itl_budget), steps that carry decodes are sized
by the step cost model (kvserve.sched.slo); how depends on what it knows (`Sizing`):
- "fit": a step that carries decodes gets only as much prompt work as keeps its predicted time
  within TARGET_MARGIN of the target (but at least MIN_PROMPT_TOKENS, so prompts always
  progress), and short prompt steps pause while requests decode (each would add a whole step
  to a decode's gap); a new request is admitted only while the batch's steady load, with it,
  is predicted to fit: every running request adds a decode row to each step, and its prompt
  spread over its output (prompt tokens / max_tokens per step: the prompt work the steps must
  carry for prompts to keep pace with the requests finishing), up to half of what a step can
  hold;
- "unsure" (not fitted yet): one prompt at a time, and UNSURE_PROMPT_TOKENS of prompt work
  beside decodes; never admission as if there were no target;
- "infeasible" (not even one decode row with MIN_PROMPT_TOKENS is predicted within the
  target): one request at a time, the shortest gaps this machine can give.
The default step budget (no --target-itl-ms; `SchedulerConfig.itl_admission` false) only sizes
the prompt work beside decodes: admission is as with no target, and recovery only refits.
Steps with prompts only run the whole token budget in every case. When measured steps with
decodes run over the target OVERRUN_STEPS times in a row, `_recover` gives back what the batch
cannot carry. With no target nothing changes.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sched.output import ScheduledRequest, SchedulerOutput
from kvserve.sched.slo import TARGET_MARGIN, StepShape, StepTimeModel, prompt_attended
from kvserve.sched.ttft import TTFTPredictor

# How steps are sized under an ITL target (see the module docstring); "off": no target.
Sizing = Literal["off", "unsure", "infeasible", "fit"]

# Short prompt steps stop adding prompts at this many tokens: from about 32 rows the matmuls
# here are compute-bound, their time linear in rows, so a bigger step would only make its
# first prompts wait for its last.
SHORT_STEP_TOKENS = 32
# Under an ITL target, the prompt work a step with decodes always gets, however late it runs:
# prompts are never starved, at the price of steps over the target when the decodes alone
# nearly fill it (admission keeps that rare: see Scheduler._fits_target).
MIN_PROMPT_TOKENS = 4
# Under an ITL target with no fitted cost model: the prompt work a step with decodes gets
# (a short prompt step's worth: well under the default 500 ms budget even for a 1.5B model
# on 2 cores; benchmarks/RESULTS.md has its cost per prompt token).
UNSURE_PROMPT_TOKENS = SHORT_STEP_TOKENS
# Steps with decodes measured over the ITL target this many times in a row make the scheduler
# give back what the batch cannot carry (Scheduler._recover): one slow step is noise, four
# are a batch too big for this machine now.
OVERRUN_STEPS = 4
# With --shed-late-requests, each step checks this many queued requests (from the head) for a
# TTFT target they will now miss: the rest are checked as they move up.
REFUSAL_SCAN = 16


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
    sizing: Sizing = "off"  # how the ITL target sizes it


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.short_run = ShortStepRun()
        self.num_suspects = 0  # requests with `suspect` set; at 0 a step skips their search
        self.cost = StepTimeModel()  # fed by the engine core after every step
        self.prompt_allowance: int | None = None  # last targeted step's prompt tokens
        self.ttft = TTFTPredictor(self)
        self._overruns = 0  # steps with decodes over the ITL target in a row

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
        if self.config.target_ttft_s is not None:
            self.ttft.on_arrival(req)
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
        if self._overruns >= OVERRUN_STEPS:
            self._recover(step)
        if self.config.shed_late_requests:
            self._refuse_late(step)
        prompts = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        decoding = len(prompts) < len(self.running)
        step.sizing = self.sizing()
        if step.sizing == "off":
            self.prompt_allowance = None

        # 0. Short prompt work (a question after a cached system prompt, the last chunk of a
        # prompt) runs in steps of its own: on a CPU a step's parts run one after another, so
        # decodes or a long chunk riding along would delay these first tokens by their whole
        # cost, and the work left out waits about as long as it would have in a shared step.
        # The short work present when such a run starts is served in steps of about
        # SHORT_STEP_TOKENS, so the first prompts need not wait for the last; then comes a
        # normal step, so decodes are never starved by short work arriving all the time.
        if self.config.short_prompt_steps and not (step.sizing != "off" and decoding):
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
        if step.sizing != "off" and decoding:
            self._limit_prompt_work(step, prompts)

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

    def _target(self) -> float:
        assert self.config.target_itl_s is not None
        return TARGET_MARGIN * self.config.target_itl_s

    def sizing(self) -> Sizing:
        """How the ITL target sizes steps now (see the module docstring)."""
        if self.config.target_itl_s is None:
            return "off"
        if self.cost.coef is None:
            return "unsure"
        return "fit" if self._target_feasible() else "infeasible"

    def _target_feasible(self) -> bool:
        """Whether the ITL target is set, the cost model fitted, and a step of one decode
        and MIN_PROMPT_TOKENS of prompt work predicted within it."""
        if self.config.target_itl_s is None:
            return False
        shape = StepShape(MIN_PROMPT_TOKENS, 1, prompt_attended(0, MIN_PROMPT_TOKENS) + 1)
        predicted = self.cost.predict(shape)
        return predicted is not None and predicted <= self._target()

    def _limit_prompt_work(self, step: _Step, prompts: list[Request]) -> None:
        """Cut the step's remaining budget to the prompt tokens that keep it within the ITL
        target with the decodes already in it (MIN_PROMPT_TOKENS at least; with no fitted
        model, UNSURE_PROMPT_TOKENS)."""
        if step.sizing == "unsure":
            step.budget = min(step.budget, UNSURE_PROMPT_TOKENS)
            self.prompt_allowance = step.budget
            return
        out = step.out
        base = StepShape(0, out.num_tokens, sum(
            prompt_attended(s.request.num_computed_tokens, s.num_new_tokens)
            for s in out.scheduled))
        first = next((r for r in prompts if r.status == RequestStatus.RUNNING), None)
        context = first.num_computed_tokens if first is not None else 0
        allowed = self.cost.max_prefill(base, self._target(), step.budget, context)
        step.budget = min(step.budget, max(allowed, MIN_PROMPT_TOKENS))
        self.prompt_allowance = step.budget

    @staticmethod
    def _prompt_share(num_prompt_tokens: int, max_tokens: int) -> float:
        """The prompt tokens per step that a request's prompt costs over its life."""
        return num_prompt_tokens / max(max_tokens, 1)

    def _may_admit(self, req: Request, sizing: Sizing) -> bool:
        """Whether the ITL target lets `req` join the batch now (see `Sizing`)."""
        if sizing != "off" and not self.config.itl_admission:  # the default step budget
            return True
        if sizing == "unsure":  # one prompt at a time
            return not any(r.num_tokens - r.num_computed_tokens > 1 for r in self.running)
        if sizing == "infeasible":  # one request at a time
            return not self.running
        return sizing == "off" or self._fits_target(req.num_prompt_tokens, req.max_tokens)

    def _fits_target(self, num_prompt_tokens: int, max_tokens: int, extra: int = 0) -> bool:
        """Under the ITL target: whether the batch's steady load (see the module docstring)
        with `extra` + 1 more requests of this shape is predicted to fit. With nothing
        running a request is always admitted, so the engine never stalls on a pessimistic
        model."""
        if not self.running and not extra:
            return True
        n = extra + 1
        rows = len(self.running) + n
        share = (sum(self._prompt_share(r.num_prompt_tokens, r.max_tokens)
                     for r in self.running) + n * self._prompt_share(num_prompt_tokens, max_tokens))
        # At most half of what a step could hold: a long prompt with a short output would
        # otherwise claim a whole step, and wait for every running request to leave; the
        # step sizing gives it what the decodes leave anyway.
        half = self.cost.max_prefill(StepShape(), self._target(),
                                     self.config.max_num_batched_tokens, 0) // 2
        prompt = max(min(round(share), half), MIN_PROMPT_TOKENS)
        context = sum(r.num_tokens for r in self.running) + n * num_prompt_tokens
        # the prompt work attends to about half a prompt's context per token, on average
        shape = StepShape(prompt, rows, context + prompt * num_prompt_tokens // 2)
        predicted = self.cost.predict(shape)
        return predicted is None or predicted <= self._target()

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
            out.attended += prompt_attended(req.num_computed_tokens, s.num_new_tokens)
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
            if not self._may_admit(req, step.sizing):
                return  # arrival order: no later request jumps ahead of this one
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

    def _preempt(self, req: Request, now: float, requeue: bool = False) -> None:
        """Free a running request's blocks and put it first in the queue, to compute its
        tokens again when admitted; `requeue`: one still in its prompt, sent back by
        _recover (a "requeued" event, not counted as a preemption)."""
        req.timeline.preempted_at = now
        req.timeline.add(now, "requeued" if requeue else "preempted",
                         tokens_lost=req.num_computed_tokens)
        req.clear_drafts()
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if not requeue:
            req.timeline.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(req)

    def forget_history(self) -> None:
        """Forget what the requests run so far did (the start-up calibration's), but the
        step cost model's fit: counts, leave times, overruns, prompt allowance."""
        self.num_preemptions = 0
        self._overruns = 0
        self.ttft.forget_history()
        self.prompt_allowance = None
        self.short_run = ShortStepRun()

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """A step of `shape` took `seconds` (all of it: the gap a decoding request sees):
        feed the cost model, and count steps with decodes over the ITL target in a row."""
        self.cost.observe(shape, seconds)
        target = self.config.target_itl_s
        if target is not None and shape.decode_rows:
            self._overruns = self._overruns + 1 if seconds > target else 0

    def _recover(self, step: _Step) -> None:
        """Steps with decodes ran over the ITL target OVERRUN_STEPS times in a row: the cost
        model was wrong, or the machine slowed. The model's drift is judged by those steps
        and folded into its fit (StepTimeModel.rebase), so admission and step sizing follow
        at once; and what the batch cannot carry is given back (said in `step.out`):
        - requests still in their prompt go back to the queue, first, in arrival order (their
          full blocks stay in the prefix cache), but for the oldest running request;
        - the latest admitted is preempted by recompute if the rest's decode rows (with
          MIN_PROMPT_TOKENS) are still not predicted to fit the target; one always stays.
          One per recovery: a burst of a neighbour's load looks like a slower machine for a
          few steps, and should not cost every stream its place.
        Then (as in every step with shed_late_requests) _refuse_late refuses the queued
        requests that are now predicted to miss their TTFT target."""
        self._overruns = 0
        self.cost.rebase(OVERRUN_STEPS)
        if not self.config.itl_admission:  # the default step budget: sizing follows, no more
            return
        now = step.now
        oldest = min(self.running, key=lambda r: r.arrival_time, default=None)
        for req in sorted(self.running, key=lambda r: r.arrival_time, reverse=True):
            if req.num_output_tokens == 0 and req is not oldest:
                self.running.remove(req)
                self._preempt(req, now, requeue=True)
                step.out.requeued.append(req)
        if len(self.running) > 1 and self.cost.coef is not None:
            context = sum(r.num_tokens for r in self.running)
            shape = StepShape(MIN_PROMPT_TOKENS, len(self.running), context)
            if self.cost.predict(shape) <= self._target():  # type: ignore[operator]
                return
            victim = max(self.running, key=lambda r: r.arrival_time)
            self.running.remove(victim)
            self._preempt(victim, now)
            step.out.preempted.append(victim)

    def _refuse_late(self, step: _Step) -> None:
        """Refuse the queued requests (of the first REFUSAL_SCAN, with no token yet) whose
        wait so far plus predicted TTFT from here is over the TTFT target: a prediction made
        on arrival can turn out optimistic (requests arriving together, a slower machine),
        and a request served late is not good anyway, while its prompt work delays the
        rest. The engine answers them with a 429."""
        ttft, now = self.config.target_ttft_s, step.now
        assert ttft is not None  # SchedulerConfig: shedding needs a TTFT target
        for req in list(itertools.islice(self.waiting, REFUSAL_SCAN)):
            if req.num_output_tokens or req.suspect:
                continue  # a stream already started, or one being isolated: served
            position = self.waiting.index(req)
            predicted = self.ttft.predict(req.num_prompt_tokens, req.max_tokens, now,
                                          position)
            if predicted is not None and now - req.arrival_time + predicted > ttft:
                self.waiting.remove(req)
                self.ttft.forget(req)
                step.out.refused.append(req)

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
            self.ttft.on_leave(time.perf_counter())
        elif req in self.waiting:
            self.waiting.remove(req)
        self.ttft.forget(req)
        req.status = status
        if req.suspect:  # aborted (or failed) before it ran alone
            req.suspect = False
            self.num_suspects -= 1
        self.kv.free(req)
        self.kv.forget(req)
