"""What the scheduler hands the engine for one step: the requests scheduled and how many new
tokens each computes, the preempted, requeued and refused, and the tier copies the step needs
first. A message: the worker and the drafters read it, only the scheduler builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv_cache.manager import KVTransfers
from kvserve.request import Request
from kvserve.sched.slo import StepShape


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
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # prefix-cache tier copies the step needs before its forward (done by the engine core)
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)
    attended: int = 0  # (query, key) pairs its queries attend to, for the step cost model
    # Scheduler._recover: running requests sent back to the queue, and queued ones refused
    # as predicted to miss their TTFT target (the engine fails them with LATE_REFUSAL)
    requeued: list[Request] = field(default_factory=list)
    refused: list[Request] = field(default_factory=list)

    @property
    def shape(self) -> StepShape:
        prefill = sum(s.num_new_tokens for s in self.scheduled if s.prefill)
        return StepShape(prefill, self.num_tokens - prefill, self.attended)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
