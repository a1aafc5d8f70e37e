"""kvserve replicas on Ray Serve (kvserve.entrypoints.ray_serve): the replica settings and the
deployment options they make, the CLI's error without the Ray extra, the prefix-aware
routing policy and its route keys (no Ray needed), and two tiny-model replicas behind the
ingress on a local Ray instance (2 CPUs), through the openai client: completions and chats,
whole and streamed, spread over both replicas and equal to a plain LLM's greedy output;
shared prefixes on one replica, unrelated prompts on both; a Responses chain and its stored
responses reaching their replica; Ray's health check; and a stream in flight while the
application is deleted finishing whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import KVEventsConfig
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.engine.processor import OutputProcessor
from kvserve.entrypoints.cli import main
from kvserve.entrypoints.ray_serve.args import APP_NAME, PREFIX_ROUTER, ReplicaArgs
from kvserve.entrypoints.ray_serve.route_key import prompt_tokens, route_key
from kvserve.entrypoints.ray_serve.routing import PrefixTable, RoutePolicy, rank
from kvserve.entrypoints.server.args import ServerArgs
from kvserve.entrypoints.server.protocol import ChatCompletionRequest
from kvserve.entrypoints.server.serving import encode_chat
from kvserve.kv_cache.hashing import chain_hashes
from kvserve.sample.sampling_params import SamplingParams
from kvserve.tokenizer.tokenizer import Tokenizer
from tests.server_utils import assert_completion_envelope, free_port, openai_client

REPLICA_HEADER = "x-kvserve-replica"
STEP_S = 0.02  # each replica step sleeps this long (KVSERVE_FAULTS): a long stream lasts
# Ray's routers keep each replica's queue length in a cache, counted up as requests are sent
# and down as they finish, and overwritten by the counts replicas report as they accept
# them. After a burst a late report can leave a replica's count above its real one until
# the entry goes stale (RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S, 10 s by default), and the
# prefix router then sees an idle replica as busy. Here entries go stale after this, and a
# test that needs the router to see idle replicas waits that long first.
QUEUE_LEN_STALE_S = 1.0


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
    assert fixed["request_router_config"] == {
        "request_router_class": PREFIX_ROUTER,
        "request_router_kwargs": {"prefix_aware": True, "balance_slack": 16}}
    two = ReplicaArgs(data_parallel_size=2, request_router="power-of-two")
    assert two.deployment_options(engine, server, 2)["request_router_config"][
        "request_router_kwargs"]["prefix_aware"] is False


@pytest.mark.parametrize("argv, message", [
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["ray", "--min-replicas", "2"], "--min-replicas needs --max-replicas"),
    (["ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas must be in"),
    (["ray", "--threads-per-replica", "0"], "--threads-per-replica must be >= 1"),
    (["ray", "--balance-slack", "-1"], "--balance-slack must be >= 0"),
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
    """Tensor parallelism in a replica; KV-event endpoints that two ranks would share."""
    with pytest.raises(ValueError, match="tensor-parallel"):
        ReplicaArgs(data_parallel_size=2).check_engine(
            EngineArgs(model="unused", tensor_parallel_size=2))
    # KV events: each replica on its rank's endpoints, which must not meet
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
              "replay_endpoint": "tcp://*:5560"}
    ReplicaArgs(data_parallel_size=3).check_engine(EngineArgs(model="unused",
                                                              kv_events_config=events))
    with pytest.raises(ValueError, match="rank 3 and rank 0 would both use tcp://"):
        ReplicaArgs(data_parallel_size=1, max_replicas=4).check_engine(
            EngineArgs(model="unused", kv_events_config=events))


# ------------------------------------------------- prefix-aware routing, no Ray cluster needed

SLACK = RoutePolicy(balance_slack=4, min_match_blocks=4)


def test_the_table_counts_leading_blocks_and_forgets_the_least_recently_used():
    table = PrefixTable(capacity=6)
    table.record([1, 2, 3, 4], "a")
    table.record([1, 2, 9], "b")
    assert table.matched([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert table.matched([5, 1, 2], ["a"]) == {"a": 0}  # leading blocks only
    table.record([7, 8], "c")  # 7 hashes > 6: the least recently used, 9, goes
    assert len(table) == 6 and table.matched([1, 2, 3, 4], ["a"])["a"] == 4
    assert table.matched([1, 2, 9], ["b"])["b"] == 2
    table.forget("a")
    assert table.matched([1, 2], ["a", "b"]) == {"a": 0, "b": 2}


def test_rank_prefers_the_prefix_owner_until_it_is_busy():
    table = PrefixTable()
    key = list(range(100, 110))  # ten blocks
    table.record(key, "a")
    table.record(key[:5], "b")
    ranks, why = rank(table, SLACK, key, {"a": 4, "b": 0, "c": 0})
    assert why == "prefix hit" and ranks[0] == ["a"] and ranks[1] == ["b"]
    assert sorted(ranks[-1]) == ["a", "b", "c"]  # then anyone with room
    ranks, why = rank(table, SLACK, key, {"a": 5, "b": 0, "c": 0})  # 5 > 0 + 4: too busy
    assert why == "prefix owner busy" and ranks[0][0] in ("b", "c")
    # a match of fewer than 4 blocks (a chat template's header) is no match
    ranks, why = rank(table, SLACK, [100, 1, 2, 3, 4], {"a": 0, "b": 3})
    assert why == "weak match" and ranks[0] == ["a"]  # the least loaded
    # all of a short key matching is a match
    table.record([200, 201], "a")
    assert rank(table, SLACK, [200, 201], {"a": 1, "b": 0}) == ([["a"], ["b", "a"]],
                                                                 "prefix hit")
    assert rank(table, SLACK, key[:2], {"a": 1, "b": 0})[0][0] == ["b", "a"]  # both hold it
    assert rank(table, SLACK, [], {"a": 2, "b": 1})[0][0] == ["b"]  # no key: least loaded


def test_new_prefixes_spread_by_their_first_hash():
    table = PrefixTable()
    load = {"a": 0, "b": 0}
    firsts = {rank(table, SLACK, [h, h + 1], load)[0][0][0] for h in range(8)}
    assert firsts == {"a", "b"}
    assert rank(table, SLACK, [6, 7], load) == rank(table, SLACK, [6, 7], load)


@settings(max_examples=200, deadline=None)
@given(routed=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=8),
                                 st.sampled_from("abc")), max_size=12),
       key=st.lists(st.integers(0, 5), max_size=8),
       load=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 9), min_size=1),
       slack=st.integers(0, 5), need=st.integers(1, 4))
def test_rank_is_the_policy(routed, key, load, slack, need):
    """Whatever was routed where: the first choice holds the most leading blocks of the key
    and is at most `slack` busier than the least loaded, or it is a least loaded replica;
    every candidate is in the last rank, so a full first choice falls back to anyone."""
    table, policy = PrefixTable(), RoutePolicy(balance_slack=slack, min_match_blocks=need)
    for hashes, replica in routed:
        table.record(hashes, replica)
    matched = table.matched(key, list(load))
    ranks, why = rank(table, policy, key, load)
    assert sorted(ranks[-1]) == sorted(load)
    first = ranks[0]
    assert first and all(r in load for r in first)
    least = min(load.values())
    if why == "prefix hit":
        best = max(matched.values())
        assert best >= min(need, len(key)) and best > 0
        assert all(matched[r] == best for r in first)
        assert min(load[r] for r in first) <= least + slack
    else:
        assert [load[r] for r in first] == [least]


def test_route_keys_are_the_prefix_caches_hashes_with_the_salt(tiny_llama_dir):
    """The ingress's tokens for a chat are the replica's (serving.encode_chat with the same
    tokenizer and template); its key is their block-hash chain; a salt changes every hash."""
    tokenizer = Tokenizer.load(tiny_llama_dir)

    class Processor:  # what serving.encode_chat reads of the replica's processor
        encode_chat = OutputProcessor.encode_chat

        def __init__(self) -> None:
            self.tokenizer = tokenizer

    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief. " * 10},
                                       {"role": "user", "content": "What is the sea?"}]}
    chat = ChatCompletionRequest.model_validate(body)
    want = encode_chat(Processor(), chat.messages, True)
    got, salt = prompt_tokens(tokenizer, "/v1/chat/completions", body)
    assert got == want and salt is None and len(want) >= 32
    key = route_key(tokenizer, 16, "/v1/chat/completions", body)
    assert list(key) == chain_hashes(want, 16) and len(key) == len(want) // 16
    salted = route_key(tokenizer, 16, "/v1/chat/completions", {**body, "cache_salt": "t1"})
    other = route_key(tokenizer, 16, "/v1/chat/completions", {**body, "cache_salt": "t2"})
    assert len(salted) == len(key) and not set(salted) & (set(key) | set(other))
    text = "the same document " * 8
    assert route_key(tokenizer, 16, "/v1/completions", {"model": "m", "prompt": text}) == \
        tuple(chain_hashes(tokenizer.encode(text), 16))
    # what cannot be keyed is routed by load: a bad body, a stored response's continuation
    assert route_key(tokenizer, 16, "/v1/completions", {"prompt": 3}) == ()
    assert route_key(tokenizer, 16, "/v1/responses", {
        "model": "m", "input": text, "previous_response_id": "resp_1"}) == ()
    assert route_key(tokenizer, 16, "/v1/responses", {"model": "m", "input": text})


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
def ray_app(tiny_llama_dir):
    """Two tiny-model replicas (one thread each) on a local Ray instance of 2 CPUs, behind
    Ray's HTTP proxy; each replica step sleeps STEP_S, so a long stream stays in flight.
    Yields the URL, `deploy(n)`, which redeploys the application with n replicas, and the
    KV-event config every replica publishes with (on its rank's endpoint)."""
    _need_ray()
    import ray
    from ray import serve

    from kvserve.entrypoints.ray_serve.deployment import application

    with pytest.MonkeyPatch.context() as mp:  # read by the workers Ray starts
        mp.setenv("RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S", str(QUEUE_LEN_STALE_S))
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        ev = free_port()  # each replica publishes KV events on ev + its rank
        events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{ev}",
                                topic="kvserve")
        engine_args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", max_num_seqs=8,
                                 kv_events_config=asdict(events))
        server_args = ServerArgs(host="127.0.0.1", port=port, shutdown_timeout=60.0)
        faults = {"env_vars": {"KVSERVE_FAULTS": json.dumps({"slow_step_s": STEP_S})}}

        def deploy(replicas: int) -> None:
            app = application(engine_args, server_args,
                              ReplicaArgs(data_parallel_size=replicas, threads_per_replica=1),
                              {"runtime_env": faults})
            serve.run(app, name=APP_NAME, route_prefix="/")

        deploy(2)
        yield f"http://127.0.0.1:{port}", deploy, events
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_url(ray_app):
    return ray_app[0]


def _replicas(url: str) -> list[str]:
    return [r["id"] for r in httpx.get(f"{url}/v1/engine/replicas", timeout=30).json()["data"]]


def _by_replica(url: str, name: str) -> dict[str, float]:
    """One metric's samples on the ingress' /metrics, summed by their `replica` label."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


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
    serve.get_deployment_handle("KVServeDeployment", APP_NAME).check_health.remote().result(
        timeout_s=30)
    status = serve.status().applications[APP_NAME]
    assert status.status == "RUNNING"
    assert status.deployments["KVServeDeployment"].replica_states == {"RUNNING": 2}
    assert status.deployments["KVServeIngress"].replica_states == {"RUNNING": 1}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shared_prefixes_stay_on_one_replica_and_unrelated_prompts_spread(ray_url):
    """Prompts sharing a long prefix (many KV blocks) go where the first of them went, one
    after another and at once; prompts with nothing in common use both replicas."""
    client = openai_client(ray_url)
    model = client.models.list().data[0].id

    def replica(prompt: str) -> str:
        raw = client.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=2, temperature=0)
        return raw.headers[REPLICA_HEADER]

    groups = {}
    for g in range(4):
        prefix = f"Document {g}: " + f"the {g}th tale of ships and tides, " * 6
        first = replica(prefix + "first question?")
        with ThreadPoolExecutor(4) as pool:
            rest = list(pool.map(replica, [prefix + f"question {i}?" for i in range(6)]))
        assert set(rest) == {first}, (g, first, rest)
        groups[g] = first
    time.sleep(QUEUE_LEN_STALE_S + 0.5)  # the bursts' queue lengths gone stale
    unrelated = [replica(f"{i} " + f"unrelated words number {i * 7919} " * 6)
                 for i in range(10)]
    assert len(set(unrelated)) == 2, unrelated
    # a chat with a long shared system prompt too, whatever the user asks
    system = {"role": "system", "content": "You answer about the sea. " * 12}
    seen = {client.chat.completions.with_raw_response.create(
        model=model, max_tokens=2, temperature=0,
        messages=[system, {"role": "user", "content": f"Question {i}?"}]).headers[
            REPLICA_HEADER] for i in range(5)}
    assert len(seen) == 1, seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_responses_chain_and_its_stored_responses_reach_their_replica(ray_url):
    """Five turns, each continuing the last (whole and streamed in turn), all answered by
    the replica that holds the conversation; GET and DELETE reach it; unknown ids are 404
    (and a continuation of one, the replica's own 400)."""
    client = openai_client(ray_url)
    model = client.models.list().data[0].id
    previous, owners, ids = None, set(), []
    for turn in range(5):
        kw = {"model": model, "input": f"Turn {turn}: say something.", "temperature": 0,
              "max_output_tokens": 4, "previous_response_id": previous}
        if turn % 2:
            with client.responses.with_streaming_response.create(**kw, stream=True) as raw:
                owners.add(raw.headers[REPLICA_HEADER])
                events = list(raw.parse())
            answer = events[-1].response
            assert events[0].type == "response.created"
        else:
            raw = client.responses.with_raw_response.create(**kw)
            owners.add(raw.headers[REPLICA_HEADER])
            answer = raw.parse()
        assert answer.previous_response_id == previous and answer.status in (
            "completed", "incomplete")
        previous = answer.id
        ids.append(answer.id)
    assert len(owners) == 1, owners
    for rid in ids:
        raw = client.responses.with_raw_response.retrieve(rid)
        assert raw.parse().id == rid and {raw.headers[REPLICA_HEADER]} == owners
    client.responses.delete(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    r = httpx.delete(f"{ray_url}/v1/responses/resp_unknown", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    with pytest.raises(openai.BadRequestError, match="previous response"):
        client.responses.create(model=model, input="x", previous_response_id="resp_unknown",
                                max_output_tokens=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_errors_keep_their_status_and_body(ray_url):
    r = httpx.post(f"{ray_url}/v1/completions", timeout=30,
                   json={"model": "no-such-model", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["type"]
    r = httpx.post(f"{ray_url}/v1/chat/completions", timeout=30, content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{ray_url}/v1/messages", timeout=30, json={"model": "m"})
    assert r.status_code == 400 and r.json()["type"] == "error"  # Anthropic's shape


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_metrics_and_dashboard_cover_every_replica(ray_url):
    """One scrape of the ingress has both replicas' metrics, each labelled; a shared prefix's
    hits are counted on the replica that holds it, and nowhere else; the dashboard's routes
    answer for one replica (?replica=) or the sum."""
    client = openai_client(ray_url)
    model = client.models.list().data[0].id
    ids = _replicas(ray_url)
    assert len(ids) == 2
    hits = "kvserve:prefix_cache_hits_total"
    before = _by_replica(ray_url, hits)
    prefix = "A shared preamble about lighthouses and their keepers, " * 8
    owners = {client.completions.with_raw_response.create(
        model=model, prompt=prefix + f"question {i}?", max_tokens=2,
        temperature=0).headers[REPLICA_HEADER] for i in range(4)}
    assert len(owners) == 1
    owner, = owners
    after = _by_replica(ray_url, hits)
    # every replica's samples, each under its own label
    assert set(_by_replica(ray_url, "kvserve:num_requests_running")) == set(ids)
    gained = {r: after.get(r, 0.0) - before.get(r, 0.0) for r in ids}
    assert gained[owner] >= 3 * 64  # three repeats, each hitting the preamble's blocks
    assert all(gained[r] == 0 for r in ids if r != owner), gained

    each = {r: httpx.get(f"{ray_url}/v1/engine/stats", params={"replica": r},
                         timeout=30).json() for r in ids}
    total = httpx.get(f"{ray_url}/v1/engine/stats", timeout=30).json()
    assert total["replicas"] == 2
    assert total["prefix_cache"]["queried_tokens"] == sum(
        e["prefix_cache"]["queried_tokens"] for e in each.values())
    assert total["kv"]["blocks"] == sum(e["kv"]["blocks"] for e in each.values())
    time.sleep(2.5)  # each replica records a history sample a second
    history = httpx.get(f"{ray_url}/v1/engine/history", params={"seconds": 2},
                        timeout=30).json()
    assert history["replicas"] == 2 and history["data"]
    assert max(s["replicas"] for s in history["data"]) == 2
    one = httpx.get(f"{ray_url}/v1/engine/history", params={"seconds": 2, "replica": ids[0]},
                    timeout=30).json()
    assert "replicas" not in one and one["data"]  # that replica's own answer
    r = httpx.get(f"{ray_url}/v1/engine/stats", params={"replica": "nope"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "replica"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_ingress_lets_as_many_streams_through_as_the_replicas_take(ray_url):
    """Every request stays in flight at the ingress until its answer ends: at Ray's default
    of 5 per replica, the ingress alone would hold two replicas of 8 sequences to 5 streams.
    12 streams at once all run in the engines together."""
    client = openai_client(ray_url)
    model = client.models.list().data[0].id
    done: list[int] = []

    def stream(i: int) -> None:
        body = {"model": model, "prompt": f"{i} " + f"stream number {i * 31} " * 3,
                "max_tokens": 150, "stream": True, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{ray_url}/v1/completions", json=body, timeout=300) as r:
            done.append(sum(1 for ln in r.iter_lines() if ln.startswith("data: ")))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    most, deadline = 0, time.monotonic() + 30
    while most < 12 and time.monotonic() < deadline and len(done) < 12:
        stats = httpx.get(f"{ray_url}/v1/engine/stats", timeout=30).json()
        most = max(most, stats["running"] + stats["waiting"])
        time.sleep(0.05)
    for t in threads:
        t.join(300)
    assert most == 12, f"at most {most} of 12 streams reached the engines at once"
    assert done == [151] * 12  # 150 tokens and [DONE]


def _ranks_serving(url: str, events: KVEventsConfig, prompts: int = 12
                   ) -> dict[str, set[int]]:
    """Each replica's KV-event ranks: unrelated prompts, one at a time, and which rank's
    endpoint published the batch of the blocks each one stored. After each prompt both
    endpoints are read until the first batch came and then neither sent one for SETTLE_MS,
    so a prompt's batches are all in before the next prompt goes."""
    import zmq

    from tests.test_kv_events import DECODER, Subscriber

    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    subs = [Subscriber(events.for_rank(rank)) for rank in (0, 1)]
    poller = zmq.Poller()
    for sub in subs:
        poller.register(sub.sub, zmq.POLLIN)
    seen: dict[str, set[int]] = {}
    try:
        for i in range(prompts):
            prompt = f"{i} " + f"distinct words number {i * 7919 + time.time_ns()} " * 6
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            wait = 3000  # the first batch; then until both are quiet
            while poller.poll(wait):
                for rank, sub in enumerate(subs):
                    while (got := sub.receive(0)) is not None:
                        assert DECODER.decode(got[1]).data_parallel_rank == rank
                        seen.setdefault(r.headers[REPLICA_HEADER], set()).add(rank)
                wait = SETTLE_MS
    finally:
        for sub in subs:
            sub.close()
    return seen


# How long both KV-event endpoints stay quiet before a prompt's batches count as all in: a
# replica publishes a step's batch right after the step (STEP_S), well within it.
SETTLE_MS = 150


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_replica_publishes_kv_events_on_its_ranks_endpoint(ray_app):
    """One --kv-events-config for both replicas: each binds its rank's endpoint (port plus
    rank) and its batches carry its rank, so a KV-aware router can index each replica."""
    url, _, events = ray_app
    seen = _ranks_serving(url, events)
    assert len(seen) == 2 and sorted(len(r) for r in seen.values()) == [1, 1], seen
    assert set().union(*seen.values()) == {0, 1}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_replica_ends_its_streams_with_an_error_and_ray_replaces_it(ray_app):
    """A replica's actor killed mid-stream: the stream it served ends with an error event
    (the openai client raises it), not silently; requests after it are answered by the live
    replica; Ray's controller starts a new replica in its place, which takes the dead one's
    rank (its KV events come on that rank's endpoint)."""
    import ray

    ray_url, _, events = ray_app
    ranks = _ranks_serving(ray_url, events)

    client = openai_client(ray_url)
    model = client.models.list().data[0].id
    ids = _replicas(ray_url)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 150, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{ray_url}/v1/completions", json=body, timeout=120) as r:
        victim = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#KVServeDeployment#{victim}",
                               namespace="serve"), no_restart=True)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest and rest[-1] != "data: [DONE]"
    error = json.loads(rest[-1][len("data: "):])["error"]
    assert error["code"] == 503 and victim in error["message"]
    assert len(rest) < 150  # it did not finish

    survivor, = set(ids) - {victim}
    served = [client.completions.with_raw_response.create(
        model=model, prompt=f"after the loss {i}", max_tokens=2, temperature=0)
        for i in range(6)]
    assert {s.headers[REPLICA_HEADER] for s in served} == {survivor}
    assert all(s.parse().choices[0].finish_reason == "length" for s in served)

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = _replicas(ray_url)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(1)
    assert len(now) == 2 and victim not in now and survivor in now, now
    replacement, = set(now) - {survivor}
    assert httpx.get(f"{ray_url}/health", timeout=30).status_code == 200
    stats = httpx.get(f"{ray_url}/v1/engine/stats", params={"replica": replacement},
                      timeout=30)
    assert stats.status_code == 200 and stats.json()["running"] == 0
    after = _ranks_serving(ray_url, events)
    assert after == {survivor: ranks[survivor], replacement: ranks[victim]}, (ranks, after)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_downscale_drains_without_losing_a_request(ray_app):
    """Redeployed from two replicas to one while streams run on both: the replica Ray stops
    takes no new requests and finishes its own, every stream gets every token."""
    url, deploy, _ = ray_app
    client = openai_client(url)
    model = client.models.list().data[0].id
    tokens = 200  # at least STEP_S * 200 = 4 s each
    started: dict[int, str] = {}  # stream -> its replica, once its first token came
    results: dict[int, tuple[str, list[str]]] = {}

    def stream(i: int) -> None:
        body = {"model": model, "prompt": f"{i} " + f"story number {i * 7919} " * 4,
                "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    started.setdefault(i, r.headers[REPLICA_HEADER])
            results[i] = (r.headers[REPLICA_HEADER], events)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(set(started.values())) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(set(started.values())) == 2 and not results, (started, list(results))
    deploy(1)  # returns once the application runs one replica: the other has drained
    for t in threads:
        t.join(300)
    assert len(results) == 6
    assert len({r for r, _ in results.values()}) == 2
    for replica, events in results.values():
        assert events[-1] == "data: [DONE]", (replica, events[-3:])
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == tokens
    assert len(_replicas(url)) == 1


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
