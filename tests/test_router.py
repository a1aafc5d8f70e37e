"""`kvserve router` in front of two tiny-model replicas: the three policies, streaming passed
through, and a replica killed and restarted under load."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from kvserve.engine.llm_engine import EngineArgs
from kvserve.entrypoints.router import Router, RouterConfig, build_router_app
from kvserve.entrypoints.server.app import build_app
from kvserve.entrypoints.server.args import ServerArgs
from tests.server_utils import assert_completion_envelope, free_port, openai_client, start_in_thread

pytestmark = pytest.mark.slow


class Replica:
    """A kvserve server in a thread that can be stopped and started again on its port."""

    def __init__(self, model_dir) -> None:
        self.args = EngineArgs(model=str(model_dir), dtype="float32", max_num_seqs=8)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        app = build_app(self.args, ServerArgs(port=self.port))
        self.server, self.thread = start_in_thread(app, self.port)

    def stop(self) -> None:
        assert self.server is not None and self.thread is not None
        self.server.should_exit = True
        self.thread.join(30)


class RouterServer:
    def __init__(self, urls: list[str], policy: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_router_app(RouterConfig(urls, policy, health_interval=0.2))
        self.server, self.thread = start_in_thread(app, self.port)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def sent(self) -> dict[str, float]:
        """Requests sent per replica URL, from the router's own metrics."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith("kvserve_router:requests_total{"):
                url = line.split('replica="')[1].split('"')[0]
                out[url] = out.get(url, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir):
    reps = [Replica(tiny_llama_dir), Replica(tiny_llama_dir)]
    for r in reps:
        r.start()
    yield reps
    for r in reps:
        r.stop()


def complete(url: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_round_robin_and_streaming(replicas):
    router = RouterServer([r.url for r in replicas], "round-robin")
    try:
        for i in range(4):
            assert complete(router.url, f"hello {i}").status_code == 200
        assert router.sent() == {replicas[0].url: 2.0, replicas[1].url: 2.0}
        client = openai_client(f"{router.url}/v1", strict=False)  # LOOSE_BECAUSE
        direct = openai_client(f"{replicas[0].url}/v1")
        want = direct.completions.create(model=client.models.list().data[0].id,
                                         prompt="abc", max_tokens=6, temperature=0)
        chunks = list(client.completions.create(model=want.model, prompt="abc", max_tokens=6,
                                                temperature=0, stream=True))
        for c in chunks:
            assert_completion_envelope(c, want.model)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
        assert complete(router.url, "x").json()["object"] == "text_completion"
        bad = httpx.post(f"{router.url}/v1/completions", content=b"{nope", timeout=10)
        assert bad.status_code == 400 and "error" in bad.json()
        body = {"max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": "hi"}]}
        via = httpx.post(f"{router.url}/v1/messages", json=body, timeout=60)
        assert via.status_code == 200, via.text
        direct_msg = httpx.post(f"{replicas[0].url}/v1/messages", json=body, timeout=60)
        assert via.json()["content"] == direct_msg.json()["content"]
    finally:
        router.stop()


def test_responses_continue_on_the_replica_that_stored_them(replicas):
    """Each replica keeps its own stored responses: through a round-robin router, a chain of
    previous_response_id turns (whole and streamed) and GET/DELETE of a stored response
    still reach the replica that made it; an id no replica made is a 404."""
    router = RouterServer([r.url for r in replicas], "round-robin")
    try:
        client = openai_client(f"{router.url}/v1")
        model = client.models.list().data[0].id
        first = client.responses.create(model=model, input="Say hi.", max_output_tokens=4,
                                        temperature=0)
        previous, ids = first.id, [first.id]
        for turn in range(4):
            if turn % 2:
                # (max_output_tokens ends it incomplete, which the SDK's stream() helper
                # refuses: read the events.)
                events = list(client.responses.create(
                    model=model, input="More.", max_output_tokens=4, temperature=0,
                    previous_response_id=previous, stream=True))
                assert events[-1].type == "response.incomplete"
                previous = events[0].response.id
            else:
                previous = client.responses.create(model=model, input="More.",
                                                   max_output_tokens=4, temperature=0,
                                                   previous_response_id=previous).id
            ids.append(previous)
        assert len(set(ids)) == 5
        for rid in ids:
            assert client.responses.retrieve(rid).id == rid
        client.responses.delete(ids[0])
        for gone in (ids[0], "resp_nobodymadethis"):
            r = httpx.get(f"{router.url}/v1/responses/{gone}", timeout=10)
            assert r.status_code == 404 and r.json()["error"]["message"], r.text
        assert sum(router.sent().values()) >= 11
    finally:
        router.stop()


def test_least_outstanding_avoids_the_busy_replica(replicas):
    router = RouterServer([r.url for r in replicas], "least-outstanding")
    try:
        body = {"prompt": "long one", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as s:
            lines = s.iter_lines()
            next(lines)  # in flight on one replica now
            busy = next(u for u, n in router.sent().items() if n == 1)
            for i in range(3):
                assert complete(router.url, f"short {i}").status_code == 200
            sent = router.sent()
            assert sent[busy] == 1  # every short request went to the other one
            assert sum(sent.values()) == 4
    finally:
        router.stop()


def test_prefix_aware_keeps_a_prefix_on_one_replica(replicas):
    router = RouterServer([r.url for r in replicas], "prefix-aware")
    try:
        system_a = "You are a helpful assistant for gardening questions. " * 5  # > 256 chars
        system_b = "You answer questions about the history of trains in detail. " * 5
        for i in range(3):
            assert complete(router.url, system_a + f"question {i}").status_code == 200
        first = router.sent()
        assert len(first) == 1  # all three on one replica
        # Other prefixes spread over the (idle) replicas by their hash.
        for topic in ("trains", "boats", "bread", "stars", "rivers", "chess"):
            prompt = system_b.replace("trains", topic) + "question"
            assert complete(router.url, prompt).status_code == 200
        assert len(router.sent()) == 2
        # and prefix A still goes where it went
        owner = next(iter(first))
        before = router.sent()[owner]
        assert complete(router.url, system_a + "question 9").status_code == 200
        assert router.sent()[owner] == before + 1
        text = httpx.get(f"{router.url}/metrics").text
        assert 'reason="prefix hit"' in text and 'reason="new prefix"' in text
    finally:
        router.stop()


def test_replica_killed_and_restarted_under_load(replicas):
    router = RouterServer([r.url for r in replicas], "round-robin")
    victim = replicas[1]
    try:
        def one(i: int) -> int:
            return complete(router.url, f"load {i}", max_tokens=8).status_code

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, i) for i in range(8)]
            assert [f.result() for f in futures] == [200] * 8
            victim.stop()
            # Requests sent after the kill all succeed on the other replica, whether the
            # router has noticed yet (failover) or not (health check).
            futures = [pool.submit(one, i) for i in range(8, 24)]
            assert [f.result() for f in futures] == [200] * 16
            state = httpx.get(f"{router.url}/router/replicas").json()["replicas"]
            assert [r["healthy"] for r in state] == [True, False]
            victim.start()
            deadline = time.time() + 10
            while not httpx.get(f"{router.url}/router/replicas").json()["replicas"][1]["healthy"]:
                assert time.time() < deadline, "the restarted replica never came back"
                time.sleep(0.1)
            before = router.sent().get(victim.url, 0)
            futures = [pool.submit(one, i) for i in range(24, 32)]
            assert [f.result() for f in futures] == [200] * 8
            assert router.sent()[victim.url] > before  # back in rotation
    finally:
        router.stop()


def test_router_unit_choices():
    r = Router(RouterConfig(["http://a", "http://b"], "prefix-aware", prefix_chunk_chars=8,
                            balance_slack=1))
    for rep in r.replicas:
        rep.healthy = True
    a, why = r.pick({"prompt": "x" * 40})
    assert why == "new prefix"
    assert r.pick({"prompt": "x" * 40 + "tail"}) == (a, "prefix hit")
    a.outstanding = 5  # too busy for its prefix: balance wins
    other, why = r.pick({"prompt": "x" * 40})
    assert other is not a and why == "prefix owner busy"
    a.outstanding = 0
    a.healthy = False
    assert r.pick({"prompt": "y"}, exclude={"http://b"}) == (None, "none healthy")
    a.healthy = True
    b = r.replicas[1]
    r.remember_response("resp_1", b)
    for policy in ("round-robin", "prefix-aware"):
        r.config.policy = policy
        assert r.pick({"input": "hi", "previous_response_id": "resp_1"}) == (b, "response owner")
    b.healthy = False  # its store is gone with it: any other replica, which will say so
    assert r.pick({"previous_response_id": "resp_1"})[0] is a
    assert r.response_owner("resp_2") is None
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(["http://a"], "random")
    with pytest.raises(ValueError, match="http"):
        RouterConfig(["a:80"])


def consecutive_free_ports(n: int) -> int:
    """The first of n consecutive ports that are free now."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for p in range(base, base + n):
                    held.enter_context(socket.create_server(("127.0.0.1", p)))
            except OSError:
                continue
        return base


def test_router_spawns_its_replicas_and_stops_them(tiny_llama_dir, tmp_path):
    """`kvserve router --spawn 2`: two `kvserve serve` replicas on consecutive ports from
    --replica-base-port, with --serve-args (quoted, as a shell passes them), both sent
    requests; SIGTERM to the router ends them too."""
    base = consecutive_free_ports(2)
    port = free_port()
    serve_args = f"--model '{tiny_llama_dir}' --dtype float32 --served-model-name 'tiny one'"
    log = tmp_path / "router.log"  # the router's and its replicas' output
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "router", "--spawn", "2",
                             "--serve-args", serve_args, "--replica-base-port", str(base),
                             "--port", str(port), "--policy", "round-robin",
                             "--health-interval", "0.2"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                up = [httpx.get(f"{r}/health", timeout=2).status_code == 200 for r in replicas]
            except httpx.HTTPError:
                up = [False]
            if all(up):
                break
            assert time.monotonic() < deadline, "the spawned replicas never became healthy"
            time.sleep(0.5)
        time.sleep(0.5)  # the router's own health poll marks them in
        for r in replicas:
            assert httpx.get(f"{r}/v1/models").json()["data"][0]["id"] == "tiny one"
        for i in range(4):
            assert complete(url, f"hello {i}").status_code == 200
        sent = {}
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith("kvserve_router:requests_total{"):
                rep = line.split('replica="')[1].split('"')[0]
                sent[rep] = sent.get(rep, 0.0) + float(line.rsplit(" ", 1)[1])
        assert sent == {replicas[0]: 2.0, replicas[1]: 2.0}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)
    out = log.read_text()
    assert proc.returncode == 0, out
    assert "HTTP Request: GET" not in out  # httpx's line a health poll: quiet unless -v
    assert "POST /v1/completions" not in out  # the replicas' access log is off by default
    for r in replicas:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{r}/health", timeout=2)
