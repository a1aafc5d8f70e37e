"""OpenAI's Responses API (/v1/responses) through the official client with strict response
validation, on the default model: plain and streamed answers, instructions,
previous_response_id, text.format, function tools (forced by grammar, so a 135M model calls
them) and function_call_output turns, an agent loop, and errors. Every body and event is also
checked against the server's OpenAPI document (conftest's openapi_checks)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from kvserve.engine.llm_engine import EngineArgs
from tests.server_utils import openai_client, run_server

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(real_model_path):
    args = EngineArgs(model=str(real_model_path), kv_cache_memory="512MiB")
    with run_server(args, enable_auto_tool_choice=True, tool_call_parser="hermes",
                    responses_store_size=4) as s:
        yield s[0]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def test_response_matches_chat_completions(client):
    """The same conversation gives the same tokens through both APIs (one engine path)."""
    r = client.responses.create(model=MODEL, input="Name a color.",
                                instructions="You are terse.", max_output_tokens=24,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    assert [i.type for i in r.output] == ["message"]
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_reasoning_effort_is_answered_and_harmless_to_other_templates(client):
    """`reasoning.effort` goes to the chat template as reasoning_effort (tests/test_harmony);
    SmolLM2's template does not read it, so the tokens are the same as without it."""
    kw = {"model": MODEL, "input": "Name a color.", "max_output_tokens": 8, "temperature": 0}
    plain = client.responses.create(**kw)
    low = client.responses.create(**kw, reasoning={"effort": "low"})
    assert low.reasoning.effort == "low" and plain.reasoning.effort is None
    assert low.output_text == plain.output_text


def test_incomplete_at_max_output_tokens(client):
    r = client.responses.create(model=MODEL, input="Count from one to twenty.",
                                max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_stream_events_build_the_same_response(client):
    kw = {"model": MODEL, "input": "Say one short sentence about the sea.", "max_output_tokens": 80,
          "temperature": 0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    with client.responses.stream(**kw) as s:
        final = s.get_final_response()
    assert final.output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hi.",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=12,
                                     temperature=0)
    assert second.previous_response_id == first.id
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada. Say hi."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.BadRequestError, match="previous_response_id|not found"):
        client.responses.create(model=MODEL, input="hi", previous_response_id=unstored.id)


def test_retrieve_and_delete_a_stored_response(client):
    r = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=8,
                                temperature=0)
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    streamed = list(client.responses.create(model=MODEL, input="Name a fruit.",
                                            max_output_tokens=8, temperature=0,
                                            stream=True))[-1].response
    assert client.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_keeps_the_most_recent(client):
    """--responses-store-size 4 here: the oldest conversation is dropped first."""
    ids = [client.responses.create(model=MODEL, input=f"hi {i}", max_output_tokens=1).id
           for i in range(5)]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id=ids[0],
                                max_output_tokens=1)
    client.responses.create(model=MODEL, input="x", previous_response_id=ids[-1],
                            max_output_tokens=1)


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1,
                                                         "maximum": 9}},
              "required": ["color", "count"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Pick a color and a count.",
                                max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "pick",
                                                 "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_of_three_tool_turns(client, stream):
    """call -> result -> call -> result -> answer, with the calls forced (required), the
    outputs sent back as function_call_output items, the last turn free (none)."""
    items: list = [{"role": "user", "content": "Compare the weather in Paris and Rome."}]
    calls = []
    for turn, city_result in enumerate(["Paris: sunny", "Rome: rain"]):
        kw = {"model": MODEL, "input": items, "tools": [WEATHER], "tool_choice": "required",
              "parallel_tool_calls": False, "max_output_tokens": 60, "temperature": 0}
        if stream:
            with client.responses.stream(**kw) as s:
                r = s.get_final_response()
        else:
            r = client.responses.create(**kw)
        (call,) = [i for i in r.output if i.type == "function_call"]
        assert call.name == "get_weather", turn
        assert isinstance(json.loads(call.arguments)["city"], str)
        calls.append(call)
        items += [call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id,
                   "output": city_result}]
    answer = client.responses.create(model=MODEL, input=items, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=30,
                                     temperature=0)
    assert answer.status == "completed"
    assert all(i.type == "message" for i in answer.output)
    assert len({c.call_id for c in calls}) == 2
    # The items are the conversation chat completions would be sent: the same prompt.
    messages: list[dict] = [items[0]]
    for call, result in zip(calls, ["Paris: sunny", "Rome: rain"], strict=True):
        messages += [{"role": "assistant", "content": "", "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                          temperature=0, tools=[{"type": "function",
                                                                 "function": {
                                                                     k: WEATHER[k] for k in
                                                                     ("name", "description",
                                                                      "parameters")}}],
                                          tool_choice="none")
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == (chat.choices[0].message.content or "")


def test_named_function_choice(client):
    r = client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=60, temperature=0)
    assert [i.type for i in r.output] == ["function_call"]
    assert set(json.loads(r.output[0].arguments)) == {"city"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, None),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_bad_input_is_a_400(server, body, param):
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param.split(".")[0])
