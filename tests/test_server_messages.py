"""Anthropic's Messages API (/v1/messages) through Anthropic's own client, with its strict
response validation, on the default model: plain and streamed answers, stop reasons, tools
(forced by grammar, so a 135M model calls them), a tool_result turn, token counting, and
errors in Anthropic's shape. Every body and event is also checked against the server's
OpenAPI document (conftest's openapi_checks)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from kvserve.engine.llm_engine import EngineArgs
from tests.server_utils import openai_client, run_server

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
MODEL = "SmolLM2-135M-Instruct"
# Anthropic's client no longer sends sampling fields; kvserve still takes them (greedy here,
# so that the answers compare).
T0 = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(real_model_path):
    args = EngineArgs(model=str(real_model_path), kv_cache_memory="512MiB")
    with run_server(args, api_key="sesame", enable_auto_tool_choice=True,
                    tool_call_parser="hermes") as s:
        yield s[0]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="sesame", max_retries=0,
                               _strict_response_validation=True)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_message_matches_chat_completions(client, server):
    """The same conversation gives the same tokens through both APIs (one engine path)."""
    msg = client.messages.create(model=MODEL, max_tokens=24, **T0,
                                 system="You are terse.", messages=ask("Name a color."))
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in msg.content] == ["text"]
    chat = openai_client(server, api_key="sesame").chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."}])
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == \
        chat.usage.prompt_tokens
    count = client.messages.count_tokens(model=MODEL, system="You are terse.",
                                         messages=ask("Name a color."))
    assert count.input_tokens == chat.usage.prompt_tokens


def test_stop_reasons(client):
    q = ask("List three colors, separated by commas.")
    cut = client.messages.create(model=MODEL, max_tokens=3, **T0, messages=q)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    free = client.messages.create(model=MODEL, max_tokens=40, **T0, messages=q)
    assert free.stop_reason == "end_turn"
    text = free.content[0].text
    word = text.split()[-1]  # a word it writes, after some text
    stopped = client.messages.create(model=MODEL, max_tokens=40, **T0, stop_sequences=[word],
                                     messages=q)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]


def test_stream_events_build_the_same_message(client):
    kw = {"model": MODEL, "max_tokens": 30, **T0,
          "messages": ask("Say something about the sea.")}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_of_three_tool_turns(client, stream):
    """tool_use -> tool_result -> tool_use -> tool_result -> answer, each answer's blocks
    sent back as the client holds them."""
    turns: list = ask("Compare the weather in Paris and Rome.")
    for result in ("Paris: sunny", "Rome: rain"):
        kw = {"model": MODEL, "max_tokens": 60, **T0, "tools": [WEATHER], "messages": turns,
              "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
        if stream:
            with client.messages.stream(**kw) as s:
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**kw)
        (use,) = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and use.name == "get_weather"
        turns = [*turns, {"role": "assistant", "content": msg.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": result}]}]
    answer = client.messages.create(model=MODEL, max_tokens=30, **T0, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=turns)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in answer.content)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_turn_and_tool_result(client, stream):
    """tool_choice any (a grammar: any model calls), the call as a tool_use block, then a
    tool_result turn answered in text, as an agent loop sends them."""
    kw = {"model": MODEL, "max_tokens": 60, **T0, "tools": [WEATHER],
          "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
          "messages": ask("What is the weather in Paris?")}
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    answer = client.messages.create(
        model=MODEL, max_tokens=30, **T0, tools=[WEATHER], messages=[
            # the answer's blocks as the client holds them (as agent loops send them back)
            *kw["messages"], {"role": "assistant", "content": msg.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "Sunny, 21 C"}]}],
        tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]


def test_named_tool_choice(client):
    msg = client.messages.create(model=MODEL, max_tokens=60, **T0, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=ask("Weather in Rome?"))
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["tool_use"]
    assert set(msg.content[0].input) == {"city"}


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "top_k": -1}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "model": "claude-nope", "messages": [{"role": "user",
                                                             "content": "hi"}]}, 404,
     "not_found_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "tool"}, "tools": [WEATHER]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error"),
])
def test_errors_in_anthropics_shape(server, body, status, kind):
    r = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": "sesame"})
    assert r.status_code == status
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind
    assert payload["error"]["message"]


def test_api_key_by_either_header(server):
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server}/v1/messages", json=body,
                   headers={"authorization": "Bearer sesame"})
    assert r.status_code == 200 and r.json()["type"] == "message"
    bad = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=2, messages=ask("hi"))


def test_assistant_prefill_is_continued(client, server):
    """A last assistant turn is a prefill: the answer continues it (and holds only what
    follows), as chat completions' continue_final_message gives it."""
    turns = [*ask("Describe the sky."), {"role": "assistant", "content": "The sky is"}]
    msg = client.messages.create(model=MODEL, max_tokens=12, **T0, messages=turns)
    chat = openai_client(server, api_key="sesame").chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, messages=turns,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert msg.content[0].text == chat.choices[0].message.content
    assert not msg.content[0].text.startswith("The sky is")
    count = client.messages.count_tokens(model=MODEL, messages=turns)
    assert count.input_tokens == chat.usage.prompt_tokens  # counted as it is rendered


def test_output_config_json_schema(client):
    """Anthropic's structured outputs: the answer is JSON valid against the schema."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1,
                                                         "maximum": 9}},
              "required": ["color", "count"], "additionalProperties": False}
    msg = client.messages.create(model=MODEL, max_tokens=40, **T0,
                                 output_config={"format": {"type": "json_schema",
                                                           "schema": schema}},
                                 messages=ask("Pick a color and a count."))
    jsonschema.validate(json.loads(msg.content[0].text), schema)


@pytest.fixture(scope="module")
def thinker(real_model_path):
    """The default model read as a DeepSeek R1 model: everything before `</think>` is
    thinking. SmolLM2 never writes the tag, so its thinking ends only where a budget ends it."""
    args = EngineArgs(model=str(real_model_path), kv_cache_memory="256MiB")
    with run_server(args, reasoning_parser="deepseek_r1") as s:
        yield s[0]


def test_thinking_budget_then_the_answer(thinker):
    """thinking.budget_tokens: the first budget tokens are the thinking block (the model's
    own: they are its unbudgeted answer's first tokens), then the forced end tag, then the
    answer in a text block; streamed, the same blocks; through chat completions'
    thinking_token_budget, the same message."""
    client = anthropic.Anthropic(base_url=thinker, api_key="x", max_retries=0,
                                 _strict_response_validation=True)
    q = ask("Name three rivers.")
    thinking = {"type": "enabled", "budget_tokens": 8}
    msg = client.messages.create(model=MODEL, max_tokens=30, **T0, thinking=thinking,
                                 messages=q)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    chat = openai_client(f"{thinker}/v1")
    free = chat.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=q)
    assert not free.choices[0].message.content  # all thinking, never ended
    assert msg.content[0].thinking == free.choices[0].message.reasoning_content
    assert msg.usage.output_tokens == 30 and msg.stop_reason == "max_tokens"
    with client.messages.stream(model=MODEL, max_tokens=30, **T0, thinking=thinking,
                                messages=q) as s:
        streamed = s.get_final_message().content
    assert [b.type for b in streamed] == ["thinking", "text"]
    assert (streamed[0].thinking, streamed[1].text) == (msg.content[0].thinking,
                                                        msg.content[1].text)
    budgeted = chat.chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0, messages=q,
        extra_body={"thinking_token_budget": 8,
                    "chat_template_kwargs": {"enable_thinking": True}})
    assert budgeted.choices[0].message.reasoning_content == msg.content[0].thinking
    assert budgeted.choices[0].message.content == msg.content[1].text
    omitted = client.messages.create(model=MODEL, max_tokens=30, **T0, messages=q,
                                     thinking={**thinking, "display": "omitted"})
    assert omitted.content[0].thinking == "" and omitted.content[1] == msg.content[1]
    with client.messages.stream(model=MODEL, max_tokens=30, **T0, messages=q,
                                thinking={**thinking, "display": "omitted"}) as s:
        assert s.get_final_message().content[0].thinking == ""


@pytest.mark.parametrize("thinking, max_tokens, needs", [
    ({"type": "enabled", "budget_tokens": 1024}, 5, "thinker"),  # budget >= max_tokens
    ({"type": "enabled"}, 50, "thinker"),
    ({"type": "enabled", "budget_tokens": 10}, 50, "server"),  # no reasoning parser
    ({"type": "adaptive"}, 50, "server"),
])
def test_thinking_errors(request, thinking, max_tokens, needs):
    url = request.getfixturevalue(needs)
    r = httpx.post(f"{url}/v1/messages", headers={"x-api-key": "sesame"}, json={
        "max_tokens": max_tokens, "thinking": thinking,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "thinking" in r.json()["error"]["message"]
