"""The OpenAPI document the server publishes describes every body it sends on the OpenAI
routes, and the suite holds the server to it: tests.server_utils.openapi_checks checks each
response and stream chunk any test receives (conftest turns it on for the whole run). Here:
the document names the bodies, and a body or chunk that breaks it fails the request."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve.engine.llm_engine import EngineArgs
from kvserve.entrypoints.server import responses
from tests.server_utils import async_openai_client, openai_client, run_server

pytestmark = pytest.mark.slow

ROUTES = {("post", "/v1/completions"): "Completion",
          ("post", "/v1/chat/completions"): "ChatCompletion",
          ("post", "/v1/embeddings"): "EmbeddingList", ("get", "/v1/models"): "ModelList",
          ("post", "/tokenize"): "Tokenized", ("post", "/detokenize"): "Detokenized"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with run_server(EngineArgs(model=str(tiny_llama_dir), dtype="float32")) as (url, app):
        yield url, app


def test_the_document_describes_every_body(server):
    url, _ = server
    doc = httpx.get(f"{url}/openapi.json").json()
    for (method, path), model in ROUTES.items():
        answers = doc["paths"][path][method]["responses"]
        assert answers["200"]["content"]["application/json"]["schema"] == \
            {"$ref": f"#/components/schemas/{model}"}
        for errors in ("4XX", "5XX"):
            assert answers[errors]["content"]["application/json"]["schema"] == \
                {"$ref": "#/components/schemas/ErrorResponse"}
        assert "422" not in answers  # a malformed body is a 400 with OpenAI's error body
    for path, chunk in [("/v1/completions", "CompletionChunk"),
                        ("/v1/chat/completions", "ChatCompletionChunk")]:
        stream = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
        assert stream["schema"]["oneOf"] == [{"$ref": f"#/components/schemas/{chunk}"},
                                             {"$ref": "#/components/schemas/ErrorResponse"}]
    schemas = doc["components"]["schemas"]
    assert schemas["CompletionChoice"]["additionalProperties"] is False
    assert schemas["CompletionChunk"]["properties"]["object"]["const"] == "text_completion"


def test_bodies_and_errors_pass_the_check(server):
    url, _ = server
    client = openai_client(url)
    model = client.models.list().data[0].id
    client.chat.completions.create(model=model, max_tokens=3, logprobs=True, top_logprobs=2,
                                   messages=[{"role": "user", "content": "hi"}])
    for c in client.chat.completions.create(model=model, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "hi"}]):
        assert c.object == "chat.completion.chunk"
    loose = openai_client(url, strict=False)  # LOOSE_BECAUSE: null finish_reason, echo
    loose.completions.create(model=model, prompt="ab", max_tokens=2, echo=True, logprobs=1)
    list(loose.completions.create(model=model, prompt=["a", "b"], max_tokens=2, n=2,
                                  stream=True, stream_options={"include_usage": True}))
    loose.embeddings.create(model=model, input=["a", "b"], encoding_format="base64")
    assert httpx.post(f"{url}/tokenize", json={"prompt": "abc"}).status_code == 200
    assert httpx.post(f"{url}/detokenize", json={"tokens": [5, 6]}).status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": -1}) \
        .status_code == 400
    assert httpx.post(f"{url}/v1/completions", content=b"{nope").status_code == 400
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "a", "model": "other"}) \
        .status_code == 404


def _misspell(body: dict) -> dict:
    choice = (body.get("choices") or [{}])[0]
    if "finish_reason" in choice:
        choice["finsh_reason"] = choice.pop("finish_reason")
    return body


@pytest.mark.parametrize("method", ["completion", "completion_chunk", "chat", "chat_chunk"])
def test_a_body_that_breaks_the_document_fails_the_request(server, monkeypatch, method):
    """The check is live on every client the tests use: a misspelt field in a body or in
    one stream chunk fails the request, naming the field."""
    url, _ = server
    built = getattr(responses.Formatter, method)
    monkeypatch.setattr(responses.Formatter, method,
                        lambda self, *a, **kw: _misspell(built(self, *a, **kw)))
    stream = method.endswith("_chunk")
    client = openai_client(url, strict=False)
    with pytest.raises(Exception, match="finsh_reason") as caught:
        if method.startswith("chat"):
            out = client.chat.completions.create(
                model="tiny-llama0", messages=[{"role": "user", "content": "hi"}],
                max_tokens=2, stream=stream)
        else:
            out = client.completions.create(model="tiny-llama0", prompt="hi", max_tokens=2,
                                            stream=stream)
        if stream:
            list(out)
    assert "breaks the server's OpenAPI document" in repr(caught.value) + repr(
        caught.value.__cause__)


def test_the_async_clients_are_checked_too(server, monkeypatch):
    url, _ = server
    built = responses.Formatter.chat
    monkeypatch.setattr(responses.Formatter, "chat",
                        lambda self, *a, **kw: _misspell(built(self, *a, **kw)))

    async def ask() -> None:
        client = async_openai_client(url, strict=False)
        await client.chat.completions.create(
            model="tiny-llama0", messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    with pytest.raises(Exception) as caught:
        asyncio.run(ask())
    assert "finsh_reason" in repr(caught.value) + repr(caught.value.__cause__)
