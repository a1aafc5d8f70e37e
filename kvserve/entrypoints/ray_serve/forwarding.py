"""One HTTP request as the ingress hands it to a replica through a DeploymentHandle, and its
run through the replica's own FastAPI app. Imports neither ray nor torch.

The replica runs the request through its ASGI app as a server would (the body once, then a
disconnect when the caller goes away) and yields what the app sends: first the response's
status and headers, then each piece of its body as it is sent, so a stream passes through
unchanged and an error keeps its status and OpenAI error body."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    # the prompt's chained block hashes (route_key.route_key; empty: route by load)
    route_key: tuple[int, ...] = ()
    # the replica that must answer (its Ray Serve replica id): a stored response's owner
    pin: str | None = None


@dataclass(frozen=True)
class ResponseStart:
    """The first thing a forwarded request yields; body pieces (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == key), None)


async def run_asgi(app: ASGIApp, req: ForwardedRequest, client: tuple[str, int] | None = None
                   ) -> AsyncIterator[ResponseStart | bytes]:
    """`req` through `app`: a ResponseStart, then the body's pieces. Closing the iterator
    early tells the app its client went away, as a dropped connection would."""
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": req.method, "scheme": "http",
        "path": req.path, "raw_path": req.path.encode(), "root_path": "",
        "query_string": req.query_string, "headers": list(req.headers),
        "client": client, "server": None,
    }
    sent: asyncio.Queue[Message | BaseException | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def call() -> None:
        try:
            await app(scope, receive, send)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
            await sent.put(e)
            return
        await sent.put(None)

    task = asyncio.create_task(call())
    try:
        while True:
            message = await sent.get()
            if message is None:
                return
            if isinstance(message, BaseException):
                raise message
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 5.0)  # the app sees the disconnect and stops
