"""The engine core in a process of its own (`EngineArgs.engine_process`).

`CoreProcess` has EngineCore's interface as the output processor uses it, and forwards every
call over a pipe to a spawned process that holds the real EngineCore. Messages are small
dataclasses pickled by `multiprocessing`; the child answers each call before it reads the
next, so the order of adds, aborts and steps is exactly that of the in-thread engine and a
request's tokens do not depend on which one serves it. A step's reply carries its outputs and
the stats snapshot, so publishing stats costs no second round trip.

The child ignores SIGINT (the parent decides when to stop) and exits when its pipe closes, so
it never outlives the server. If it dies, every later call raises EngineDeadError.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvserve.engine.core import EngineCore, EngineDeadError
from kvserve.engine.core_api import core_calls
from kvserve.engine.startup import StartupConfig
from kvserve.outputs import CoreOutput
from kvserve.request import Request, RequestStatus
from kvserve.stats import EngineStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Call:
    method: str
    args: tuple = ()


@dataclass(frozen=True)
class _Reply:
    value: object = None
    error: BaseException | None = None


@dataclass(frozen=True)
class _Facts:
    """What does not change after loading, sent once."""

    model_config: object
    config: object
    quantization: str
    max_model_len: int
    vocab_size: int
    wall_offset: float


# What the parent may ask for; anything else is a bug on its side.
# Core's calls the child answers by calling its core: all but step (it runs record_step too
# and sends the stats with its outputs), record_step (done with the step) and close (the pipe
# closing ends the child), which the proxy handles itself.
_CALLS = core_calls() - {"step", "record_step", "close"}


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(e))  # noqa: S301 - our own bytes, just made
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _serve(conn: Connection, config: StartupConfig) -> None:
    """The child: build the core, then answer calls until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        core = EngineCore(config)
    except BaseException as e:
        conn.send(_Reply(error=_portable(e)))
        return
    conn.send(_Reply(_Facts(core.model_config, core.config, core.quantization,
                            core.max_model_len, core.vocab_size, core.wall_offset)))
    try:
        while True:
            try:
                call = conn.recv()
            except EOFError:
                break
            if call is None:
                break
            try:
                if call.method == "step":
                    outputs = core.step()
                    core.record_step()
                    value: object = (outputs, core.stats())
                elif call.method == "num_unfinished":
                    value = core.num_unfinished
                elif call.method in _CALLS:
                    value = getattr(core, call.method)(*call.args)
                else:
                    raise AttributeError(f"the engine core has no call {call.method!r}")
                reply = _Reply(value)
            except Exception as e:
                reply = _Reply(error=_portable(e))
            try:
                conn.send(reply)
            except (TypeError, AttributeError, pickle.PicklingError) as e:  # a bug: say so
                conn.send(_Reply(error=RuntimeError(f"engine core reply to {call.method!r} "
                                                    f"cannot be sent: {e}")))
    finally:
        core.close()


class CoreProcess:
    """EngineCore behind a pipe; see the module docstring."""

    workers = None  # tensor parallelism is not supported here (refused at start)
    tokenizer = None  # the parent loads its own

    def __init__(self, config: StartupConfig) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, config), name="kvserve-core")
        self._proc.start()
        child.close()
        self.dead: str | None = None
        self._facts: _Facts | None = None
        self._stats: EngineStats | None = None  # the last step's, until something changes

    def wait_ready(self) -> None:
        """Wait until the child has loaded the model (raising what loading raised)."""
        facts = self._receive()
        assert isinstance(facts, _Facts)
        self._facts = facts
        self.model_config, self.config = facts.model_config, facts.config
        self.quantization, self.max_model_len = facts.quantization, facts.max_model_len
        self.vocab_size, self.wall_offset = facts.vocab_size, facts.wall_offset

    def _receive(self) -> object:
        try:
            reply = self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._gone() from e
        if reply.error is not None:
            raise reply.error
        return reply.value

    def _call(self, method: str, *args) -> object:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if method in ("add_request", "finish_request"):
            self._stats = None
        try:
            self._conn.send(_Call(method, args))
        except OSError as e:  # BrokenPipeError among them
            raise self._gone() from e
        return self._receive()

    def _gone(self) -> EngineDeadError:
        self._proc.join(1.0)
        self.dead = f"the engine core process exited (code {self._proc.exitcode})"
        return EngineDeadError(self.dead)

    # EngineCore's interface, as the output processor and LLMEngine use it.

    def check_request(self, req: Request) -> None:
        self._call("check_request", req)

    def add_request(self, req: Request) -> None:
        self._call("add_request", req)

    def finish_request(self, request_id: str, status: RequestStatus,
                       num_output_tokens: int | None = None, error: str | None = None
                       ) -> CoreOutput | None:
        return self._call("finish_request", request_id, status, num_output_tokens,
                          error)  # type: ignore[return-value]

    def has_unfinished_requests(self) -> bool:
        return bool(self._call("has_unfinished_requests"))

    @property
    def num_unfinished(self) -> int:
        return int(self._call("num_unfinished"))  # type: ignore[arg-type]

    def request_status(self, request_id: str) -> tuple[str, list[dict]] | None:
        return self._call("request_status", request_id)  # type: ignore[return-value]

    def predicted_ttft(self, num_prompt_tokens: int, max_tokens: int) -> float | None:
        return self._call("predicted_ttft", num_prompt_tokens,  # type: ignore[return-value]
                          max_tokens)

    def step(self) -> list[CoreOutput]:
        outputs, self._stats = self._call("step")  # type: ignore[misc]
        return outputs

    def record_step(self) -> None:
        """Done in the child, right after its step."""

    def stats(self) -> EngineStats:
        if self._stats is None:
            self._stats = self._call("stats")  # type: ignore[assignment]
        assert self._stats is not None
        return self._stats

    def check_health(self) -> str | None:
        if self.dead is None and not self._proc.is_alive():
            self.dead = f"the engine core process exited (code {self._proc.exitcode})"
        if self.dead is not None:
            return self.dead
        return self._call("check_health")  # type: ignore[return-value]

    def check_integrity(self) -> None:
        self._call("check_integrity")

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")

    def close(self) -> None:
        """Stop the child (it persists the prefix cache first, as EngineCore.close does)."""
        if self._proc.is_alive():
            with contextlib.suppress(OSError):  # it died meanwhile: nothing to tell
                self._conn.send(None)
            self._proc.join(120.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(1.0)
        self._conn.close()
