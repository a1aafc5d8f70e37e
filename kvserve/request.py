"""A request as the scheduler sees it.

The one counter that matters is `num_computed_tokens`: how many of `all_token_ids` already
have their K/V in the cache. A step closes part of the gap `num_tokens - num_computed_tokens`;
prompt chunks, prefix-cache hits, recompute after preemption and decode are the same case.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvserve.sample.sampling_params import SamplingParams
from kvserve.sample.structured import Grammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass
class RequestTimeline:
    """What happened to one request and when (time.perf_counter seconds).

    The instants give the breakdown (RequestMetrics): queue = arrival -> first_scheduled,
    prefill = first_scheduled -> first_token, decode = first_token -> finished. `events` is
    the full story, in order: [t, kind, data] with kind one of arrival, prefix_hit (tokens,
    per tier), prefill (a chunk: tokens, batch), decode (a run of consecutive decode steps
    merged into one event: steps, tokens, batch sizes, drafted/accepted), first_token,
    preempted (tokens of K/V lost), resumed, finished (reason). Merging decode steps keeps a
    long generation's timeline a handful of entries.
    """

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    preempted_time: float = 0.0  # seconds spent waiting between preemption and resume
    preempted_at: float | None = None  # the latest preemption
    num_drafted: int = 0  # speculative decoding: drafts verified
    num_accepted: int = 0  # ... and accepted
    events: list[list] = field(default_factory=list)
    record: bool = True  # False: keep the instants only, no events (timelines off)

    def add(self, t: float, kind: str, **data) -> None:
        if self.record:
            self.events.append([t, kind, data])

    def add_step(self, t: float, prefill: bool, tokens: int, batch: int) -> None:
        """One engine step that ran `tokens` of this request among `batch` requests."""
        if not self.record:
            return
        last = self.events[-1] if self.events else None
        if prefill or last is None or last[1] != "decode":
            self.add(t, "prefill" if prefill else "decode", tokens=tokens, batch=batch,
                     **({} if prefill else {"steps": 1, "end": t, "batch_max": batch,
                                            "batch_min": batch, "drafted": 0,
                                            "accepted": 0}))
            return
        d = last[2]
        d["steps"] += 1
        d["tokens"] += tokens
        d["end"] = t
        d["batch"] += batch  # summed here, a mean in the JSON
        d["batch_max"] = max(d["batch_max"], batch)
        d["batch_min"] = min(d["batch_min"], batch)

    def add_spec(self, drafted: int, accepted: int) -> None:
        """Verification result of the newest decode step."""
        self.num_drafted += drafted
        self.num_accepted += accepted
        if self.events and self.events[-1][1] == "decode":
            self.events[-1][2]["drafted"] += drafted
            self.events[-1][2]["accepted"] += accepted

    def as_json(self) -> list[dict]:
        """Events with times in seconds after arrival."""
        out = []
        for t, kind, data in self.events:
            e = {"t": round(t - self.arrival, 6), "event": kind, **data}
            if kind == "decode":
                e["end"] = round(data["end"] - self.arrival, 6)
                e["batch"] = round(data["batch"] / data["steps"], 2)
            out.append(e)
        return out


def timeline_segments(events: list[dict]) -> list[tuple[str, float, float]]:
    """(kind, start, end) segments of a timeline's JSON events (RequestTimeline.as_json):
    queue until first scheduled; each prefill chunk until the next event; decode runs; waits
    between preemption and resume."""
    segments = []
    for i, e in enumerate(events):
        nxt = events[i + 1]["t"] if i + 1 < len(events) else e["t"]
        kind = e["event"]
        if kind == "arrival":
            segments.append(("queue", e["t"], nxt))
        elif kind == "prefill":
            segments.append(("prefill", e["t"], nxt))
        elif kind == "decode":
            segments.append(("decode", e["t"], max(e["end"], nxt)))
        elif kind == "preempted":
            segments.append(("preempted", e["t"], nxt))
    return [s for s in segments if s[2] >= s[1]]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    arrival_time: float = field(default_factory=time.perf_counter)
    cache_salt: str | None = None  # isolates this request's prefix-cache blocks (tenants)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Block tables of KV groups 1, 2, ... (models mixing sliding-window and whole-context
    # layers, see kv_cache.layout); block_ids is group 0's.
    group_tables: list[list[int]] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens served from the cache at admission
    # Speculative decoding: unverified tokens after all_token_ids, scheduled like any other
    # token; verification turns the accepted ones into output and drops the rest. draft_probs
    # [k, V] is the distribution each draft was sampled from (None: the drafter gives tokens
    # only, taken as one-hot).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    # Structured outputs: the matcher of its constraint, advanced by every output token
    # (set by the engine core when it accepts the request).
    grammar: Grammar | None = None
    # Prompt logprobs (sampling_params.prompt_logprobs): the sampler's TokenLogprobs of
    # prompt tokens 1, 2, ..., filled chunk by chunk as the prompt is computed.
    prompt_logprobs: list = field(default_factory=list)
    # Embedding requests (sampling_params.pooling): the final hidden states of the first
    # `num_pooled` positions, chunk by chunk (mean), or the last position's (last). Summed
    # only at the end, in one order, so the embedding does not depend on the chunking.
    pooled: list[torch.Tensor] = field(default_factory=list)
    num_pooled: int = 0
    # Failed model steps this request was in. After one, it runs in a step of its own
    # (`suspect`) until one succeeds: a failure alone, or a second one, is its own.
    num_failed_steps: int = 0
    suspect: bool = False
    timeline: RequestTimeline = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.timeline = RequestTimeline(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_drafts(self) -> int:
        return len(self.all_token_ids) + len(self.draft_token_ids)

    def token_at(self, i: int) -> int:
        """Token i of all_token_ids followed by the drafts."""
        n = len(self.all_token_ids)
        return self.all_token_ids[i] if i < n else self.draft_token_ids[i - n]

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_probs = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        if self.grammar is not None:
            self.grammar.accept(token_id)  # raises if the mask let through a forbidden token
            if self.grammar.spent:  # nothing left to mask: no more steps pay for one
                self.grammar = None
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop_token(self) -> RequestStatus | None:
        """Stop on length, a stop token or a completed grammar after the newest token. Stop
        strings are matched on text by the detokenizer, outside the scheduler."""
        sp = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and last in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED  # complete: it allows no further token
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
