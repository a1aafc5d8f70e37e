"""The server end to end with the official openai client, on the default model."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch

from kvserve.engine.llm_engine import EngineArgs
from kvserve.engine.processor import OutputProcessor
from tests.server_utils import (
    assert_completion_envelope,
    async_openai_client,
    metric,
    openai_client,
    run_server,
)
from tests.test_cli import CHAT_QUESTION

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(real_model_path):
    # The default configuration (on this CPU: bf16, int4 copies, prefix caching): a
    # request's text does not depend on its batch or on prefix-cache hits.
    args = EngineArgs(model=str(real_model_path), kv_cache_memory="512MiB")
    with run_server(args) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai_client(f"{server[0]}/v1")


@pytest.fixture(scope="module")
def loose_client(server):
    """For what OpenAI's API sends but the SDK's strict types refuse (LOOSE_BECAUSE); the
    tests check the envelope themselves."""
    return openai_client(f"{server[0]}/v1", strict=False)


def test_models_health_version(server, client):
    url, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    assert r.choices[0].text.startswith(" Paris")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == 13
    assert r.choices[0].finish_reason == "length"
    t = r.model_extra["timings"]
    assert t["ttft"] > 0 and t["queue_time"] >= 0 and t["tpot"] > 0
    assert t["prefill_time"] + t["queue_time"] == pytest.approx(t["ttft"], abs=1e-6)


def test_completion_stream_with_usage(loose_client):
    stream = loose_client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    for c in chunks:
        assert_completion_envelope(c, MODEL)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(" Paris")
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_echo(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                  temperature=0, echo=True)
    assert r.choices[0].text.startswith("The capital of France is Paris")


def test_several_prompts_are_accepted_or_refused_together(server, client):
    r = client.completions.create(model=MODEL, prompt=["The capital of France is", "Hello"],
                                  max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    alone = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.choices[1].text == alone.choices[0].text
    # The second prompt is refused, so the first is never queued: no timeline of it exists.
    url = server[0]
    _error(_post(url, "/v1/completions", {"prompt": [[1, 2, 3], [1, 10**9]], "max_tokens": 2,
                                          "request_id": "pair"}), 400)
    _error(httpx.get(f"{url}/v1/requests/pair-0/timeline"), 404)


def test_echo_with_logprobs_scores_the_prompt(loose_client):
    """What lm-evaluation-harness sends for log-likelihoods: echo + logprobs, max_tokens 0
    or 1."""
    text = "The capital of France is Paris"
    r = loose_client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    assert_completion_envelope(r, MODEL)
    c, n = r.choices[0], r.usage.prompt_tokens
    assert c.text == text and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == n and "".join(c.logprobs.tokens) == text
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert all(len(t) == 1 for t in c.logprobs.top_logprobs[1:])
    assert c.logprobs.text_offset[:3] == [0, len(c.logprobs.tokens[0]),
                                          len(c.logprobs.tokens[0] + c.logprobs.tokens[1])]
    one = loose_client.completions.create(model=MODEL, prompt=text, max_tokens=1, echo=True,
                                    logprobs=1, temperature=0).choices[0]
    assert len(one.logprobs.tokens) == n + 1
    assert one.logprobs.token_logprobs[:n] == pytest.approx(c.logprobs.token_logprobs[:n],
                                                            abs=1e-5)
    stream = loose_client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True,
                                       logprobs=1, temperature=0, stream=True)
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    assert "".join(ch.text for ch in chunks) == text
    assert [t for ch in chunks if ch.logprobs for t in ch.logprobs.tokens] == \
        c.logprobs.tokens
    vllm = loose_client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2}).choices[0]
    plp = vllm.model_extra["prompt_logprobs"]
    assert len(plp) == n and plp[0] is None
    assert all(1 <= len(e) <= 3 for e in plp[1:])
    with pytest.raises(openai.BadRequestError, match="echo"):
        loose_client.completions.create(model=MODEL, prompt=text, max_tokens=0)


def test_chat_and_stream_agree(client):
    _invariant_or_skip()
    messages = [{"role": "user", "content": CHAT_QUESTION}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def _invariant_or_skip() -> None:
    from kvserve import kernels

    if kernels.attention_kernels(torch.bfloat16, "cpu", 64) is None and \
            kernels.attention_kernels(torch.float32, "cpu", 64) is None:
        pytest.skip("no batch-invariant kernels on this CPU")


def test_repeated_chat_requests_give_identical_text(client):
    """The same greedy chat request again (its prompt now in the prefix cache), streamed and
    not, and next to other requests: the same text every time."""
    _invariant_or_skip()
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=48, temperature=0)
    texts = [client.chat.completions.create(**kw).choices[0].message.content]
    for _ in range(2):
        r = client.chat.completions.create(**kw)
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        texts.append(r.choices[0].message.content)
        stream = client.chat.completions.create(**kw, stream=True)
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    async def crowded() -> str:
        aclient = async_openai_client(client.base_url)
        others = [aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say {i} words."}],
            max_tokens=32, temperature=0.8, seed=i) for i in range(6)]
        mine = aclient.chat.completions.create(**kw)
        results = await asyncio.gather(mine, *others)
        return results[0].choices[0].message.content

    texts.append(asyncio.run(crowded()))
    assert len(texts[0]) > 20 and all(t == texts[0] for t in texts)


def test_repeated_seeded_sampling_gives_identical_text(loose_client):
    _invariant_or_skip()
    kw = dict(model=MODEL, prompt="Write a short poem about rivers.", max_tokens=32,
              temperature=0.9, top_p=0.95, seed=42, extra_body={"ignore_eos": True})
    texts = [loose_client.completions.create(**kw).choices[0].text for _ in range(2)]
    stream = loose_client.completions.create(**kw, stream=True)
    texts.append("".join(c.choices[0].text for c in stream if c.choices))
    assert texts[0] and texts[0] == texts[1] == texts[2]


def test_max_completion_tokens_and_stop(client):
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_completion_tokens=40)
    full = r.choices[0].message.content
    assert "4" in full
    cut = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_completion_tokens=40, stop=["4"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index("4")]


def test_n2_and_seed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2,
              seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == 24
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=8, n=2, seed=5, temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    c = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token


def test_tokenize_detokenize(server):
    url, _ = server
    t = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 8192
    d = httpx.post(f"{url}/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    chat = httpx.post(f"{url}/tokenize",
                      json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > t["count"]


async def _stream_text(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    return "".join([c.choices[0].text async for c in stream if c.choices])


def test_32_concurrent_streams_match_alone(server):
    _invariant_or_skip()
    url, _ = server
    prompts = [f"Question {i}: what is {i} plus {i * 3}? Answer:" if i % 2 else
               f"Write a sentence about the number {i}." for i in range(32)]

    async def run() -> tuple[list[str], list[str]]:
        client = async_openai_client(f"{url}/v1", strict=False)  # LOOSE_BECAUSE
        alone = [await _stream_text(client, p) for p in prompts]
        together = await asyncio.gather(*(_stream_text(client, p) for p in prompts))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert all(alone)
    assert together == alone


def test_disconnect_mid_stream_frees_kv(server):
    url, _ = server
    idle = metric(url, "kvserve:kv_cache_usage_perc")
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={"prompt": "Tell me a long story.", "max_tokens": 2000,
                            "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        assert metric(url, "kvserve:kv_cache_usage_perc") > idle
    # The client is gone; within a few steps the request is aborted and its blocks freed.
    deadline = time.time() + 10
    while metric(url, "kvserve:kv_cache_usage_perc") > idle and time.time() < deadline:
        time.sleep(0.1)
    assert metric(url, "kvserve:kv_cache_usage_perc") == idle
    assert metric(url, "kvserve:num_requests_running") == 0


def test_disconnect_non_streaming_aborts(server):
    url, _ = server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "Go on and on.",
                                                  "max_tokens": 3000, "ignore_eos": True},
                   timeout=1.0)
    deadline = time.time() + 10
    while metric(url, "kvserve:num_requests_running") > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert metric(url, "kvserve:num_requests_running") == 0


def test_prefix_cache_reported_in_usage_and_salts_isolate(client, server):
    prompt = "Here is a long shared system prompt. " * 20

    def cached(salt: str) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                      extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-1") == 0
    assert cached("tenant-1") >= 128  # all full blocks but the one holding the last token
    assert cached("tenant-2") == 0
    url, _ = server
    assert metric(url, "kvserve:prefix_cache_queries_total") > 0
    text = httpx.get(f"{url}/metrics").text
    assert 'kvserve:prefix_cache_hits_total{model_name="SmolLM2-135M-Instruct",replica="0",' \
        'tier="device"}' in text


def test_metrics_exposed(server):
    url, _ = server
    text = httpx.get(f"{url}/metrics").text
    for name in ("kvserve:time_to_first_token_seconds_bucket",
                 "kvserve:inter_token_latency_seconds_bucket",
                 "kvserve:time_per_output_token_seconds_bucket",
                 "kvserve:e2e_request_latency_seconds_bucket",
                 "kvserve:request_queue_time_seconds_bucket",
                 "kvserve:request_prefill_time_seconds_bucket",
                 "kvserve:request_decode_time_seconds_bucket",
                 "kvserve:request_prompt_tokens_bucket",
                 "kvserve:request_generation_tokens_bucket",
                 "kvserve:num_requests_running", "kvserve:num_requests_waiting",
                 "kvserve:kv_cache_usage_perc", "kvserve:prompt_tokens_total",
                 "kvserve:generation_tokens_total", "kvserve:request_success_total",
                 "kvserve:num_preemptions_total"):
        assert name in text, name
    assert metric(url, "kvserve:generation_tokens_total") > 0


# ----------------------------------------------------------------------------- errors


def _post(url: str, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(f"{url}{path}", json=body, **kw)
    return httpx.post(f"{url}{path}", content=body,
                      headers={"content-type": "application/json"}, **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] == status and err["type"]
    return err


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, None),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, None),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, "tools.0.function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/tokenize", {}, None),
])
def test_bad_requests_get_400(server, path, body, param):
    err = _error(_post(server[0], path, body), 400)
    if param is not None:
        assert err["param"] == param, err


def test_sampling_error_names_the_field(server):
    err = _error(_post(server[0], "/v1/completions", {"prompt": "hi", "temperature": -1}), 400)
    assert "temperature" in err["message"]


def test_context_overflow_gives_numbers(server):
    err = _error(_post(server[0], "/v1/completions", {"prompt": "hi", "max_tokens": 9000}),
                 400)
    assert "9000" in err["message"] and "8192" in err["message"]


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=1)
    assert e.value.status_code == 404


def test_body_too_large_413(server):
    big = json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 1})
    _error(_post(server[0], "/v1/completions", big.encode()), 413)


def test_unknown_route_404(server):
    r = httpx.get(f"{server[0]}/v1/nothing")
    _error(r, 404)


def test_one_failing_request_does_not_disturb_others(server, monkeypatch):
    """An exception while handling one request fails it with 500; others run on."""
    url, _ = server
    original = OutputProcessor._append
    poison = "POISON"

    def flaky(self, sample, core_output):
        if poison in (self._samples[sample.request_id][0].prompt or ""):
            raise RuntimeError("injected failure")
        return original(self, sample, core_output)

    monkeypatch.setattr(OutputProcessor, "_append", flaky)
    results: dict[str, httpx.Response] = {}

    def call(name: str, prompt: str) -> None:
        results[name] = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})

    threads = [threading.Thread(target=call, args=("good", "The capital of France is")),
               threading.Thread(target=call, args=("bad", f"{poison} the capital"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    err = _error(results["bad"], 500)
    assert "injected failure" in err["message"]
    assert results["good"].status_code == 200
    assert results["good"].json()["usage"]["completion_tokens"] == 16
    stream = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": f"{poison} again", "max_tokens": 4, "stream": True})
    assert stream.status_code == 200 and '"error"' in stream.text and "[DONE]" in stream.text


def test_api_key_and_queue_limit(real_model_path):
    args = EngineArgs(model=str(real_model_path), max_num_seqs=1, kv_cache_memory="256MiB")
    with run_server(args, api_key="sesame", max_waiting_requests=1) as (url, _):
        _error(httpx.get(f"{url}/v1/models"), 401)
        _error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        auth = {"Authorization": "Bearer sesame"}
        assert httpx.get(f"{url}/v1/models", headers=auth).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200  # health needs no key
        # The web UI page is public and never carries the key; its data needs the key.
        page = httpx.get(f"{url}/")
        assert page.status_code == 200 and "sesame" not in page.text
        _error(httpx.get(f"{url}/v1/engine/stats"), 401)
        assert httpx.get(f"{url}/v1/engine/stats", headers=auth).status_code == 200
        body = {"prompt": "Go", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth) as a:
            lines = a.iter_lines()  # keep a reference: dropping it closes the stream
            next(lines)  # a is running (max_num_seqs=1)
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth,
                              timeout=30) as b:
                deadline = time.time() + 10
                while metric(url, "kvserve:num_requests_waiting") < 1:
                    assert time.time() < deadline
                    time.sleep(0.05)
                r = httpx.post(f"{url}/v1/completions", json=body, headers=auth)
                _error(r, 429)
                assert r.headers["retry-after"] == "1"
                assert b.status_code == 200


def test_streaming_with_speculative_decoding(client, real_model_path):
    """Greedy text through a server that speculates (n-gram) equals the plain server's,
    streamed or not, although one step may deliver several tokens."""
    _invariant_or_skip()
    prompt = ("Copy this list exactly, then stop: red apple, green pear, red apple, "
              "green pear, red apple, green pear.")
    messages = [{"role": "user", "content": prompt}]
    want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                          temperature=0).choices[0].message.content
    args = EngineArgs(model=str(real_model_path), kv_cache_memory="256MiB",
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    with run_server(args) as (url, _):
        spec = openai_client(f"{url}/v1")
        got = spec.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                           temperature=0)
        assert got.choices[0].message.content == want
        chunks = spec.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                              temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert metric(url, "kvserve:spec_decode_num_draft_tokens_total") > 0
        assert metric(url, "kvserve:spec_decode_num_accepted_tokens_total") > 0
        assert 'method="ngram"' in httpx.get(f"{url}/metrics").text


def test_request_timeline_and_engine_steps(server, client):
    url = server[0]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                  temperature=0)
    t = httpx.get(f"{url}/v1/requests/{r.id}/timeline").json()
    assert t["id"] == r.id and t["finished"] and t["object"] == "request.timeline"
    kinds = [e["event"] for e in t["samples"][0]["events"]]
    assert kinds[0] == "arrival" and kinds[-1] == "finished" and "first_token" in kinds
    assert t["breakdown"] == pytest.approx(r.model_extra["timings"])
    missing = httpx.get(f"{url}/v1/requests/cmpl-nope/timeline")
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "request_id"
    steps = httpx.get(f"{url}/v1/engine/steps", params={"limit": 3}).json()["data"]
    assert 1 <= len(steps) <= 3
    assert {"schedule", "prepare", "forward", "sample", "output", "total"} <= steps[-1].keys()
    assert httpx.get(f"{url}/v1/engine/steps", params={"limit": 0}).status_code == 400
    assert metric(url, "kvserve:engine_step_seconds_count") > 0


def test_trace_command(server, client, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    url = server[0]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                  temperature=0)
    out = tmp_path / "trace.png"
    assert main(["trace", r.id, "--url", url, "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "arrival" in text and "first_token" in text and "breakdown:" in text
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["trace", "cmpl-unknown", "--url", url, "--output", str(out)]) == 2
    assert "HTTP 404" in capsys.readouterr().err


def test_web_ui_and_dashboard_stats(server, client):
    url = server[0]
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text and "/v1/engine/stats" in page.text
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    s = httpx.get(f"{url}/v1/engine/stats").json()
    assert s["model"] == MODEL and s["running"] >= 0 and s["waiting"] >= 0
    assert 0 <= s["kv"]["usage"] <= 1 and s["kv"]["blocks"] > 0
    assert s["output_tokens_per_s"] >= 0 and s["ttft_ms"]["p50"] > 0
    assert s["recent"] and {"id", "arrival_unix", "breakdown", "segments"} <= s["recent"][-1].keys()
    kinds = {seg[0] for seg in s["recent"][-1]["segments"]}
    assert {"queue", "prefill", "decode"} <= kinds


def test_embeddings(server, client, loose_client):
    r = loose_client.embeddings.create(model=MODEL, input=["The cat sat.", "A dog ran.",
                                                     "The cat sat."])
    vecs = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and len(vecs[0]) == 576
    assert all(abs(sum(x * x for x in v) - 1) < 1e-3 for v in vecs)
    assert vecs[0] == vecs[2] and vecs[0] != vecs[1]
    assert r.usage.prompt_tokens > 0 and r.object == "list" and r.model == MODEL
    assert all(d.object == "embedding" for d in r.data)
    floats = client.embeddings.create(model=MODEL, input="The cat sat.",
                                      encoding_format="float").data[0].embedding
    assert floats == pytest.approx(vecs[0], abs=1e-6)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="x", dimensions=8)
    err = _error(_post(server[0], "/v1/embeddings", {"input": []}), 400)
    assert err["param"] == "input"
