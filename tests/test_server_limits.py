"""Request limits (each a 400 naming the field and the flag), the keys that guard routes,
and the integrity report, on a tiny model."""

from __future__ import annotations

import httpx
import pytest

from kvserve.engine.llm_engine import EngineArgs
from kvserve.entrypoints.server.limits import RequestLimits
from tests.server_utils import run_server

KEY, METRICS_KEY = "sk-test-7f3a9d", "metrics-key-2b8c41"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = RequestLimits(max_n=2, max_logprobs=3, max_stop_strings=2, max_stop_length=5,
                       max_logit_bias=2, max_prompts=2, max_prompt_tokens=10)


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=4,
                      num_kv_blocks=128)
    with run_server(args, api_key=KEY, metrics_api_key=METRICS_KEY, limits=LIMITS) as (u, _):
        yield u


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)


@pytest.mark.parametrize("path, body, param, flag", [
    ("/v1/completions", {"prompt": "hi", "n": 3}, "n", "--max-n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 4}, "logprobs", "--max-logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 4}, "prompt_logprobs",
     "--max-logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 5}, "top_logprobs",
     "--max-logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop",
     "--max-stop-strings"),
    ("/v1/completions", {"prompt": "hi", "stop": "toolong"}, "stop", "--max-stop-length"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 1, "2": 1, "3": 1}},
     "logit_bias", "--max-logit-bias"),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt", "--max-prompts"),
    ("/v1/completions", {"prompt": "a b c d e f g h i j k l"}, "prompt",
     "--max-prompt-tokens"),
    ("/v1/completions", {"prompt": list(range(2, 20))}, "prompt", "--max-prompt-tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "twelve chars"}]},
     "messages", "--max-prompt-tokens"),
    ("/v1/embeddings", {"input": ["a", "b", "c"]}, "input", "--max-prompts"),
])
def test_each_limit_is_a_400_naming_it(url, path, body, param, flag):
    r = post(url, path, {"max_tokens": 2, **body} if path != "/v1/embeddings" else body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and flag in err["message"]


def test_within_the_limits_it_serves(url):
    r = post(url, "/v1/completions", {"prompt": [5, 6, 7], "n": 2, "logprobs": 3,
                                      "stop": ["ab", "cd"], "logit_bias": {"5": 1},
                                      "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_keys_guard_the_routes(url):
    for path in ("/v1/models", "/v1/engine/stats", "/v1/engine/steps", "/v1/engine/integrity",
                 "/v1/requests/x/timeline"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(f"{url}/detokenize", json={"tokens": [5]}).status_code == 401
    assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 401  # its own key
    assert httpx.get(f"{url}/metrics", headers={
        "Authorization": f"Bearer {METRICS_KEY}"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and KEY not in page.text and METRICS_KEY not in page.text


def test_integrity_report(url):
    post(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4})
    r = httpx.get(f"{url}/v1/engine/integrity", headers=AUTH, timeout=60).json()
    assert r["ok"] is True and r["error"] is None
    assert r["running"] == 0 and r["kv_free_blocks"] == r["kv_blocks"]
