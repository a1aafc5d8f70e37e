"""What the engine hands back to callers, one RequestOutput per request per step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.request import Request, RequestStatus


@dataclass
class TokenLogprobs:
    """One sampled token's logprob (raw: of the model's logits, see sample.sampler), its rank
    and the top alternatives a request asked for."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank in the raw distribution; 1 + number of strictly larger logprobs
    top: list[tuple[int, float]]  # (token id, logprob), len = requested logprobs, descending


@dataclass
class RequestMetrics:
    """Timings of one request in seconds (perf_counter clock). queue = arrival to first step,
    prefill = first step to first token, decode = first token to finish, tpot = decode time
    per output token after the first."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0  # ... and accepted
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    preempted_time: float = 0.0  # waiting between preemption and resume (within decode or
    # prefill time, whichever it interrupted)

    @property
    def queue_time(self) -> float | None:
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def ttft(self) -> float | None:
        return _span(self.arrival_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _span(self.first_token_time, self.finished_time)

    @property
    def e2e_time(self) -> float | None:
        return _span(self.arrival_time, self.finished_time)

    @property
    def tpot(self) -> float | None:
        d = self.decode_time
        n = self.num_generation_tokens - 1
        return None if d is None or n <= 0 else d / n

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "queue_time": self.queue_time, "prefill_time": self.prefill_time,
            "ttft": self.ttft, "decode_time": self.decode_time, "tpot": self.tpot,
            "e2e_time": self.e2e_time, "num_preemptions": self.num_preemptions,
            "preempted_time": self.preempted_time,
            "prompt_tokens_computed": self.num_prompt_tokens - self.num_cached_prompt_tokens,
            "prompt_tokens_cached": self.num_cached_prompt_tokens,
            **({"num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens}
               if self.num_draft_tokens else {}),
        }

    @classmethod
    def from_times(cls, times: list[RequestTimes], num_generation_tokens: int
                   ) -> RequestMetrics:
        """One request's metrics from its samples' times (merged for n > 1)."""
        done = [t.finished for t in times]
        return cls(
            arrival_time=min(t.arrival for t in times),
            first_scheduled_time=_min([t.first_scheduled for t in times]),
            first_token_time=_min([t.first_token for t in times]),
            finished_time=None if None in done else max(done),  # type: ignore[type-var]
            num_preemptions=sum(t.num_preemptions for t in times),
            num_prompt_tokens=times[0].num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            num_draft_tokens=sum(t.num_drafted for t in times),
            num_accepted_tokens=sum(t.num_accepted for t in times),
            num_cached_prompt_tokens=times[0].num_cached_tokens or 0,
            preempted_time=sum(t.preempted_time for t in times),
        )


@dataclass(frozen=True)
class RequestTimes:
    """The instants and counts of one scheduled request (a sample), as the engine core
    reports them with every output: a copy, O(1) to make."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    num_preemptions: int
    preempted_time: float
    num_drafted: int
    num_accepted: int
    num_prompt_tokens: int
    num_cached_tokens: int | None  # prompt tokens served by the prefix cache at admission

    @classmethod
    def of(cls, req: Request) -> RequestTimes:
        t = req.timeline
        return cls(t.arrival, t.first_scheduled, t.first_token, t.finished, t.num_preemptions,
                   t.preempted_time, t.num_drafted, t.num_accepted, req.num_prompt_tokens,
                   req.num_cached_tokens)


# The `error` of a queued request refused because it is predicted to miss its TTFT target
# (--shed-late-requests, Scheduler._recover): the server answers it with a 429.
LATE_REFUSAL = "refused: predicted to miss its TTFT target (--target-ttft-ms)"


@dataclass
class CoreOutput:
    """What one step did to one scheduled request (a sample), from the engine core to the
    output processor: only the new tokens, so its size does not grow with the request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    times: RequestTimes
    # set when the core finished the request: a stop token or length (then the tokens end
    # there), an abort, or a failure (`error`)
    finish: RequestStatus | None = None
    stop_token: int | None = None  # the stop token (not EOS) that ended it
    error: str | None = None
    events: list[dict] | None = None  # once finished: its timeline (JSON), when recorded
    # with its first token, when asked for: one entry per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # an embedding request's result (it then finishes)


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _min(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


class OutputKind(enum.Enum):
    """What a request's outputs hold, chosen by its caller when adding it (vLLM's
    RequestOutputKind). A step costs the same whatever the request's length in DELTA and
    FINAL_ONLY; CUMULATIVE copies everything so far into every output."""

    CUMULATIVE = "cumulative"  # text, token_ids and logprobs: everything so far
    DELTA = "delta"  # text, token_ids and logprobs: only what is new since the last output
    # outputs before the last hold no text, token ids or logprobs (counts and metrics only);
    # the last holds everything
    FINAL_ONLY = "final_only"


@dataclass
class CompletionOutput:
    """One sample of a request. `text`, `token_ids` and `logprobs` hold what the request's
    OutputKind says; `delta_*` always hold only what is new since the previous output and
    `num_output_tokens` always counts every token so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed inside the engine
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first sample)
    # when asked for (SamplingParams.prompt_logprobs), from the first output on: one entry
    # per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # embedding requests (SamplingParams.pooling)
