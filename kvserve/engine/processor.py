"""The output processor: the engine's front side, between callers and the engine core.

It owns everything about text and about callers' requests: tokenization (text prompts and
chat templates), both fan-outs (several prompts in one call, accepted or refused whole; n > 1,
where sample i of a request is its own scheduled request, seeded with seed + i, sharing the
prompt's KV blocks through the prefix cache), incremental detokenization and stop strings,
the outputs callers asked for (OutputKind), and the buffer of finished requests' timelines.
The core reports only new tokens per sample (CoreOutput); this side builds the callers'
RequestOutputs from them.

A stop string is found here, after the core appended the step's tokens: the request is then
finished in the core at once (this runs between two of its steps), with the tokens after the
stop string dropped, so its output is as if every token had come in a step of its own.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.engine.core import EngineCore, EngineDeadError
from kvserve.outputs import (
    CompletionOutput,
    CoreOutput,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    RequestTimes,
    TokenLogprobs,
)
from kvserve.request import Request, RequestStatus, timeline_segments
from kvserve.sample.sampling_params import SamplingParams
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer

Message = dict[str, str]


@dataclass
class _Sample:
    """One sample of a caller's request, as this side sees it."""

    request_id: str  # the core's id for it
    index: int
    detok: IncrementalDetokenizer
    times: RequestTimes
    want_logprobs: bool
    status: RequestStatus = RequestStatus.WAITING  # what the caller sees: finished or not
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)  # all output tokens so far
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    events: list[dict] | None = None  # the timeline, once finished
    sent_tokens: int = 0  # output tokens already handed out
    new_text: list[str] = field(default_factory=list)  # text not yet handed out

    @property
    def finished(self) -> bool:
        return self.status.finished


@dataclass
class _Group:
    """One caller request and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: OutputKind
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, core: EngineCore, tokenizer: Tokenizer, timeline_buffer_size: int
                 ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self._timelines: OrderedDict[str, dict] = OrderedDict()  # finished, newest last
        self._timeline_limit = timeline_buffer_size
        self._groups: dict[str, _Group] = {}
        self._samples: dict[str, tuple[_Group, _Sample]] = {}  # by the core's request id
        self._pending: list[RequestOutput] = []  # aborted requests' last outputs
        self._ids = itertools.count()

    # --------------------------------------------------------------------- tokenization

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs) -> list[int]:
        """The conversation's prompt ids (Tokenizer.encode_chat)."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt,
                                          continue_final_message, **template_kwargs)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    output_kind: OutputKind = OutputKind.CUMULATIVE) -> str:
        """Queue a request; a str prompt is tokenized (with BOS if the model wants one).
        `cache_salt` keeps its prefix-cache blocks apart from other salts (tenants);
        `output_kind` says what its outputs hold (see OutputKind).
        Raises ValueError, naming the problem, for anything that cannot be served."""
        (rid,) = self.add_requests([(request_id, prompt, params)], arrival_time, cache_salt,
                                   output_kind)
        return rid

    def add_requests(self, requests: Sequence[tuple[str | None, str | list[int],
                                                    SamplingParams | None]],
                     arrival_time: float | None = None, cache_salt: str | None = None,
                     output_kind: OutputKind = OutputKind.CUMULATIVE,
                     admit: Callable[[list[Request]], None] | None = None) -> list[str]:
        """Queue several requests (id, prompt, params) at once, as add_request does each, or
        none of them: every one is checked before any is queued, so a caller's batch of
        prompts (the API's list of prompts, the offline API's) is accepted or refused whole.
        `admit(the engine requests)`, called once all are checked, may refuse them by
        raising (a full queue: so a bad request learns it is bad, not that it should retry).
        Returns their ids (None ids get fresh ones)."""
        core = self.core
        if core.dead is not None:
            raise EngineDeadError(f"engine failed: {core.dead}")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        prepared: list[tuple[_Group, list[Request]]] = []
        ids: set[str] = set()
        for request_id, prompt, params in requests:
            group, reqs = self._prepare(request_id, prompt, params or SamplingParams(),
                                        arrival, cache_salt, output_kind)
            new = {group.request_id, *(r.request_id for r in reqs)}
            if new & ids:
                raise ValueError(f"request id {min(new & ids)!r} is given twice")
            ids |= new
            prepared.append((group, reqs))
        if admit is not None:
            admit([req for _, reqs in prepared for req in reqs])
        for group, reqs in prepared:
            for req, s in zip(reqs, group.samples, strict=True):
                core.add_request(req)
                self._samples[s.request_id] = (group, s)
            self._groups[group.request_id] = group
        return [group.request_id for group, _ in prepared]

    def _prepare(self, request_id: str | None, prompt: str | list[int],
                 params: SamplingParams, arrival: float, cache_salt: str | None,
                 output_kind: OutputKind) -> tuple[_Group, list[Request]]:
        """A request's group and its samples' core requests, checked but not queued."""
        core = self.core
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups or request_id in self._samples:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not 0 <= t < core.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, "
                                 f"{core.vocab_size}): {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        k = params.truncate_prompt_tokens
        if k is not None and len(ids) > k:
            ids, text = ids[-k:], None  # the text no longer is the prompt
        params.validate_vocab(core.vocab_size)
        room = core.max_model_len - len(ids)
        if room <= 0:
            raise ValueError(f"prompt has {len(ids)} tokens, max_model_len is "
                             f"{core.max_model_len}")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        group = _Group(request_id, text, ids, output_kind)
        eos = self.tokenizer.eos_token_ids
        reqs = []
        for i in range(params.n):
            sp = params.child(i) if params.n > 1 else params
            if i:  # the prompt's logprobs are the same for every sample: the first computes
                sp.prompt_logprobs = None  # them, the others may read the cached prefix
            req = Request(f"{request_id}#{i}" if params.n > 1 else request_id, ids, sp,
                          eos, max_tokens, arrival, cache_salt=cache_salt)
            if req.request_id in self._samples:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            core.check_request(req)
            reqs.append(req)
            group.samples.append(_Sample(req.request_id, i, IncrementalDetokenizer(
                self.tokenizer, sp.skip_special_tokens, sp.stop or (),
                sp.include_stop_str_in_output), RequestTimes.of(req), sp.logprobs is not None))
        return group, reqs

    def abort_request(self, request_id: str, error: str | None = None) -> bool:
        """Stop a request now and free its KV blocks; its final output (finish_reason "abort",
        and `error` when it failed) comes out of the next step. False if the id is unknown or
        already finished."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for s in group.samples:
            if not s.finished:
                self._end(s, RequestStatus.FINISHED_ABORTED,
                          self.core.finish_request(s.request_id, RequestStatus.FINISHED_ABORTED,
                                                   error=error))
        out = self._output(group)
        out.error = error
        self._pending.append(out)
        self._forget(group)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._pending)

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------------------ a step

    def process(self, core_outputs: list[CoreOutput]) -> list[RequestOutput]:
        """The callers' outputs for a step's core outputs (and the aborts since the last)."""
        outputs, self._pending = self._pending, []
        touched: dict[str, _Group] = {}
        for co in core_outputs:
            entry = self._samples.get(co.request_id)
            if entry is None:
                continue  # its group was aborted earlier in this loop
            group, sample = entry
            if co.error is not None:
                # One sample failed: the whole request fails with it.
                sample.times, sample.events = co.times, co.events
                self.abort_request(group.request_id, co.error)
                outputs.extend(self._pending)
                self._pending = []
                touched.pop(group.request_id, None)
                continue
            if co.prompt_logprobs is not None and group.prompt_logprobs is None:
                group.prompt_logprobs = co.prompt_logprobs  # every sample's are the same
            if co.embedding is not None:
                group.embedding = co.embedding
            try:
                self._append(sample, co)
            except Exception as e:
                self.abort_request(group.request_id, f"{type(e).__name__}: {e}")
                outputs.extend(self._pending)
                self._pending = []
                touched.pop(group.request_id, None)
                continue
            touched[group.request_id] = group
        for group in touched.values():
            outputs.append(self._output(group))
            if group.finished:
                self._forget(group)
        return outputs

    def _append(self, sample: _Sample, co: CoreOutput) -> None:
        """Detokenize the new tokens one at a time; a stop string ends the sample at the
        token that completed it (the tokens after it are dropped)."""
        sample.times = co.times
        for n, token in enumerate(co.new_token_ids, 1):
            sample.token_ids.append(token)
            if co.new_logprobs is not None:
                sample.logprobs.append(co.new_logprobs[n - 1])
            sample.new_text.append(sample.detok.add_tokens([token]))
            if sample.detok.stopped:
                sample.stop_reason = sample.detok.stop_reason
                last = co if co.finish is not None else self.core.finish_request(
                    sample.request_id, RequestStatus.FINISHED_STOPPED,
                    num_output_tokens=len(sample.token_ids))
                self._end(sample, RequestStatus.FINISHED_STOPPED, last)
                return
        if co.finish is not None:
            sample.stop_reason = co.stop_token
            self._end(sample, co.finish, co)

    def _end(self, sample: _Sample, status: RequestStatus, last: CoreOutput | None) -> None:
        """The sample is finished for the caller; `last` is the core's last output of it."""
        sample.status = status
        if not sample.detok.stopped:
            sample.new_text.append(sample.detok.finish())
        if last is not None:
            sample.times, sample.events = last.times, last.events

    # ------------------------------------------------------------------------- outputs

    def _output(self, group: _Group) -> RequestOutput:
        """The group's output for this step, holding what its OutputKind asks for: the new
        tokens, text and logprobs are sliced from the end, so only CUMULATIVE outputs (and
        the last one of FINAL_ONLY) cost more as a request grows."""
        kind = group.output_kind
        full = kind is OutputKind.CUMULATIVE or (kind is OutputKind.FINAL_ONLY
                                                 and group.finished)
        completions = []
        for s in group.samples:
            new_ids = s.token_ids[s.sent_tokens:]
            new_text = "".join(s.new_text)
            s.new_text.clear()
            logprobs = None
            if s.want_logprobs:
                logprobs = (list(s.logprobs) if full else s.logprobs[s.sent_tokens:]
                            if kind is OutputKind.DELTA else [])
            if full:
                text, token_ids = s.detok.text, list(s.token_ids)
            elif kind is OutputKind.DELTA:
                text, token_ids = new_text, new_ids
            else:
                text, token_ids = "", []
            completions.append(CompletionOutput(
                index=s.index,
                text=text,
                token_ids=token_ids,
                finish_reason=s.status.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=logprobs,
                delta_text=new_text,
                delta_token_ids=new_ids,
                num_output_tokens=len(s.token_ids),
            ))
            s.sent_tokens = len(s.token_ids)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            metrics=self._metrics(group),
            num_cached_tokens=group.samples[0].times.num_cached_tokens or 0,
            prompt_logprobs=group.prompt_logprobs,
            embedding=group.embedding,
        )

    @staticmethod
    def _metrics(group: _Group) -> RequestMetrics:
        return RequestMetrics.from_times([s.times for s in group.samples],
                                         sum(len(s.token_ids) for s in group.samples))

    # ------------------------------------------------------------------------ timelines

    def _forget(self, group: _Group) -> None:
        del self._groups[group.request_id]
        for s in group.samples:
            del self._samples[s.request_id]
        if self._timeline_limit:
            self._timelines[group.request_id] = self._timeline_json(group)
            while len(self._timelines) > self._timeline_limit:
                self._timelines.popitem(last=False)

    def request_timeline(self, request_id: str) -> dict | None:
        """The timeline of a running request or of one of the last `timeline_buffer_size`
        finished ones (JSON-ready), None when unknown or expired. Call it on the thread that
        steps the engine (AsyncEngine.call does, between steps)."""
        group = self._groups.get(request_id)
        if group is not None:
            return self._timeline_json(group)
        return self._timelines.get(request_id)

    def recent_timelines(self, recent: int = 20) -> list[dict]:
        """The newest finished requests' timelines and the oldest running ones'."""
        timelines = list(self._timelines.values())[-recent:]
        timelines += [self._timeline_json(g)
                      for g in itertools.islice(self._groups.values(), recent)]
        return [{"id": t["id"], "arrival_unix": t["arrival_unix"],
                 "finished": t["finished"], "breakdown": t["breakdown"],
                 "segments": timeline_segments(t["samples"][0]["events"])}
                for t in timelines]

    def _timeline_json(self, group: _Group) -> dict:
        metrics = self._metrics(group)
        samples = []
        for s in group.samples:
            status, events = s.status.value, s.events
            if not s.finished:
                live = self.core.request_status(s.request_id)
                if live is not None:
                    status, events = live
            samples.append({"index": s.index, "status": status,
                            "output_tokens": len(s.token_ids), "events": events or []})
        return {
            "id": group.request_id,
            "object": "request.timeline",
            "arrival_unix": round(metrics.arrival_time + self.core.wall_offset, 6),
            "finished": group.finished,
            "prompt_tokens": len(group.prompt_token_ids),
            "breakdown": metrics.as_dict(),
            "samples": samples,
        }
