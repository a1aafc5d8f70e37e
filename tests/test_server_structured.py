"""Structured outputs and tool calls through the server, judged by the official openai client
and jsonschema, on the default model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from kvserve.engine.llm_engine import EngineArgs
from tests.server_utils import openai_client, run_server

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(real_model_path):
    args = EngineArgs(model=str(real_model_path), kv_cache_memory="512MiB")
    with run_server(args, enable_auto_tool_choice=True, tool_call_parser="hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(f"{server[0]}/v1")


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"], "additionalProperties": False},
            "city": {"type": "string", "maxLength": 24}},
        "required": ["person", "city"], "additionalProperties": False},
    "array": {
        "type": "object",
        "properties": {"colors": {"type": "array", "minItems": 2, "maxItems": 4,
                                  "items": {"enum": ["red", "green", "blue", "black"]}}},
        "required": ["colors"], "additionalProperties": False},
    "numbers": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10},
                       "count": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["score", "count"], "additionalProperties": False},
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"], "additionalProperties": False},
    "anyof_null": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                           {"type": "null"}]},
                       "note": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["value", "note"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(client, name):
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=MODEL, messages=ask(f"Reply with JSON for: {name}."), temperature=0.9, n=3,
        seed=7, max_tokens=200,
        response_format={"type": "json_schema",
                         "json_schema": {"name": name, "schema": schema, "strict": True}})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=150)


def test_parse_with_a_pydantic_model(client):
    r = client.beta.chat.completions.parse(
        model=MODEL, messages=ask("Invent a person."), response_format=Person,
        temperature=0.9, seed=1, max_tokens=100)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 150


def test_json_object_regex_and_choice(client):
    r = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:",
                                  max_tokens=200, temperature=0.9, seed=3,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Give a date."), max_tokens=30, temperature=0.9, seed=4,
        extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert len(r.choices[0].message.content) == 10 and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Is the sky blue?"), max_tokens=10, temperature=0.9, n=3,
        extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(c.message.content in ("yes", "no", "maybe") for c in r.choices)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, ADD)}


def _check_call(call) -> None:
    schema = TOOLS[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id and call.type == "function"


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "add"}}])
def test_forced_tool_calls_validate(client, choice):
    r = client.chat.completions.create(
        model=MODEL, messages=ask("What is 2 plus 3? And the weather in Paris?"),
        tools=[WEATHER, ADD], tool_choice=choice, temperature=0.9, n=2, seed=5,
        max_tokens=150)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c.message
        assert c.message.tool_calls and c.message.content is None
        for call in c.message.tool_calls:
            _check_call(call)
        if isinstance(choice, dict):
            assert [t.function.name for t in c.message.tool_calls] == ["add"]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_concatenate_to_valid_json(client, choice):
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("Weather in Oslo?"), tools=[WEATHER, ADD],
        tool_choice=choice, temperature=0.9, seed=6, max_tokens=150, stream=True,
        parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or tc.id
            entry["name"] = entry["name"] or (tc.function.name if tc.function else None)
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    (call,) = calls.values()
    assert call["id"] and call["name"] in TOOLS
    jsonschema.validate(json.loads(call["arguments"]),
                        TOOLS[call["name"]]["function"]["parameters"])


def test_a_tool_result_turn(client):
    messages = [
        *ask("What is 2 plus 3?"),
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD],
                                       tool_choice="none", max_tokens=20, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_auto_tool_choice_parses_the_models_own_format(client):
    # SmolLM2 does not call tools in hermes format: the reply is plain content.
    r = client.chat.completions.create(model=MODEL, messages=ask("Say hello."),
                                       tools=[WEATHER], max_tokens=12, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.tool_calls is None


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "guided_json"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tools": [ADD], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]},
     "messages.tool_calls.0.function.arguments"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_bad_constraints_and_tools_get_400(server, body, param):
    payload = {"messages": ask("hi"), "max_tokens": 4, **body}
    err = _error(httpx.post(f"{server[0]}/v1/chat/completions", json=payload, timeout=60))
    assert err["param"] == param, err


def test_vllm_stream_extensions_are_honoured(server):
    """What guidellm sends: `stop: null` and usage in every chunk."""
    with httpx.stream("POST", f"{server[0]}/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 5, "stop": None, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    counted = [c["usage"]["completion_tokens"] for c in chunks if c.get("choices")]
    assert counted == sorted(counted) and counted[-1] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_grammar_phase_in_the_step_profile(server, client):
    client.chat.completions.create(model=MODEL, messages=ask("JSON please"), max_tokens=30,
                                   extra_body={"response_format": {"type": "json_object"}})
    steps = httpx.get(f"{server[0]}/v1/engine/steps", params={"limit": 500}).json()["data"]
    assert any(s["grammar"] > 0 for s in steps)
    text = httpx.get(f"{server[0]}/metrics").text
    assert 'kvserve:engine_step_seconds_count{model_name="SmolLM2-135M-Instruct",' \
           'phase="grammar",replica="0"}' in text


def test_tool_call_parser_auto_reads_the_template(real_model_path):
    """--tool-call-parser auto takes the form the chat template shows: SmolLM2's shows none,
    so tool_choice auto is a 400 that says so (and required still works, by grammar)."""
    args = EngineArgs(model=str(real_model_path), kv_cache_memory="256MiB")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]}}}
    with run_server(args, enable_auto_tool_choice=True, tool_call_parser="auto") as (url, _):
        client = openai_client(f"{url}/v1")
        with pytest.raises(openai.BadRequestError, match="found no tool-call form") as e:
            client.chat.completions.create(model=MODEL, messages=ask("Weather in Oslo?"),
                                           tools=[weather], max_tokens=8)
        assert e.value.param == "tool_choice"
        r = client.chat.completions.create(model=MODEL, messages=ask("Weather in Oslo?"),
                                           tools=[weather], tool_choice="required",
                                           max_tokens=100, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_of_three_tool_turns(client, stream):
    """call -> result -> call -> result -> answer through chat completions, the calls forced
    one at a time (required, parallel_tool_calls false), whole and streamed."""
    messages = ask("Add 2 and 3, then add 10 to the result.")
    for result in ("5", "15"):
        kw = {"model": MODEL, "messages": messages, "tools": [ADD], "tool_choice": "required",
              "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0}
        if stream:
            args, call_id, name = "", None, None
            for chunk in client.chat.completions.create(**kw, stream=True):
                for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    call_id, name = tc.id or call_id, tc.function.name or name
                    args += tc.function.arguments or ""
        else:
            (call,) = client.chat.completions.create(**kw).choices[0].message.tool_calls
            call_id, name, args = call.id, call.function.name, call.function.arguments
        assert name == "add" and call_id
        jsonschema.validate(json.loads(args), ADD["function"]["parameters"])
        messages = [*messages, {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD],
                                       tool_choice="none", max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.tool_calls is None


def test_mistral_calls_keep_their_control_token(tiny_mistral_dir, tmp_path):
    """A vocabulary with Mistral's [TOOL_CALLS] as a special token: tool_choice auto's
    grammar opens calls at that token, and the server decodes keeping it (as it would
    otherwise drop a special token), so the parser finds the call. The tiny random model is
    pushed to open a call with a logit bias; the grammar then writes it."""
    import shutil

    from tokenizers import Tokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_mistral_dir, model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.add_special_tokens(["[TOOL_CALLS]"])
    tok.save(str(model / "tokenizer.json"))
    marker = tok.token_to_id("[TOOL_CALLS]")
    # The marker first, and "]" wherever the grammar allows it (after a call): one call.
    bias = {str(marker): 100, str(tok.encode("]", add_special_tokens=False).ids[0]): 50}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
        "required": ["unit"], "additionalProperties": False}}}
    args = EngineArgs(model=str(model), dtype="float32", max_num_seqs=4)
    with run_server(args, enable_auto_tool_choice=True, tool_call_parser="mistral") as (url, _):
        client = openai_client(f"{url}/v1")
        out = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=ask("Weather?"), tools=[tool],
            temperature=0, max_tokens=100, logit_bias=bias)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.message.content is None
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        plain = client.chat.completions.create(
            model=out.model, messages=ask("Weather?"), temperature=0, max_tokens=8)
        assert "[TOOL_CALLS]" not in (plain.choices[0].message.content or "")
