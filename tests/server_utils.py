"""Run the real server (uvicorn + app) on 127.0.0.1 with a free port, in a thread."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from kvserve.engine.llm_engine import EngineArgs
from kvserve.server.app import ServerArgs, build_app
from kvserve.server.connections import ConnectionLimits, server_config


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
