"""Fault injection, for tests and soaks only: off unless the KVSERVE_FAULTS environment
variable holds a JSON object naming the faults, e.g.

    KVSERVE_FAULTS='{"disk_write": "ENOSPC", "request_error": "fault-", "slow_step_s": 0.3}'

Each fault sits at the place where the real failure would surface, so what is tested is
the server's own handling of it, not a mock's:

- `disk_write`: "ENOSPC" or "EIO": the disk KV tier's file write raises that OSError.
- `disk_read`: "corrupt" (one payload byte flipped, as a bad sector would) or "EIO".
- `disk_every`: only every n-th disk write or read is hit (default 1: all of them).
- `request_error`: a request whose id contains this string fails when its first token is
  handled (the per-request path of the engine core), as a bug in one request's processing
  would.
- `step_error`: a model step that holds a request whose id contains this string raises
  (the whole-step path: that step's requests fail).
- `slow_step_s` and `slow_every`: every n-th step sleeps that long before it runs, as an
  overloaded or throttled machine would.

The variable is read once per process (engine processes and tensor-parallel ranks inherit
it), and a process with faults on says so in its log at start. `install()` sets them in
this process for a test.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field, fields

log = logging.getLogger(__name__)

ENV = "KVSERVE_FAULTS"
_ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}


class InjectedFault(RuntimeError):
    """Raised by an injected fault (never by real code)."""


@dataclass
class Faults:
    disk_write: str | None = None
    disk_read: str | None = None
    disk_every: int = 1
    request_error: str | None = None
    step_error: str | None = None
    slow_step_s: float = 0.0
    slow_every: int = 1
    _writes: itertools.count = field(default_factory=itertools.count, repr=False)
    _reads: itertools.count = field(default_factory=itertools.count, repr=False)
    _steps: itertools.count = field(default_factory=itertools.count, repr=False)

    def __post_init__(self) -> None:
        if self.disk_write not in (None, *_ERRNOS):
            raise ValueError(f"{ENV}: disk_write must be one of {sorted(_ERRNOS)}")
        if self.disk_read not in (None, "corrupt", "EIO"):
            raise ValueError(f"{ENV}: disk_read must be 'corrupt' or 'EIO'")
        if self.disk_every < 1 or self.slow_every < 1 or self.slow_step_s < 0:
            raise ValueError(f"{ENV}: disk_every and slow_every must be >= 1, "
                             "slow_step_s >= 0")

    @classmethod
    def parse(cls, text: str) -> Faults:
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{ENV} is not JSON: {e}") from None
        names = {f.name for f in fields(cls) if not f.name.startswith("_")}
        if not isinstance(spec, dict) or set(spec) - names:
            raise ValueError(f"{ENV} must be a JSON object with keys among {sorted(names)}")
        return cls(**spec)

    # -- the hooks, each called where the real failure would surface

    def on_disk_write(self) -> None:
        if self.disk_write is not None and next(self._writes) % self.disk_every == 0:
            code = _ERRNOS[self.disk_write]
            raise OSError(code, f"{os.strerror(code)} (injected)")

    def on_disk_read(self, raw: bytes) -> bytes:
        if self.disk_read is None or next(self._reads) % self.disk_every:
            return raw
        if self.disk_read == "EIO":
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected)")
        if not raw:
            return raw
        flipped = bytearray(raw)
        flipped[len(flipped) // 2] ^= 0x01
        return bytes(flipped)

    def on_request(self, request_id: str) -> None:
        if self.request_error is not None and self.request_error in request_id:
            raise InjectedFault(f"injected failure of request {request_id}")

    def on_step(self, request_ids: list[str]) -> None:
        if self.slow_step_s and next(self._steps) % self.slow_every == 0:
            time.sleep(self.slow_step_s)
        if self.step_error is not None and any(self.step_error in r for r in request_ids):
            raise InjectedFault("injected failure of a model step")


def _from_env() -> Faults | None:
    text = os.environ.get(ENV, "")
    if not text:
        return None
    faults = Faults.parse(text)
    log.warning("fault injection is ON (%s=%s): for tests only", ENV, text)
    return faults


_active: Faults | None = _from_env()


def active() -> Faults | None:
    """The faults in force in this process, None (the production case) when there are none."""
    return _active


def install(faults: Faults | None) -> Faults | None:
    """Put `faults` in force in this process (None: none); returns what was in force."""
    global _active
    previous, _active = _active, faults
    return previous
