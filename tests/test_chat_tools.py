"""The chat endpoint's tool-choice plans and messages on text fixtures: what each mode
constrains, and how a choice's text becomes a message or a stream of deltas."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.server.chat_tools import (
    ChoiceStream,
    chat_message,
    finish_reason,
    plan_chat,
)
from kvserve.entrypoints.server.errors import APIError
from kvserve.entrypoints.server.protocol import ChatCompletionRequest
from kvserve.entrypoints.server.protocol_messages import MessagesRequest

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
MUL = {"type": "function", "function": {"name": "mul"}}


def plan(tool_parser=None, reasoning=None, **body):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
    spec, field = req.structured()
    return plan_chat(req, spec, field, tool_parser, reasoning)


def streamed(p, text: str, size: int) -> dict:
    """The deltas of `text` fed `size` characters at a time, merged per field."""
    cs = ChoiceStream(p)
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    out = {"content": "", "reasoning_content": "", "calls": {}}
    for i, piece in enumerate(pieces):
        for d in cs.feed(piece, i == len(pieces) - 1):
            for k in ("content", "reasoning_content"):
                out[k] += d.get(k, "")
            for tc in d.get("tool_calls", []):
                call = out["calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
                call["name"] = call["name"] or tc["function"].get("name")
                call["arguments"] += tc["function"]["arguments"]
    out["has_calls"] = cs.has_calls
    return out


def test_modes_and_their_constraints():
    assert plan().mode == "none" and plan().constraint is None
    named = plan(tools=[ADD, MUL], tool_choice={"type": "function",
                                                "function": {"name": "add"}})
    assert named.mode == "named" and json.loads(named.constraint.json) == \
        ADD["function"]["parameters"]
    required = plan(tools=[ADD, MUL], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.constraint.json)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    auto = plan("hermes", tools=[ADD])  # the lazy grammar: a call, once opened, is valid
    assert auto.mode == "auto" and auto.tools and auto.constraint_field == "tools"
    assert auto.constraint.grammar.startswith("start: call* TEXT")
    assert '"const": "add"' in auto.constraint.grammar
    assert "<function=add>" in plan("qwen3_coder", tools=[ADD]).constraint.grammar
    assert "[TOOL_CALLS]" in plan("mistral", tools=[ADD]).constraint.grammar
    own = plan("hermes", tools=[ADD], response_format={"type": "json_object"})
    assert own.constraint.json_object  # the request's own constraint wins
    assert plan(tools=[ADD], tool_choice="none").tools is None
    thinking = plan(reasoning="qwen3", response_format={"type": "json_object"})
    assert thinking.constraint.reasoning_end == "</think>"
    assert thinking.thinking_budget is None
    budget = plan(reasoning="deepseek_r1", thinking_token_budget=7)
    assert budget.constraint is None
    assert (budget.thinking_budget.end, budget.thinking_budget.tokens) == ("</think>", 7)


@pytest.mark.parametrize("reasoning, kwargs, says", [
    (None, None, "--reasoning-parser"), ("gpt-oss", None, "--reasoning-parser"),
    ("qwen3", {"enable_thinking": False}, "turns it off")])
def test_a_thinking_budget_needs_thinking_with_an_end_tag(reasoning, kwargs, says):
    with pytest.raises(APIError) as e:
        plan(reasoning=reasoning, thinking_token_budget=5, chat_template_kwargs=kwargs)
    assert e.value.status == 400 and e.value.param == "thinking_token_budget"
    assert says in str(e.value)


def test_anthropic_thinking_and_effort_become_the_chat_requests():
    def chat(**kw):
        return MessagesRequest(max_tokens=50, messages=[{"role": "user", "content": "hi"}],
                               **kw).chat_request()

    enabled = chat(thinking={"type": "enabled", "budget_tokens": 20})
    assert enabled.thinking_token_budget == 20
    assert enabled.chat_template_kwargs == {"enable_thinking": True}
    assert chat(thinking={"type": "adaptive"}).thinking_token_budget is None
    assert chat(thinking={"type": "disabled"}).chat_template_kwargs == \
        {"enable_thinking": False}
    plain = chat()
    assert plain.chat_template_kwargs is None and plain.reasoning_effort is None
    assert [chat(output_config={"effort": e}).reasoning_effort
            for e in ("low", "medium", "high", "xhigh", "max")] == \
        ["low", "medium", "high", "high", "high"]
    for thinking in ({"type": "enabled"}, {"type": "enabled", "budget_tokens": 50},
                     {"type": "adaptive", "budget_tokens": 10}):
        with pytest.raises(APIError) as e:
            chat(thinking=thinking)
        assert e.value.status == 400 and e.value.param == "thinking.budget_tokens"


@pytest.mark.parametrize("body, param", [
    ({"tools": [ADD]}, "tool_choice"),  # auto without a parser
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": [ADD, ADD], "tool_choice": "required"}, "tools"),
    ({"tools": [ADD], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests(body, param):
    with pytest.raises(APIError) as e:
        plan(**body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 1000])
def test_messages_and_streams_agree(size):
    cases = [
        (plan(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}}),
         '{"a": 3}'),
        (plan(tools=[ADD, MUL], tool_choice="required"),
         '[{"name": "add", "parameters": {"a": 1}}, {"name": "mul", "parameters": {}}]'),
        (plan("hermes", tools=[ADD]),
         'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'),
        (plan("hermes", "deepseek_r1", tools=[ADD]),
         'I should add.</think>\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}'
         '\n</tool_call>'),
        (plan(reasoning="deepseek_r1"), "Thinking hard.</think>\n\nThe answer."),
        (plan(), "Plain text."),
    ]
    for p, text in cases:
        message, has_calls = chat_message(p, text)
        s = streamed(p, text, size)
        assert s["content"] == (message["content"] or "")
        assert s["reasoning_content"] == (message.get("reasoning_content") or "")
        calls = message.get("tool_calls", [])
        # The same strings: the model's own text of the arguments, whole and streamed.
        assert [(c["name"], c["arguments"]) for c in s["calls"].values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert has_calls == s["has_calls"] == bool(calls)
        assert finish_reason("stop", has_calls) == ("tool_calls" if calls else "stop")
        assert finish_reason("length", has_calls) == "length"


def test_required_output_cut_short_is_content():
    p = plan(tools=[ADD], tool_choice="required")
    message, has_calls = chat_message(p, '[{"name": "add", "param')
    assert not has_calls and message["content"] == '[{"name": "add", "param'


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_required_and_auto_stream_arguments_piece_by_piece(tool_choice):
    """In required and auto (as for a named function) a call's arguments leave as the model
    writes them: fed a character at a time, one tool-call delta a character, the first with
    the call's id and name."""
    p = plan("hermes", tools=[ADD, MUL], tool_choice=tool_choice)
    args = '{"a": 12, "b": [3, {"c": "}"}]}'
    text = ('[{"name": "mul", "parameters": ' + args + '}, {"name": "add", "parameters": {}}]'
            if tool_choice == "required" else
            'On it.\n<tool_call>\n{"name": "mul", "arguments": ' + args + '}\n</tool_call>')
    cs = ChoiceStream(p)
    pieces = [tc for i, ch in enumerate(text) for d in cs.feed(ch, i == len(text) - 1)
              for tc in d.get("tool_calls", [])]
    first = [tc for tc in pieces if tc["index"] == 0]
    assert first[0]["function"]["name"] == "mul" and first[0]["id"].startswith("call_")
    assert all("id" not in tc for tc in first[1:])
    assert "".join(tc["function"]["arguments"] for tc in first) == args
    assert len([tc for tc in first if tc["function"]["arguments"]]) == len(args)
    message, _ = chat_message(p, text)
    assert message["tool_calls"][0]["function"]["arguments"] == args
    assert cs.tools is not None and cs.tools.broken == []


def test_required_stream_cut_short_marks_its_calls_broken():
    p = plan(tools=[ADD], tool_choice="required")
    text = '[{"name": "add", "parameters": {"a": 1}}, {"name": "add", "parameters": {"a'
    s = streamed(p, text, 3)
    assert s["content"] == "" and [c["arguments"] for c in s["calls"].values()] == \
        ['{"a": 1}', '{"a']
    cs = ChoiceStream(p)
    cs.feed(text, True)
    assert cs.tools is not None and cs.tools.broken == [0, 1]


def test_a_call_after_the_thinking():
    """With a reasoning parser, the thinking goes to reasoning_content and a call after
    </think> is a call, whole and streamed."""
    p = plan("hermes", reasoning="qwen3", tools=[ADD])
    text = ('<think>I should add.</think>\n<tool_call>\n{"name": "add", "arguments": '
            '{"a": 1, "b": 2}}\n</tool_call>')
    message, has_calls = chat_message(p, text)
    assert has_calls and message["reasoning_content"] == "I should add."
    assert message["tool_calls"][0]["function"]["name"] == "add"
    stream = ChoiceStream(p)
    deltas = [d for i in range(0, len(text), 5)
              for d in stream.feed(text[i:i + 5], i + 5 >= len(text))]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should add."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "add" and stream.has_calls
