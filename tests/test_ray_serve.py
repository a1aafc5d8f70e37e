"""kvserve replicas on Ray Serve (kvserve.entrypoints.ray_serve): the replica settings and the
deployment options they make, the CLI's error without the Ray extra, and two tiny-model
replicas on a local Ray instance (2 CPUs) behind Ray's HTTP proxy, through the openai client:
completions and chats, whole and streamed, spread over both replicas and equal to a plain
LLM's greedy output, Ray's health check, and a stream in flight while the application is
deleted finishing whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.entrypoints.cli import main
from kvserve.entrypoints.ray_serve.args import APP_NAME, ReplicaArgs
from kvserve.entrypoints.server.args import ServerArgs
from kvserve.sample.sampling_params import SamplingParams
from tests.server_utils import assert_completion_envelope, free_port, openai_client

REPLICA_HEADER = "x-kvserve-replica"
STEP_S = 0.02  # each replica step sleeps this long (KVSERVE_FAULTS): a long stream lasts


# ---------------------------------------------------------------------------- no Ray needed

def test_deployment_options_come_from_the_engine_and_server_settings():
    engine = EngineArgs(model="unused", max_num_seqs=8)
    server = ServerArgs(shutdown_timeout=12.0)
    fixed = ReplicaArgs(data_parallel_size=3).deployment_options(engine, server, cpus=8)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 2}  # 8 CPUs over 3 replicas
    assert fixed["graceful_shutdown_timeout_s"] == 12.0
    assert fixed["max_ongoing_requests"] == 16  # twice --max-num-seqs

    scaled = ReplicaArgs(max_replicas=4, min_replicas=1, threads_per_replica=3,
                         max_ongoing_requests=5).deployment_options(engine, server, cpus=8)
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                            "initial_replicas": 1,
                                            "target_ongoing_requests": 8}
    assert scaled["ray_actor_options"] == {"num_cpus": 3}
    assert scaled["max_ongoing_requests"] == 5
    gpu = EngineArgs(model="unused", device="cuda")
    assert ReplicaArgs(data_parallel_size=2).deployment_options(
        gpu, server, cpus=2)["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert not ReplicaArgs().on_ray and ReplicaArgs(max_replicas=1).on_ray


@pytest.mark.parametrize("argv, message", [
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["ray", "--min-replicas", "2"], "--min-replicas needs --max-replicas"),
    (["ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas must be in"),
    (["ray", "--threads-per-replica", "0"], "--threads-per-replica must be >= 1"),
])
def test_bad_replica_flags_are_cli_errors(argv, message, capsys):
    assert main([*argv, "--model", "unused"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["serve", "--data-parallel-size", "2"],
                                  ["ray", "--max-replicas", "2"], ["ray"]])
def test_without_ray_the_cli_names_the_extra(argv, monkeypatch, capsys):
    """Exit 2 with the install command, before the model is looked for (`unused` is none)."""
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray: ImportError
    assert main([*argv, "--model", "unused"]) == 2
    err = capsys.readouterr().err
    assert "pip install kvserve[ray]" in err and "Traceback" not in err, err


def test_replicas_refuse_what_they_cannot_do_yet():
    with pytest.raises(ValueError, match="tensor-parallel"):
        ReplicaArgs(data_parallel_size=2).check_engine(
            EngineArgs(model="unused", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="kv-events-config"):
        ReplicaArgs(data_parallel_size=2).check_engine(
            EngineArgs(model="unused", kv_events_config={"enable_kv_cache_events": True}))
    ReplicaArgs(data_parallel_size=1, max_replicas=None).check_engine(
        EngineArgs(model="unused", kv_events_config={"enable_kv_cache_events": True}))


# ------------------------------------------------------------------ replicas on a local Ray

def _need_ray() -> None:
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install "
                                            "kvserve[ray]; scripts/setup.sh --test installs it)")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_data_parallel_size_starts_replicas_and_stops_on_sigterm(tiny_llama_dir,
                                                                       tmp_path):
    """The command as a user runs it: `kvserve serve --data-parallel-size 2` starts a local
    Ray instance with two replicas on --port, and SIGTERM deletes them and stops Ray (exit
    0). Before the module's Ray instance starts, so the two do not meet."""
    _need_ray()
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve", "serve", "--data-parallel-size", "2",
             "--model", str(tiny_llama_dir), "--dtype", "float32", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "RAY_ADDRESS": ""})  # a Ray instance of its own
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        client = openai_client(f"http://127.0.0.1:{port}")
        raw = client.completions.with_raw_response.create(
            model=client.models.list().data[0].id, prompt="hi", max_tokens=4, temperature=0)
        assert raw.headers[REPLICA_HEADER] and raw.parse().usage.completion_tokens == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
        assert "stopping: the replicas finish the requests in flight" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


# ------------------------------------------------------------- two replicas on a local Ray

@pytest.fixture(scope="module")
def ray_url(tiny_llama_dir):
    """Two tiny-model replicas (one thread each) on a local Ray instance of 2 CPUs, behind
    Ray's HTTP proxy; each replica step sleeps STEP_S, so a long stream stays in flight."""
    _need_ray()
    import ray
    from ray import serve

    from kvserve.entrypoints.ray_serve.deployment import application

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine_args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", max_num_seqs=8)
        server_args = ServerArgs(host="127.0.0.1", port=port, shutdown_timeout=60.0)
        faults = {"env_vars": {"KVSERVE_FAULTS": json.dumps({"slow_step_s": STEP_S})}}
        app = application(engine_args, server_args,
                          ReplicaArgs(data_parallel_size=2, threads_per_replica=1),
                          {"runtime_env": faults})
        serve.run(app, name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)  # its first test starts Ray and both replicas
def test_completions_spread_over_both_replicas_and_match_a_plain_llm(ray_url, tiny_llama_dir):
    client = openai_client(ray_url)
    model = client.models.list().data[0].id
    prompts = [f"the number {i} is" for i in range(12)]

    def complete(prompt: str):
        raw = client.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0)
        return raw.headers[REPLICA_HEADER], raw.parse()

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(complete, prompts))
    replicas = {replica for replica, _ in answers}
    assert len(replicas) == 2, f"one replica served all {len(prompts)}: {replicas}"
    with LLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=8) as llm:  # the replicas'
        want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    for (_, got), ref in zip(answers, want, strict=True):
        assert_completion_envelope(got, model)
        assert got.choices[0].text == ref.outputs[0].text
        assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_streams_pass_through_unchanged(ray_url):
    client = openai_client(ray_url)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    loose = openai_client(ray_url, strict=False)  # LOOSE_BECAUSE: legacy completion chunks
    want = client.completions.create(model=model, prompt="abc", max_tokens=6, temperature=0)
    parts = list(loose.completions.create(model=model, prompt="abc", max_tokens=6,
                                          temperature=0, stream=True))
    for c in parts:
        assert_completion_envelope(c, model)
    assert "".join(c.choices[0].text for c in parts if c.choices) == want.choices[0].text

    # the SSE bytes as the replica sent them: data lines and the closing [DONE]
    with httpx.stream("POST", f"{ray_url}/v1/completions", timeout=60, json={
            "model": model, "prompt": "abc", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_health_is_the_engine_health(ray_url):
    from ray import serve

    r = httpx.get(f"{ray_url}/health", timeout=30)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER]
    serve.get_app_handle(APP_NAME).check_health.remote().result(timeout_s=30)
    status = serve.status().applications[APP_NAME]
    assert status.status == "RUNNING"
    assert status.deployments["KVServeDeployment"].replica_states == {"RUNNING": 2}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stream_in_flight_finishes_while_the_replicas_stop(ray_url):
    """serve.delete stops both replicas the way a downscale stops one: each takes no new
    requests and drains those in flight (graceful_shutdown_timeout_s, --shutdown-timeout)
    before its engine stops. A stream started before it gets every token. Last in this
    module: it deletes the application the tests above use."""
    from ray import serve

    client = openai_client(ray_url)
    model = client.models.list().data[0].id
    tokens = 100  # at least STEP_S * 100 = 2 s
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Go on."}], max_tokens=tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    began = time.monotonic()
    deleted: dict[str, float] = {}

    def delete() -> None:
        deleted["start"] = time.monotonic()
        serve.delete(APP_NAME)
        deleted["done"] = time.monotonic()

    deleter = threading.Thread(target=delete)
    deleter.start()
    chunks += list(stream)
    ended = time.monotonic()
    deleter.join(120)
    assert not deleter.is_alive()
    assert ended - began > 0.5 * tokens * STEP_S  # the slow steps are on: it was in flight
    assert deleted["start"] < ended <= deleted["done"], (deleted, began, ended)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == tokens
    assert APP_NAME not in serve.status().applications
