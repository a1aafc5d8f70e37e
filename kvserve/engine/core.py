"""The engine core: the scheduler, model runner, KV cache and speculative decoding.

It serves scheduled requests (`Request`, one per sample, already tokenized) and reports what
each step did to each of them as `CoreOutput`s holding only the new tokens. It knows nothing
of text, stop strings, n > 1 groups or output kinds: that is the output processor's side
(engine.processor). One step: drafts are proposed, the scheduler picks what runs, the runner
computes and samples, and the core appends the tokens (stopping at a stop token or the
length limit) and releases finished requests.

Readers on other threads use `stats()`'s snapshots (published by AsyncEngine), never the
parts themselves.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from kvserve import faults
from kvserve.engine.calibration import StartupCalibration
from kvserve.engine.kv_events import KVEventPublisher, make_publisher
from kvserve.engine.startup import CoreParts, StartupConfig, build_parts
from kvserve.kv_cache.events import KVEventBatch
from kvserve.outputs import LATE_REFUSAL, CoreOutput, RequestTimes
from kvserve.request import Request, RequestStatus
from kvserve.sched.output import SchedulerOutput
from kvserve.stats import EngineStats, SpecState, StepRecord, TierState
from kvserve.worker.model_runner import ModelRunnerOutput
from kvserve.worker.tp_workers import TensorParallelError

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine can no longer serve (its loop died, or a tensor-parallel rank failed)."""


class EngineCore(StartupCalibration):
    def __init__(self, config: StartupConfig, parts: CoreParts | None = None) -> None:
        """Run `parts` (by default built from `config` by engine.startup.build_parts): the loaded
        tokenizer is `tokenizer`, for the front. With a latency target (or the default step
        budget), the step cost model is calibrated before the first request."""
        parts = parts if parts is not None else build_parts(config)
        args = config.args
        self.dead: str | None = None  # why the engine can no longer step, once it cannot
        self.config, self.model_config = parts.config, parts.model_config
        self.tokenizer, self.grammars = parts.tokenizer, parts.grammars
        self.quantization, self.kv_layout = parts.quantization, parts.kv_layout
        self.runner, self.kv, self.scheduler = parts.runner, parts.kv, parts.scheduler
        self.speculation, self.workers = parts.speculation, parts.workers
        self._speculative_config = args.speculative_config  # the calibration cache's key
        self._data_parallel_rank = args.data_parallel_rank  # in each KV-event batch
        targets = config.targets
        self.steps: deque[StepRecord] = deque(maxlen=max(args.step_buffer_size, 1))
        self._keep_steps = args.step_buffer_size > 0
        self._record_timelines = args.timeline_buffer_size > 0
        self._num_steps = 0
        self.wall_offset = time.time() - time.perf_counter()  # perf_counter -> unix time
        self._requests: dict[str, Request] = {}
        self._pending: list[CoreOutput] = []
        self._step_start: tuple | None = None  # a step's timings until record_step
        self.itl_budget_default = args.target_itl_ms is None  # the default step budget
        self.calibration_seconds: float | None = None
        self.calibration_kept = False  # replayed from the start-up cache (calibration_cache)
        # KV-cache events: the manager logs them, each step's go to the publisher after it
        self.kv_events: KVEventPublisher | None = None
        try:
            if config.kv_events is not None and self.kv.events is not None:
                self.kv_events = make_publisher(config.kv_events)
            if args.target_itl_ms != 0 or targets.ttft_s is not None:
                self.calibrate()
                self._resolve_itl_budget()
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.close()
            if self.workers is not None:
                self.workers.close(timeout=1.0)
            raise

    def _run_to_end(self) -> None:
        """Step until every request added has finished (the calibration's requests)."""
        while self.has_unfinished_requests():
            self.step()
            self.record_step()
        self._pending.clear()

    # ------------------------------------------------------------------ requests in and out

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def check_request(self, req: Request) -> None:
        """Raise ValueError, naming the problem, if `req` could never be served."""
        if self.dead is not None:
            raise EngineDeadError(f"engine failed: {self.dead}")
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.scheduler.check_request(req)
        spec = req.sampling_params.structured_outputs
        if spec is not None:
            self.grammars.check(spec)  # raises StructuredOutputError; cached for the add

    def add_request(self, req: Request) -> None:
        """Queue `req` (checked by check_request first); the core owns it from now on."""
        self.check_request(req)
        sp = req.sampling_params
        if sp.structured_outputs is not None or sp.thinking_budget is not None:
            req.grammar = self.grammars.compile(sp.structured_outputs, sp.thinking_budget)
        req.timeline.record = self._record_timelines
        req.timeline.add(req.arrival_time, "arrival", prompt_tokens=req.num_prompt_tokens)
        self.scheduler.add_request(req)
        self._requests[req.request_id] = req

    def finish_request(self, request_id: str, status: RequestStatus,
                       num_output_tokens: int | None = None, error: str | None = None
                       ) -> CoreOutput | None:
        """End a request now and free its KV blocks (an abort, or a stop string the front
        found); with `num_output_tokens`, the tokens after that many are dropped first (a
        stop string inside a step's speculative tokens). Returns its last output, None if
        the id is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if num_output_tokens is not None:
            extra = req.num_output_tokens - num_output_tokens
            if extra > 0:
                del req.output_token_ids[-extra:]
                del req.all_token_ids[-extra:]
        self._finish(req, status)
        if error and req.timeline.events:
            req.timeline.events[-1][2]["error"] = error
        return self._final(req, [], None, status, error=error)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def request_status(self, request_id: str) -> tuple[str, list[dict]] | None:
        """A running request's status and timeline events (JSON), None when unknown."""
        req = self._requests.get(request_id)
        return None if req is None else (req.status.value, req.timeline.as_json())

    def predicted_ttft(self, num_prompt_tokens: int, max_tokens: int) -> float | None:
        """Seconds to the first token of a request of this shape queued now
        (sched.ttft.TTFTPredictor.predict); None while the step cost model knows too little."""
        return self.scheduler.ttft.predict(num_prompt_tokens, max_tokens)

    # ------------------------------------------------------------------------------ a step

    def step(self) -> list[CoreOutput]:
        """Run one batch (see _step); what it did to the prefix cache goes out as one batch
        of KV-cache events, when they are on."""
        try:
            return self._step()
        finally:
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Hand the events logged since the last call to the publisher (which only queues
        them); none: no batch."""
        events = self.kv.events
        if self.kv_events is None or events is None or not len(events):
            return
        # 0 unless --data-parallel-rank (a replica's), as vLLM's engines send it
        self.kv_events.publish(KVEventBatch(time.time(), events.take(),
                                            self._data_parallel_rank))

    def reset_prefix_cache(self) -> None:
        """Forget every block hash in the pool, as vLLM's reset_prefix_cache does (after new
        weights, or between benchmark runs); the lower tiers keep theirs. Published at once
        as AllBlocksCleared, then the tiers' blocks again."""
        self.kv.reset_prefix_cache()
        self._publish_kv_events()

    def _step(self) -> list[CoreOutput]:
        """Run one batch. A failure is confined to the requests it touches: if the model step
        raises, its requests are retried one per step and only those that fail alone fail
        (Scheduler.quarantine); if handling one request's new token raises, only that request
        fails. Failed requests come out finished (aborted) with `error` set. Call
        `record_step` once the outputs are handled, so the step profiler's output phase
        includes that."""
        t0 = time.perf_counter()
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        t1 = time.perf_counter()
        sched = self.scheduler.schedule()
        for req in sched.refused:
            self._fail(req.request_id, LATE_REFUSAL)
        t2 = time.perf_counter()
        kv_io = self._move_kv(sched) if sched.kv_transfers else 0.0
        self._step_start = None
        if sched.is_empty:
            return self._take_pending()
        injected = faults.active()  # None outside tests
        try:
            if injected is not None:
                injected.on_step([s.request.request_id for s in sched.scheduled])
            result = self.runner.execute(sched)
        except TensorParallelError as e:
            self._die(str(e))
            return self._take_pending()
        except Exception as e:
            self.kv.discard_step()  # blocks registered for this step hold no valid K/V
            guilty = self.scheduler.quarantine(sched)
            log.exception("model step of %d requests failed; failing %d, retrying the others "
                          "one per step", len(sched.scheduled), len(guilty))
            for req in guilty:
                self._fail(req.request_id, f"{type(e).__name__}: {e}")
            return self._take_pending()
        self.scheduler.update_after_step(sched)
        self.kv.after_step()
        for request_id, lps in result.prompt_logprobs:
            self._requests[request_id].prompt_logprobs.extend(lps)  # all still running here
        for request_id, vec, count in result.pooled:
            req = self._requests[request_id]
            req.pooled.append(vec)
            req.num_pooled += count
        outputs = self._take_pending()
        outputs += self._new_tokens(sched, result, injected)
        self._step_start = (sched, result.timings, t0, t1, t2, kv_io)
        return outputs

    def _move_kv(self, sched: SchedulerOutput) -> float:
        """The step's prefix-cache tier copies, before its forward; blocks that fail to load
        are recomputed. Returns the seconds they took."""
        t0 = time.perf_counter()
        assert self.kv.store is not None
        t = sched.kv_transfers
        failed = self.kv.store.execute(t.saves, t.loads)
        if failed:
            log.warning("%d prefix-cache blocks failed to load; recomputing them", len(failed))
            self.scheduler.recompute_failed_loads(sched, failed)
        return time.perf_counter() - t0

    def _new_tokens(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                    injected: faults.Faults | None) -> list[CoreOutput]:
        """Each sampling request's new tokens (or its embedding) appended and handed out; a
        request whose handling raises fails alone."""
        now = time.perf_counter()
        outputs: list[CoreOutput] = []
        hidden = result.hidden or [None] * len(result.token_ids)
        sampled = iter(zip(result.token_ids, result.logprobs, hidden, strict=True))
        for s in sched.scheduled:
            if not s.samples:
                continue
            req = s.request
            if req.sampling_params.pooling is not None:  # its prompt is done: the embedding
                outputs.append(self._embedded(req, now))
                continue
            tokens, logprobs, h = next(sampled)
            if s.num_drafts:
                assert self.speculation is not None
                self.speculation.verified(req, s.num_drafts, len(tokens) - 1)
            if req.request_id not in self._requests:
                continue  # it failed earlier in this loop
            try:
                if injected is not None:
                    injected.on_request(req.request_id)
                out = self._append(req, tokens, logprobs, now)
                if out.finish is None:
                    if self.speculation is not None:
                        self.speculation.observe_hidden(req, h)
                    if s.num_drafts:
                        self.scheduler.rollback(req)
            except Exception as e:
                log.exception("request %s failed", req.request_id)
                self._fail(req.request_id, f"{type(e).__name__}: {e}")
                continue
            outputs.append(out)
        return outputs

    def record_step(self) -> None:
        """Close the step profiler's record of the step just run (no-op after an empty or
        failed step)."""
        if self._step_start is None:
            return
        sched, timings, t0, t1, t2, kv_io = self._step_start
        self._step_start = None
        self._num_steps += 1
        t_end = time.perf_counter()
        shape = sched.shape
        # The whole step, output handling included, is the gap a decoding request sees.
        self.scheduler.observe_step(shape, t_end - t0)
        if self.speculation is not None and shape.prefill_tokens == 0:
            # Drafting (before t1) apart: the coordinator weighs a draft against the rest.
            self.speculation.observe_step(shape.decode_rows, t_end - t1)
        if not self._keep_steps:
            return
        t3 = t2 + kv_io + sum(timings.get(k, 0.0)
                              for k in ("prepare", "forward", "grammar", "sample"))
        drafts = sum(s.num_drafts for s in sched.scheduled)
        self.steps.append(StepRecord(
            self._num_steps, t0 + self.wall_offset, len(sched.scheduled),
            shape.prefill_tokens, shape.decode_rows,
            drafts, len(sched.preempted), t1 - t0, t2 - t1, timings.get("prepare", 0.0),
            timings.get("forward", 0.0), timings.get("sample", 0.0), max(t_end - t3, 0.0),
            t_end - t0, timings.get("all_reduce", 0.0), kv_io, timings.get("grammar", 0.0),
            len(sched.requeued), len(sched.refused),
            {k.removeprefix("layers."): v for k, v in timings.items()
             if k.startswith("layers.")}))

    def _append(self, req: Request, tokens: list[int], logprobs: list, now: float
                ) -> CoreOutput:
        """Add a step's tokens (several after speculation) to a request one at a time,
        checking the stop rules after each; tokens after a stop are dropped, exactly as if
        they had been generated one per step."""
        want_lp = req.sampling_params.logprobs is not None
        prompt_lps = None  # handed out once, with the first token
        if req.sampling_params.prompt_logprobs is not None and not req.num_output_tokens:
            prompt_lps = [None, *req.prompt_logprobs]
        for n, token in enumerate(tokens, 1):
            req.append_token(token)
            if req.timeline.first_token is None:
                req.timeline.first_token = now
                req.timeline.add(now, "first_token")
                self.scheduler.ttft.on_first_token(req, now)
            status = req.check_stop_token()
            if status is not None:
                stop = token if (status is RequestStatus.FINISHED_STOPPED
                                 and token not in req.eos_token_ids) else None
                self._finish(req, status, now)
                out = self._final(req, tokens[:n], logprobs[:n] if want_lp else None,
                                  status, stop)
                out.prompt_logprobs = prompt_lps
                return out
        return CoreOutput(req.request_id, list(tokens), list(logprobs) if want_lp else None,
                          RequestTimes.of(req), prompt_logprobs=prompt_lps)

    def _embedded(self, req: Request, now: float) -> CoreOutput:
        """An embedding request whose prompt is computed: its pooled, L2-normalised final
        hidden state, and it finishes."""
        states = torch.cat(req.pooled)
        vec = states.mean(0) if req.sampling_params.pooling == "mean" else states[-1]
        req.timeline.first_token = now
        self._finish(req, RequestStatus.FINISHED_STOPPED, now)
        out = self._final(req, [], None, RequestStatus.FINISHED_STOPPED)
        out.embedding = torch.nn.functional.normalize(vec, dim=0).tolist()
        return out

    def _final(self, req: Request, tokens: list[int], logprobs: list | None,
               status: RequestStatus, stop_token: int | None = None,
               error: str | None = None) -> CoreOutput:
        """A finished request's last output; the core forgets it."""
        self._requests.pop(req.request_id, None)
        return CoreOutput(req.request_id, tokens, logprobs, RequestTimes.of(req), status,
                          stop_token, error,
                          req.timeline.as_json() if req.timeline.record else None)

    def _fail(self, request_id: str, error: str) -> None:
        out = self.finish_request(request_id, RequestStatus.FINISHED_ABORTED, error=error)
        if out is not None:
            self._pending.append(out)

    def _finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        if self.speculation is not None:
            self.speculation.forget(req)
        req.timeline.finished = time.perf_counter() if now is None else now
        req.timeline.add(req.timeline.finished, "finished", reason=status.finish_reason)
        self.scheduler.finish(req, status)

    def _take_pending(self) -> list[CoreOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    def check_health(self) -> str | None:
        """Why the engine cannot serve, or None. Notices a tensor-parallel worker that died
        while the engine was idle (and then fails the engine as a failed step would)."""
        if self.dead is None and self.workers is not None:
            reason = self.workers.status()
            if reason is not None:
                self._die(reason)
        return self.dead

    def _die(self, reason: str) -> None:
        """A failure the engine cannot step past: fail every request with `reason`; later
        adds raise EngineDeadError."""
        log.error("engine failed: %s; failing %d requests", reason, len(self._requests))
        self.dead = reason
        for request_id in list(self._requests):
            self._fail(request_id, reason)

    # ------------------------------------------------------------------------- reporting

    def stats(self) -> EngineStats:
        """A snapshot of the engine now, made of copies (see EngineStats)."""
        sched, kv = self.scheduler, self.kv
        tiers: tuple[TierState, ...] = ()
        if kv.store is not None:
            st = kv.store.stats
            tiers = tuple(TierState(t.name, len(t), getattr(t, "capacity", None),
                                    st.loads.get(t.name, 0), st.saves.get(t.name, 0))
                          for t in kv.store.tiers)
        spec = None
        if self.speculation is not None:
            c, t = self.speculation.config, self.speculation.stats
            spec = SpecState(c.method, c.num_speculative_tokens, c.max_batch_size,
                             c.min_acceptance, t.num_drafts, t.num_accepted, t.num_rounds,
                             t.num_steps_off, tuple(t.drafts_at), tuple(t.accepted_at))
        return EngineStats(
            num_steps=self._num_steps, running=len(sched.running), waiting=len(sched.waiting),
            num_preemptions=sched.num_preemptions, kv_usage=kv.usage,
            kv_blocks=kv.num_blocks, kv_free_blocks=kv.num_free_blocks,
            block_size=kv.block_size, tiers=tiers, prefix_queried_tokens=kv.stats.queries,
            prefix_hit_tokens=tuple(kv.stats.hits.items()), spec=spec,
            steps=tuple(self.steps) if self._keep_steps else (),
            step_cost=None if (c := sched.cost.coef) is None else tuple(map(float, c)),
            prompt_allowance=sched.prompt_allowance, ttft_calibration=sched.ttft.calibration,
            target_itl_s=sched.config.target_itl_s, itl_default=self.itl_budget_default,
            sizing=sched.sizing(), itl_warning=self.itl_warning(),
            step_cost_drift=sched.cost.drift)

    def close(self) -> None:
        """Persist the prefix cache to the disk tier, when there is one (a clean shutdown),
        close the KV-event publisher's sockets and stop the tensor-parallel workers."""
        if self.kv.store is not None and any(t.name == "disk" for t in self.kv.store.tiers):
            t0 = time.perf_counter()
            written = self.kv.flush_to_disk()
            log.info("flushed %d KV blocks to disk in %.1fs", written,
                     time.perf_counter() - t0)
        if self.kv_events is not None:
            self._publish_kv_events()  # the flush's own stores, then the sockets close
            self.kv_events.close()
            self.kv_events = None
        if self.workers is not None:
            self.workers.close()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if not self.scheduler.has_unfinished:
            assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"
