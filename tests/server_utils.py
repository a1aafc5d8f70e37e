"""Run the real server (uvicorn + app) on 127.0.0.1 with a free port, in a thread."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import uvicorn

from kvserve.engine.llm_engine import EngineArgs
from kvserve.server.app import ServerArgs, build_app
from kvserve.server.connections import ConnectionLimits, server_config


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
