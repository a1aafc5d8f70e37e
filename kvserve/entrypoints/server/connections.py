"""Connection guards: what a slow, idle or greedy client may hold of the server.

uvicorn's h11 protocol closes a connection idle between requests (keep-alive), but not one
that sends half a request head and stops (slowloris), a body that trickles or stops, or a
client that stops reading a stream. Each of those holds a socket, and a stalled reader also
holds its request's KV blocks, for as long as it likes. `GuardedH11` adds, per connection:

- header timeout: a request head must arrive whole within `header_timeout` of the
  connection opening (or of the previous response ending); else 408 (silence if no byte
  came) and close;
- read timeout: while a body is being received, at most `read_timeout` without a byte
  (time the server itself stops reading does not count); else 408 and close;
- write timeout: a client that reads nothing for `write_timeout` while the server has data
  for it is disconnected, which aborts its requests and frees their blocks;
- a connection cap: beyond `max_connections` open connections, each new one gets a 429
  naming the flag and is closed (the idle ones drop out by the timeouts above); /health
  is still answered on it.

`server_config` builds the uvicorn config with them; `kvserve serve` and the tests use it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.entrypoints.server.args import ConnectionLimits
from kvserve.entrypoints.server.errors import error_body


def _raw_error(status: int, reason: str, message: str, param: str) -> bytes:
    body = json.dumps(error_body(status, message, param)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def _over_cap_app(limit: int, real_app: Any):
    """429 for everything but /health, which a load balancer's probe must always reach."""
    body = json.dumps(error_body(429, f"this server holds at most {limit} connections "
                                      "(--max-connections); retry later",
                                 "--max-connections")).encode()

    async def app(scope, receive, send) -> None:
        if scope.get("path") == "/health":
            await real_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 429, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    return app


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the header, read and write timeouts and the connection
    cap of `limits` (a subclass per limits, made by `protocol_for`)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        now = self.loop.time()
        self._head_since = now  # waiting for a request head since
        self._head_bytes = False  # any byte of that head arrived
        self._last_read = now
        self._write_stalled_since: float | None = None
        if len(self.connections) > self.limits.max_connections:
            self.app = _over_cap_app(self.limits.max_connections, self.app)
        self._watch: asyncio.TimerHandle | None = self.loop.call_later(
            self.limits.tick, self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        if self.conn.their_state is h11.IDLE:
            self._head_bytes = True
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._head_since, self._head_bytes = self.loop.time(), False
        super().on_response_complete()

    def pause_writing(self) -> None:
        self._write_stalled_since = self.loop.time()
        super().pause_writing()

    def resume_writing(self) -> None:
        self._write_stalled_since = None
        super().resume_writing()

    def _check(self) -> None:
        self._watch = None
        if self.transport.is_closing():
            return
        now, lim, state = self.loop.time(), self.limits, self.conn.their_state
        if state is h11.IDLE and now - self._head_since > lim.header_timeout:
            if self._head_bytes:
                self._refuse(f"the request head did not arrive within {lim.header_timeout:g} "
                             "s (--header-timeout)", "--header-timeout")
            else:
                self.transport.close()
            return
        if (state is h11.SEND_BODY and not self.flow.read_paused
                and now - self._last_read > lim.read_timeout):
            if self.cycle is not None and self.cycle.response_started:
                self.transport.close()  # answered already (say a 413): the rest is not read
            else:
                self._refuse(f"no byte of the request body for {lim.read_timeout:g} s "
                             "(--read-timeout)", "--read-timeout")
            return
        stalled = self._write_stalled_since
        if stalled is not None and now - stalled > lim.write_timeout:
            self.logger.info("closing a connection whose client read nothing for %g s "
                             "(--write-timeout)", lim.write_timeout)
            self.transport.abort()  # its data cannot be flushed; connection_lost follows
            return
        self._watch = self.loop.call_later(lim.tick, self._check)

    def _refuse(self, message: str, param: str) -> None:
        """Answer 408 and close (no response has started in the states this is called in)."""
        self.logger.debug("closing a slow connection: %s", message)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()  # the app's pending receive() sees a disconnect
        self.transport.write(_raw_error(408, "Request Timeout", message, param))
        self.transport.close()


def protocol_for(limits: ConnectionLimits) -> type[GuardedH11]:
    return type("GuardedH11", (GuardedH11,), {"limits": limits})


def server_config(app: Any, host: str, port: int, limits: ConnectionLimits,
                  **kw: Any) -> uvicorn.Config:
    """A uvicorn config serving `app` with `limits` on every connection, on asyncio's own
    event loop: uvicorn's "auto" would take uvloop wherever it is installed (the Ray extra
    installs it), and the server's behaviour and timings would hang on that."""
    return uvicorn.Config(app, host=host, port=port, http=protocol_for(limits),
                          timeout_keep_alive=limits.keep_alive_timeout,
                          **{"loop": "asyncio", **kw})
