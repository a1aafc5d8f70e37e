"""Connection guards (kvserve.entrypoints.server.connections) on a tiny model, with raw
sockets as the slow and greedy clients: silent and half-sent heads (slowloris), a body that
stops, a client that stops reading its stream, and more connections than the cap. The server
answers or closes each, frees what they held, and keeps serving everyone else, /health
included."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from kvserve import faults
from kvserve.engine.llm_engine import EngineArgs
from kvserve.entrypoints.server.args import ConnectionLimits
from kvserve.faults import Faults
from tests.server_utils import run_server

LIMITS = ConnectionLimits(header_timeout=0.5, read_timeout=0.5, write_timeout=1.0,
                          keep_alive_timeout=1.0, max_connections=8)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=4,
                      num_kv_blocks=512)
    with run_server(args, served_model_name="tiny", connections=LIMITS) as (url, app):
        yield url, int(url.rsplit(":", 1)[1]), app.state.uvicorn_server


def connect(port: int) -> socket.socket:
    s = socket.socket()
    s.connect(("127.0.0.1", port))
    s.settimeout(10)
    return s


def read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def error_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def completion(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "hello", "max_tokens": 4})


def test_a_silent_connection_is_closed(server):
    url, port, _ = server
    s = connect(port)
    t0 = time.monotonic()
    assert read_all(s) == b""  # closed without a word: nothing was asked
    assert time.monotonic() - t0 < 5
    assert completion(url).status_code == 200


def test_a_half_sent_head_gets_408(server):
    url, port, _ = server
    s = connect(port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/js")
    t0 = time.monotonic()
    status, err = error_of(read_all(s))
    assert status == 408 and err["param"] == "--header-timeout", err
    assert 0.4 < time.monotonic() - t0 < 5
    assert completion(url).status_code == 200


def test_a_body_that_stops_gets_408(server):
    url, port, _ = server
    s = connect(port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: 200\r\n\r\n{\"model\": \"tiny\", ")
    status, err = error_of(read_all(s))
    assert status == 408 and err["param"] == "--read-timeout", err
    assert completion(url).status_code == 200


def test_a_body_refused_early_is_not_answered_twice(server):
    """A body announced over --max-request-size is refused (413) before it is read; the
    client that then sends nothing more is closed, with no 408 after the 413."""
    url, port, _ = server
    s = connect(port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: 900000000\r\n\r\n{")
    raw = read_all(s)
    assert raw.startswith(b"HTTP/1.1 413") and raw.count(b"HTTP/1.1") == 1, raw
    assert completion(url).status_code == 200


def test_a_keep_alive_connection_idle_after_its_response_is_closed(server):
    url, port, _ = server
    s = connect(port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /hea")  # the next head, never finished
    rest = read_all(s)
    assert error_of(rest)[0] == 408


def test_more_connections_than_the_cap_get_429_and_health_still_answers(server):
    url, port, _ = server
    idle = [connect(port) for _ in range(LIMITS.max_connections + 2)]
    time.sleep(0.1)  # let the server accept them
    r = completion(url)
    assert r.status_code == 429 and r.json()["error"]["param"] == "--max-connections"
    assert r.headers["retry-after"] == "1"
    h = httpx.get(f"{url}/health", timeout=5)
    assert h.status_code == 200  # probes are answered whatever the load
    for s in idle:  # the idle ones are dropped by the header timeout, freeing the places
        assert read_all(s) == b""
    assert completion(url).status_code == 200


@pytest.mark.slow
def test_a_client_that_stops_reading_is_disconnected_and_its_request_freed(server):
    """Slow steps (20 ms each) make the 500-token stream last over 10 s. Its client reads
    nothing; the kernel's socket buffers (megabytes on loopback) would take long to fill, so
    the transport's signal that its buffer is full is given as the transport gives it. After
    the write timeout (1 s) the client is cut off and its request aborted, long before the
    stream could have ended."""
    url, port, uv = server
    previous = faults.install(Faults(slow_step_s=0.02))
    try:
        s = connect(port)
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 500,
                           "ignore_eos": True, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        (proto,) = [c for c in uv.server_state.connections
                    if c.client[1] == s.getsockname()[1]]
        proto.loop.call_soon_threadsafe(proto.pause_writing)
        t0 = time.monotonic()
        while httpx.get(f"{url}/v1/engine/stats", timeout=5).json()["running"]:
            assert time.monotonic() - t0 < 6, "the stalled stream's request kept running"
            time.sleep(0.1)
        assert time.monotonic() - t0 > LIMITS.write_timeout * 0.9
        integrity = httpx.get(f"{url}/v1/engine/integrity", timeout=10).json()
        assert integrity["ok"] and integrity["kv_free_blocks"] == integrity["kv_blocks"]
        with pytest.raises((ConnectionResetError, AssertionError)):
            assert b"data: [DONE]" in read_all(s)  # cut off: reset, or ended short
    finally:
        faults.install(previous)
    assert completion(url).status_code == 200
