"""Run the real server (uvicorn + app) on 127.0.0.1 with a free port, in a thread."""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator

import httpx
import jsonschema
import openai
import uvicorn

from kvserve.engine.llm_engine import EngineArgs
from kvserve.entrypoints.server.app import build_app
from kvserve.entrypoints.server.args import ConnectionLimits, ServerArgs
from kvserve.entrypoints.server.connections import server_config


def openai_client(url: str, strict: bool = True, **kw) -> openai.OpenAI:
    """The official client on `url` (the server's root or its /v1), with no retries, and with
    `strict` validating every response and stream chunk against the SDK's own models
    (`_strict_response_validation`: by default it builds them from whatever JSON arrives, so
    a wrong `object` or a missing `id` would pass). `strict=False` only where the SDK's types
    are narrower than what OpenAI's own API sends (LOOSE_BECAUSE), with the envelope then
    checked by assert_completion_envelope."""
    return openai.OpenAI(**_client_kw(url, strict, kw))


def async_openai_client(url: str, strict: bool = True, **kw) -> openai.AsyncOpenAI:
    """openai_client's async twin."""
    return openai.AsyncOpenAI(**_client_kw(url, strict, kw))


# Where the openai SDK's strict validation refuses what OpenAI's API itself sends:
LOOSE_BECAUSE = (
    "legacy /v1/completions stream chunks carry finish_reason null until the last "
    "(CompletionChoice types it non-null; openai/openai-openapi#100)",
    "echo's first prompt token has no logprob: null in token_logprobs and top_logprobs",
    "embeddings are validated before the SDK decodes its default base64 encoding",
)


def _client_kw(url: str, strict: bool, kw: dict) -> dict:
    url = str(url).rstrip("/")
    return {"base_url": url if url.endswith("/v1") else f"{url}/v1", "api_key": "unused",
            "max_retries": 0, "_strict_response_validation": strict, **kw}


def assert_completion_envelope(c, model: str | None = None) -> None:
    """A /v1/completions response or stream chunk has OpenAI's envelope (what a loose client
    does not check): its id, object, created and model, and a finish reason OpenAI sends."""
    assert isinstance(c.id, str) and c.id.startswith("cmpl-"), c.id
    assert c.object == "text_completion", c.object
    assert isinstance(c.created, int) and c.created > 1_600_000_000, c.created
    assert isinstance(c.model, str) and (model is None or c.model == model), c.model
    for choice in c.choices:
        assert isinstance(choice.index, int)
        assert choice.finish_reason in (None, "stop", "length", "content_filter")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_in_thread(app, port: int, timeout: float = 120) -> tuple[uvicorn.Server,
                                                                  threading.Thread]:
    """Serve `app` on 127.0.0.1:`port` in a daemon thread; returns once /health answers 200
    (stop with `server.should_exit = True` and join the thread)."""
    state = getattr(app.state, "kvserve", None)
    limits = state.args.connections if state is not None else ConnectionLimits()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, limits, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server, thread
        except httpx.TransportError:
            pass
        if time.time() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError("server did not become healthy")
        time.sleep(0.1)


@contextlib.contextmanager
def run_server(engine_args: EngineArgs, **server_kw) -> Iterator[tuple[str, object]]:
    """Yields (base URL, app) once /health answers 200; stops the server afterwards."""
    port = free_port()
    args = ServerArgs(host="127.0.0.1", port=port, **server_kw)
    app = build_app(engine_args, args)
    server, thread = start_in_thread(app, port)
    app.state.uvicorn_server = server  # for tests that reach the connections
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)


def metric(url: str, name: str) -> float:
    """Value of a Prometheus gauge/counter sample from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([-0-9.e+]+)$", text, re.MULTILINE)
    if m is None:
        raise KeyError(name)
    return float(m.group(1))


# ----------------------------------------------------------------------------------------
# Every response a test receives from a kvserve server, checked against the OpenAPI document
# that server publishes (kvserve.entrypoints.server.schemas): JSON bodies whole, streams event
# by event.

_DOCS: dict[str, dict | None] = {}  # origin -> its /openapi.json (None: not a kvserve API)
_VALIDATORS: dict[tuple[str, str, str, str], jsonschema.protocols.Validator | None] = {}


def _openapi(origin: str) -> dict | None:
    if origin not in _DOCS:
        try:
            with urllib.request.urlopen(f"{origin}/openapi.json", timeout=10) as r:
                doc = json.load(r)
        except (urllib.error.URLError, OSError, ValueError):
            doc = None
        # the router's own document describes no bodies: only kvserve's is held to it
        _DOCS[origin] = doc if doc and doc.get("info", {}).get("title") == "kvserve" else None
    return _DOCS[origin]


def response_validator(doc: dict, method: str, path: str, status: int, media: str
                       ) -> jsonschema.protocols.Validator | None:
    """The validator of what `doc` says `method path` answers with `status` as `media`; None
    where the route describes no bodies (/health, the dashboard's). A described route that
    answers a status or a media type its document does not name fails."""
    op = doc["paths"].get(path, {}).get(method.lower())
    if op is None or "4XX" not in op.get("responses", {}):
        return None
    responses = op["responses"]
    described = responses.get(str(status)) or responses.get(f"{status // 100}XX")
    assert described is not None, f"{method} {path} answered {status}, which its OpenAPI " \
                                  f"document does not describe ({sorted(responses)})"
    content = described.get("content", {})
    assert media in content, f"{method} {path} answered {status} as {media!r}; its " \
                             f"document describes {sorted(content)}"
    schema = {**content[media]["schema"], "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


def _validator_for(request: httpx.Request, response: httpx.Response
                   ) -> jsonschema.protocols.Validator | None:
    url = request.url
    if url.host not in ("127.0.0.1", "localhost"):
        return None
    origin = f"{url.scheme}://{url.host}:{url.port}"
    media = response.headers.get("content-type", "").split(";")[0].strip()
    key = (origin, request.method, url.path, f"{response.status_code} {media}")
    if key not in _VALIDATORS:
        doc = _openapi(origin)
        _VALIDATORS[key] = None if doc is None else response_validator(
            doc, request.method, url.path, response.status_code, media)
    return _VALIDATORS[key]


def _refetched(request: httpx.Request, response: httpx.Response
               ) -> jsonschema.protocols.Validator | None:
    """_validator_for with the origin's document fetched again: a port the suite reuses may
    now be another server's (a router's, whose document describes no bodies)."""
    url = request.url
    origin = f"{url.scheme}://{url.host}:{url.port}"
    _DOCS.pop(origin, None)
    for key in [k for k in _VALIDATORS if k[0] == origin]:
        del _VALIDATORS[key]
    return _validator_for(request, response)


def _first_error(validator: jsonschema.protocols.Validator, body: object):
    error = jsonschema.exceptions.best_match(validator.iter_errors(body))
    while error is not None and error.context:  # a oneOf (a chunk, or an error event):
        error = max(error.context, key=lambda e: len(e.absolute_path))  # the deepest miss
    return error


def _check(validator: jsonschema.protocols.Validator, what: str, data: bytes,
           again=None) -> None:
    """`data` against `validator`; on a miss, against `again()`'s validator first (the
    document fetched anew; None: this server publishes none to hold it to)."""
    body = json.loads(data)
    error = _first_error(validator, body)
    if error is not None and again is not None:
        fresh = again()
        error = None if fresh is None else _first_error(fresh, body)
    assert error is None, f"{what} breaks the server's OpenAPI document at " \
        f"{'/'.join(map(str, error.absolute_path)) or '(body)'}: {error.message[:300]}"


class _ResponseChecker:
    """One response's check: `body` for a JSON body read whole, `feed` for a
    text/event-stream, each `data:` event checked as it completes."""

    def __init__(self, validator: jsonschema.protocols.Validator, what: str,
                 again=None) -> None:
        self.validator, self.what, self.again, self.buffer = validator, what, again, b""

    def body(self, data: bytes) -> None:
        _check(self.validator, self.what, data, self.again)

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    _check(self.validator, f"a chunk of {self.what}", line[5:], self.again)


def _is_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def _checked_streams(mod):
    """A byte stream of httpx-like module `mod` whose events are checked as they are read."""

    class CheckedStream(mod.SyncByteStream, mod.AsyncByteStream):
        def __init__(self, stream, checker: _ResponseChecker) -> None:
            self.stream, self.checker = stream, checker

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self.stream:
                self.checker.feed(chunk)
                yield chunk

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self.stream:
                self.checker.feed(chunk)
                yield chunk

        def close(self) -> None:
            self.stream.close()

        async def aclose(self) -> None:
            await self.stream.aclose()

    return CheckedStream


@contextlib.contextmanager
def _checks_on(mod) -> Iterator[None]:
    """openapi_checks on the transports of `mod` (httpx, or the httpx2 that the openai SDK
    sends with)."""
    sync_send = mod.HTTPTransport.handle_request
    async_send = mod.AsyncHTTPTransport.handle_async_request
    checked = _checked_streams(mod)

    def whole_body(request, response) -> _ResponseChecker | None:
        """The checker of a JSON body that must be read whole first; None when the response
        is not checked or is a stream (wrapped here, checked as it is read)."""
        validator = _validator_for(request, response)
        if validator is None:
            return None
        checker = _ResponseChecker(validator, f"{request.method} {request.url.path} "
                                              f"({response.status_code})",
                                   lambda: _refetched(request, response))
        if _is_stream(response):
            response.stream = checked(response.stream, checker)
            return None
        return checker

    def handle_request(self, request):
        response = sync_send(self, request)
        checker = whole_body(request, response)
        if checker is not None:
            body = b"".join(response.stream)
            response.stream.close()
            checker.body(body)
            response.stream = mod.ByteStream(body)
        return response

    async def handle_async_request(self, request):
        response = await async_send(self, request)
        checker = whole_body(request, response)
        if checker is not None:
            body = b"".join([c async for c in response.stream])
            await response.stream.aclose()
            checker.body(body)
            response.stream = mod.ByteStream(body)
        return response

    mod.HTTPTransport.handle_request = handle_request
    mod.AsyncHTTPTransport.handle_async_request = handle_async_request
    try:
        yield
    finally:
        mod.HTTPTransport.handle_request = sync_send
        mod.AsyncHTTPTransport.handle_async_request = async_send


@contextlib.contextmanager
def openapi_checks() -> Iterator[None]:
    """While open, every response from a kvserve server on this machine, to any httpx client
    (the openai and anthropic SDKs' included), is checked against that server's own OpenAPI
    document: a body or chunk it does not describe fails the request with the field named."""
    with contextlib.ExitStack() as stack:
        for name in ("httpx", "httpx2"):
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            stack.enter_context(_checks_on(mod))
        yield
