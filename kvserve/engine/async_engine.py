"""The engine loop in a background thread, with one async stream of outputs per request.

The event loop never runs a model step: it only hands commands (add, abort) to the engine
thread and receives outputs from it. The engine thread builds and owns the LLMEngine; between
steps it applies the queued commands, so an add or an abort waits at most one step, and an
aborted request's KV blocks are free before the next step starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvserve.engine.llm_engine import EngineDeadError, LLMEngine
from kvserve.engine.metrics import EngineMetrics
from kvserve.outputs import OutputKind, RequestOutput
from kvserve.request import Request
from kvserve.sample.sampling_params import SamplingParams
from kvserve.stats import EngineStats

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-waiting-requests, or (with --shed-late-requests) a new
    request is predicted to miss its TTFT target: the client should retry after
    `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestStream"]


@dataclass
class _Add:
    requests: list[tuple[str, str | list[int], SamplingParams]]
    arrival: float
    cache_salt: str | None
    output_kind: OutputKind
    done: asyncio.Future = field(repr=False)


@dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    done: asyncio.Future = field(repr=False)


class RequestStream:
    """Outputs of one request, the last one finished. `close()` aborts it if unfinished;
    callers must close in a `finally` so a vanished client frees its KV blocks."""

    def __init__(self, engine: AsyncEngine, request_id: str,
                 output_kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        self.engine = engine
        self.request_id = request_id
        self.output_kind = output_kind
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.engine.abort(self.request_id)
        self.engine._streams.pop(self.request_id, None)


class AsyncEngine:
    """Owns an LLMEngine on a thread of its own; see the module docstring."""

    def __init__(self, make_engine: Callable[[], LLMEngine],
                 metrics: EngineMetrics | None = None,
                 max_waiting_requests: int | None = None) -> None:
        self._make_engine = make_engine
        self.engine: LLMEngine | None = None
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        # Published by the engine thread after every step and read anywhere: an immutable
        # snapshot replaced whole, never changed in place.
        self.stats: EngineStats | None = None
        self._queued_since_stats = 0  # engine requests queued since `stats` was taken

    # ------------------------------------------------------------------ event-loop side

    async def start(self) -> LLMEngine:
        """Build the engine on the engine thread, then run the step loop there; returns once
        the model is loaded (raising what loading raised).

        Loading and stepping share one thread on purpose: with torch's OpenMP backend, a
        thread that runs parallel ops after another thread already did pays for a second
        thread team, which slowed decode steps by a third where it was measured."""
        self._loop = asyncio.get_running_loop()
        loaded = self._loop.create_future()

        def main() -> None:
            try:
                self.engine = self._make_engine()
                self._publish_state()
            except BaseException as e:
                self._resolve(loaded, e)
                return
            self._resolve(loaded, None)
            self._run()

        self._thread = threading.Thread(target=main, name="kvserve-engine", daemon=True)
        self._thread.start()
        await loaded
        assert self.engine is not None
        return self.engine

    def stop(self, timeout: float = 120.0) -> None:
        """Stop the loop after the current step; the engine then persists its prefix cache
        (disk tier) on its own thread."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_running(self) -> int:
        return self.stats.running if self.stats is not None else 0

    @property
    def num_waiting(self) -> int:
        return self.stats.waiting if self.stats is not None else 0

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run `fn(engine)` on the engine thread between two steps (so it sees the engine
        at rest) and return what it returns; for reads that need more than `stats` holds,
        such as a running request's timeline. Waits at most one step."""
        if self._error is not None or self._thread is None or not self._thread.is_alive():
            raise EngineDeadError(self.health_error() or "the engine is not running")
        assert self._loop is not None
        done = self._loop.create_future()
        self._send(_Call(fn, done))
        return await done

    def health_error(self) -> str | None:
        """Why the engine cannot serve, or None (read from the event loop; never steps)."""
        if self._error is not None:
            return f"engine loop died: {self._error}"
        engine = self.engine
        if engine is None:
            return None
        if engine.dead is not None:
            return f"engine failed: {engine.dead}"
        return engine.workers.status() if engine.workers is not None else None

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, cache_salt: str | None = None,
                          output_kind: OutputKind = OutputKind.CUMULATIVE) -> RequestStream:
        """Queue a request and wait (at most one step) until the engine has accepted it.
        With OutputKind.FINAL_ONLY its stream yields only the last output.

        Raises ValueError (bad request), QueueFullError or EngineDeadError; otherwise returns
        the stream of its outputs."""
        (stream,) = await self.add_requests([(request_id, prompt, params)], cache_salt,
                                            output_kind)
        return stream

    async def add_requests(self, requests: list[tuple[str, str | list[int], SamplingParams]],
                           cache_salt: str | None = None,
                           output_kind: OutputKind = OutputKind.CUMULATIVE
                           ) -> list[RequestStream]:
        """add_request for several (id, prompt, params) at once: the engine accepts all of
        them or none (OutputProcessor.add_requests), and a full queue refuses them whole."""
        reason = self.health_error()
        if reason is not None:
            raise EngineDeadError(reason)
        ids = [rid for rid, _, _ in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be distinct")
        for rid in ids:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
        assert self._loop is not None and self.engine is not None, "start() the engine first"
        done = self._loop.create_future()
        streams = [RequestStream(self, rid, output_kind) for rid in ids]
        for stream in streams:
            self._streams[stream.request_id] = stream
        self._send(_Add(list(requests), time.perf_counter(), cache_salt, output_kind, done))
        try:
            await done
        except BaseException:  # rejected, or the caller went away while waiting
            for stream in streams:
                stream.close()
            raise
        return streams

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; the request is aborted if the caller stops early."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        engine = self.engine
        assert engine is not None
        try:
            while not self._stopping:
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    engine.check_health()  # a tensor-parallel rank may die while idle
                    if engine.has_unfinished_requests():
                        continue
                    self._publish_state()
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = engine.step()
                now = time.perf_counter()
                if self.metrics is not None:
                    for out in outputs:
                        self.metrics.observe_output(out, now)
                # One wake-up of the event loop per step, not one per request.
                self._deliver_all([(out.request_id, out) for out in outputs])
                self._publish_state()
            engine.close()
            self._fail_commands(EngineDeadError("the engine has stopped"))
        except BaseException as e:  # a bug in the loop itself: fail everyone, loudly
            log.exception("engine loop died")
            self._error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine loop died: {e}"))
            self._fail_commands(EngineDeadError(f"engine loop died: {e}"))

    def _apply_commands(self) -> None:
        def admit(reqs: list[Request]) -> None:
            """--max-waiting-requests, checked after the requests themselves: the waiting
            count of the last snapshot plus what was queued since; then --shed-late-requests:
            a request whose predicted time to first token is over the target is refused now
            rather than served late (its first token would not count as goodput anyway)."""
            limit = self.max_waiting_requests
            n = len(reqs)
            if limit is not None and self.num_waiting + self._queued_since_stats + n > limit:
                raise QueueFullError(f"{limit} requests already waiting")
            sched = self.engine.config.scheduler
            if sched.shed_late_requests and sched.target_ttft_s is not None:
                longest = max(reqs, key=lambda r: r.num_prompt_tokens)
                predicted = self.engine.core.predicted_ttft(longest.num_prompt_tokens,
                                                            longest.max_tokens)
                if predicted is not None and predicted > sched.target_ttft_s:
                    raise QueueFullError(
                        f"predicted time to first token {predicted:.1f} s exceeds the target "
                        f"{sched.target_ttft_s:.1f} s (--target-ttft-ms)",
                        max(1, math.ceil(predicted - sched.target_ttft_s)))
            self._queued_since_stats += n

        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_requests(cmd.requests, cmd.arrival, cmd.cache_salt,
                                             cmd.output_kind, admit)
                except Exception as e:  # ValueError: the client's fault; else ours
                    self._resolve(cmd.done, e)
                else:
                    self._resolve(cmd.done, None)
            elif isinstance(cmd, _Call):
                try:
                    result = cmd.fn(self.engine)
                except Exception as e:
                    self._resolve(cmd.done, e)
                else:
                    self._resolve(cmd.done, None, result)
            else:
                self.engine.abort_request(cmd[1])

    def _fail_commands(self, error: BaseException) -> None:
        """The loop has ended: answer every add and call still queued with `error`."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add | _Call):
                self._resolve(cmd.done, error)

    def _resolve(self, fut: asyncio.Future, error: BaseException | None,
                 result: object = None) -> None:
        def settle() -> None:
            if fut.done():
                return
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

        self._call(settle)

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        def put() -> None:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if (stream.output_kind is OutputKind.FINAL_ONLY
                        and isinstance(item, RequestOutput) and not item.finished):
                    continue  # counted by the metrics on the engine thread; nothing to show
                stream.queue.put_nowait(item)
                if isinstance(item, BaseException) or item.finished:
                    # The consumer holds the stream; forget it here too, so one that is never
                    # read to the end (or never closed) cannot leak.
                    del self._streams[request_id]

        if items:
            self._call(put)

    def _call(self, fn: Callable[[], None]) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(fn)

    def _publish_state(self) -> None:
        assert self.engine is not None
        self.stats = stats = self.engine.stats()
        self._queued_since_stats = 0
        if self.metrics is not None:
            self.metrics.observe_stats(stats)
