"""gpt-oss's harmony format on the chat endpoint: the message scanner, the reasoning and tool
parsers (whole, and streamed at every cut), how the chat plan uses them, reasoning_effort,
and a harmony-style chat template of our own rendered in kvserve's sandbox."""

from __future__ import annotations

import json
import random
from datetime import datetime

import pytest

from kvserve.entrypoints.server import harmony
from kvserve.entrypoints.server.chat_tools import ChoiceStream, chat_message, plan_chat
from kvserve.entrypoints.server.errors import APIError
from kvserve.entrypoints.server.protocol import ChatCompletionRequest
from kvserve.entrypoints.server.reasoning import (
    GptOssReasoningParser,
    detect_reasoning_parser,
    get_reasoning_parser,
)
from kvserve.entrypoints.server.tool_parsers import (
    GptOssToolParser,
    detect_tool_parser,
    get_tool_parser,
)
from kvserve.tokenizer import ChatTemplateError
from kvserve.tokenizer.chat_template import render_chat_template
from tests.test_tool_parsers import all_splits, check_reasoning_stream, check_tool_stream

A = "<|channel|>analysis<|message|>"
F = "<|start|>assistant<|channel|>final<|message|>"
WEATHER = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
           '<|message|>{"city":"Paris"}<|call|>')


# ---------------------------------------------------------------------- the scanner


def scan(text: str, pieces: list[str] | None = None) -> list[harmony.Piece]:
    s = harmony.HarmonyScanner()
    out = [p for d in (pieces or [text]) for p in s.feed(d)]
    return out + s.finish()


def test_scanner_messages_and_headers() -> None:
    text = (A + "think<|end|>" + F + "answer<|return|>")
    pieces = scan(text)
    assert "".join(p.text for p in pieces) == text
    opens = [p.header for p in pieces if p.kind == "open"]
    assert [(h.channel, h.recipient) for h in opens] == [("analysis", None), ("final", None)]
    assert [p.text for p in pieces if p.kind == "close"] == ["<|end|>", "<|return|>"]
    # to= before or after the channel, with or without <|constrain|>
    for header in (" to=functions.f<|channel|>commentary json",
                   "<|channel|>commentary to=functions.f <|constrain|>json",
                   "<|channel|>commentary to=functions.f"):
        (h,) = [p.header for p in scan(header + '<|message|>{}<|call|>') if p.kind == "open"]
        assert (h.channel, h.recipient, h.function) == ("commentary", "functions.f", "f")
    h = harmony.parse_header("<|channel|>commentary to=browser.search", "")
    assert h.function is None  # a built-in tool: no client function


@pytest.mark.parametrize("text", [
    "plain answer, no format",
    "a very long first line " * 20 + "<|message|>x",  # too long for a header
    "<|channel|>analysis\nnot a header<|message|>x",  # a header is one line
    A + "cut off",
    "<|channel|>ana",  # a header cut off
    A + "x<|end|>stray text<|start|>assistant<|channel|>final<|message|>y",
])
def test_scanner_pieces_rebuild_the_text_at_every_cut(text: str) -> None:
    whole = scan(text)
    assert "".join(p.text for p in whole) == text
    for pieces in all_splits(text):
        cut = scan(text, pieces)
        assert "".join(p.text for p in cut) == text
        # The same messages, whatever the cuts (body pieces may be split differently).
        assert [(p.kind, p.header) for p in cut if p.kind != "body"] == \
            [(p.kind, p.header) for p in whole if p.kind != "body"], pieces


# ---------------------------------------------------------------------- reasoning

# (text, reasoning, content)
REASONING_CASES = {
    "analysis_then_final": (A + "User greets.<|end|>" + F + "Hello!<|return|>",
                            "User greets.", "Hello!"),
    "final_only": ("<|channel|>final<|message|>Hi<|return|>", None, "Hi"),
    "never_opens_final": (A + "Still thinking<|end|>", "Still thinking", None),
    "cut_off_thinking": (A + "Half a thou", "Half a thou", None),
    "plain_text_model": ("No markup at all.\nTwo lines.", None, "No markup at all.\nTwo lines."),
    "two_analyses_joined": (A + "one<|end|><|start|>assistant" + A + "two<|end|>" + F + "ok",
                            "one\n\ntwo", "ok"),
    "preamble_is_content": (A + "plan<|end|><|start|>assistant<|channel|>commentary<|message|>"
                            "Checking.<|end|>" + F + "Done.<|return|>", "plan",
                            "Checking.\n\nDone."),
    "call_passes_through": (A + "need weather<|end|>" + WEATHER, "need weather", WEATHER),
    "first_message_call": (' to=functions.f<|channel|>commentary json<|message|>{"a":1}<|call|>',
                           None, '<|start|>assistant to=functions.f<|channel|>commentary json'
                           '<|message|>{"a":1}<|call|>'),
    "end_dropped_by_decoder": (A + "t" + F + "answer", "t", "answer"),
    "newlines_trimmed": (A + "\nthink\n\n<|end|>" + F + "\n\nanswer\n", "think", "answer\n"),
    "empty_final": (A + "x<|end|>" + F + "<|return|>", "x", None),
}


@pytest.mark.parametrize("case", sorted(REASONING_CASES))
def test_gpt_oss_reasoning(case: str) -> None:
    text, reasoning, content = REASONING_CASES[case]
    assert GptOssReasoningParser().parse(text) == (reasoning, content)
    check_reasoning_stream(GptOssReasoningParser, text)


def test_gpt_oss_reasoning_streams_as_it_goes() -> None:
    p = GptOssReasoningParser()
    assert p.feed("<|chan") == ("", "")
    assert p.feed("nel|>analysis<|mess") == ("", "")
    assert p.feed("age|>Let me") == ("Let me", "")
    assert p.feed(" think.<|e") == (" think.", "")  # a marker may be starting: held
    assert not p.reasoning_done
    assert p.feed("nd|><|start|>assistant<|channel|>final<|message|>Hi") == ("", "Hi")
    assert p.reasoning_done
    assert p.feed(" there<|return|>") == ("", " there")
    assert p.finish() == ("", "")


# ---------------------------------------------------------------------- tool calls

TOOL_CASES = {
    "one_call": (WEATHER, None, [("get_weather", {"city": "Paris"})]),
    "recipient_first_no_constrain": (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
        '{"city": "Zürich"}<|call|>', None, [("get_weather", {"city": "Zürich"})]),
    "two_calls": (
        '<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{}<|end|>'
        + WEATHER, None, [("get_time", {}), ("get_weather", {"city": "Paris"})]),
    "text_then_call": ("Let me check." + WEATHER, "Let me check.",
                       [("get_weather", {"city": "Paris"})]),
    "bad_json_is_content": (
        '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{city: P}'
        '<|call|>', '<|start|>assistant<|channel|>commentary to=functions.get_weather'
        '<|message|>{city: P}<|call|>', []),
    "array_is_content": (
        '<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>[1]<|call|>',
        '<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>[1]<|call|>',
        []),
    "undeclared_is_content": (WEATHER.replace("get_weather", "launch"),
                              WEATHER.replace("get_weather", "launch"), []),
    "builtin_tool_is_content": (WEATHER.replace("functions.get_weather", "browser.search"),
                                WEATHER.replace("functions.get_weather", "browser.search"),
                                []),
    "cut_off_call_is_content": (WEATHER[:-len('"}<|call|>')], WEATHER[:-len('"}<|call|>')], []),
    "complete_call_cut_before_marker": (WEATHER[:-len("<|call|>")], None,
                                        [("get_weather", {"city": "Paris"})]),
    "no_calls": ("Sunny, 21 C.", "Sunny, 21 C.", []),
}
NAMES = ["get_weather", "get_time"]


@pytest.mark.parametrize("case", sorted(TOOL_CASES))
def test_gpt_oss_tool_calls(case: str) -> None:
    text, content, calls = TOOL_CASES[case]
    parsed = GptOssToolParser(NAMES).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    check_tool_stream(GptOssToolParser, text, NAMES)


def test_registry_names_and_detection() -> None:
    assert get_tool_parser("harmony") is get_tool_parser("gpt-oss") is GptOssToolParser
    assert get_reasoning_parser("harmony") is GptOssReasoningParser
    assert detect_tool_parser(HARMONY_TEMPLATE) == "gpt-oss"
    assert detect_reasoning_parser(HARMONY_TEMPLATE) == "gpt-oss"
    assert detect_reasoning_parser("{{ '<think>' }}") is None


HARMONY_FRAGMENTS = [
    "<|channel|>analysis<|message|>", "<|channel|>final<|message|>", "<|end|>", "<|start|>",
    "<|start|>assistant", " to=functions.get_weather", " to=functions.nope",
    "<|channel|>commentary", "<|message|>", "<|call|>", "<|return|>", " <|constrain|>json",
    "<|chan", "<|", "\n", " ", "hi", '{"city": "Paris"}', "{", "}", "[1]", "json",
]


@pytest.mark.parametrize("seed", range(60))
def test_harmony_stream_matches_parse_on_random_texts(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(HARMONY_FRAGMENTS) for _ in range(rng.randint(2, 16)))
    check_reasoning_stream(GptOssReasoningParser, text)
    check_tool_stream(GptOssToolParser, text)
    check_tool_stream(GptOssToolParser, text, ["get_weather"])
    _, content = GptOssReasoningParser().parse(text)
    if content is not None and len(content) > 1:  # all_splits needs two characters
        check_tool_stream(GptOssToolParser, content, ["get_weather"])


# ---------------------------------------------------------------------- the chat endpoint

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat_plan(tool_parser=None, **body):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
    spec, field = req.structured()
    return plan_chat(req, spec, field, tool_parser, "gpt-oss")


def stream(plan, text: str, size: int) -> dict:
    cs = ChoiceStream(plan)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    out: dict = {"content": "", "reasoning_content": "", "calls": {}}
    for i, piece in enumerate(pieces):
        for d in cs.feed(piece, i == len(pieces) - 1):
            for k in ("content", "reasoning_content"):
                out[k] += d.get(k, "")
            for tc in d.get("tool_calls", []):
                c = out["calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
                c["name"] = c["name"] or tc["function"].get("name")
                c["arguments"] += tc["function"]["arguments"]
    out["has_calls"] = cs.has_calls
    return out


def test_chat_message_reasoning_and_calls_whole_and_streamed() -> None:
    text = A + "Need the weather.<|end|>" + WEATHER
    plan = chat_plan("gpt-oss", tools=[TOOL])
    message, has_calls = chat_message(plan, text)
    assert has_calls and message["reasoning_content"] == "Need the weather."
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    for size in (1, 2, 3, 5, 8, 13, 1000):
        out = stream(chat_plan("gpt-oss", tools=[TOOL]), text, size)
        assert out["reasoning_content"] == "Need the weather." and out["content"] == ""
        assert out["has_calls"]
        assert out["calls"] == {0: {"name": "get_weather",
                                    "arguments": call["function"]["arguments"]}}

    answer = A + "Greeting.<|end|>" + F + "Hello there!<|return|>"
    message, has_calls = chat_message(chat_plan(), answer)
    assert not has_calls
    assert (message["reasoning_content"], message["content"]) == ("Greeting.", "Hello there!")
    for size in (1, 4, 7):
        out = stream(chat_plan(), answer, size)
        assert (out["reasoning_content"], out["content"]) == ("Greeting.", "Hello there!")


def test_a_constraint_holds_from_the_first_token_under_harmony() -> None:
    # harmony has no end-of-thinking text for the grammar to wait for
    p = chat_plan(response_format={"type": "json_object"})
    assert p.constraint.json_object and p.constraint.reasoning_end is None
    message, _ = chat_message(p, '{"a": 1}')  # what the constrained model writes
    assert message["content"] == '{"a": 1}' and message["reasoning_content"] is None


def test_reasoning_effort_reaches_the_template() -> None:
    def req(**body):
        return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)

    assert req().template_kwargs() is None
    assert req(reasoning_effort="high").template_kwargs() == {"reasoning_effort": "high"}
    assert req(reasoning_effort="low", chat_template_kwargs={"x": 1}).template_kwargs() == \
        {"x": 1, "reasoning_effort": "low"}
    with pytest.raises(APIError) as e:
        req(reasoning_effort="low",
            chat_template_kwargs={"reasoning_effort": "high"}).template_kwargs()
    assert e.value.param == "reasoning_effort"
    with pytest.raises(ValueError):
        req(reasoning_effort="extreme")


# ---------------------------------------------------------------------- a harmony template

# Our own small template in harmony's shape, using what gpt-oss's real template uses:
# strftime_now, `is not defined` defaults, namespace() set in loops, macros, loop.index and
# loop.last, slices, `in` tests on messages, tojson and raise_exception.
HARMONY_TEMPLATE = """\
{%- macro tool_line(t) -%}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{%- endmacro -%}
<|start|>system<|message|>Date: {{ strftime_now("%Y-%m-%d") }}
{%- if reasoning_effort is not defined %}{% set reasoning_effort = "medium" %}{% endif %}
{{- "\nReasoning: " + reasoning_effort }}<|end|>
{%- if messages[0].role == "system" %}{% set rest = messages[1:] %}
<|start|>developer<|message|>{{ messages[0].content }}
{%- else %}{% set rest = messages %}{% endif %}
{%- if tools %}
{%- if messages[0].role != "system" %}<|start|>developer<|message|>{% endif %}
namespace functions {
{%- for t in tools %}{{ "\n" + tool_line(t) }}{% endfor %}{{ "\n}" }}
{%- endif %}
{%- if messages[0].role == "system" or tools %}<|end|>{% endif %}
{%- set last = namespace(name=none) %}
{%- for m in rest %}
{%- if m.role == "assistant" and "tool_calls" in m %}
{%- set later = namespace(final=false) %}
{%- for f in rest[loop.index:] %}{% if f.role == "assistant" and "tool_calls" not in f %}\
{% set later.final = true %}{% endif %}{% endfor %}
{%- if "thinking" in m and not later.final %}\
<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
{%- set c = m.tool_calls[0].function %}\
<|start|>assistant to=functions.{{ c.name }}<|channel|>commentary json<|message|>\
{{ c.arguments | tojson }}<|call|>
{%- set last.name = c.name %}
{%- elif m.role == "assistant" %}\
<|start|>assistant<|channel|>final<|message|>{{ m.content }}\
{{ "<|return|>" if loop.last and not add_generation_prompt else "<|end|>" }}
{%- elif m.role == "tool" %}
{%- if last.name is none %}{{ raise_exception("a tool result without a call") }}{% endif %}\
<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>\
{{ m.content | tojson }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


class _Now:
    @staticmethod
    def now() -> datetime:
        return datetime(2025, 8, 5, 12, 0)


@pytest.fixture
def fixed_date(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve.tokenizer.chat_template as ct

    monkeypatch.setattr(ct, "datetime", _Now)


def render(messages: list[dict], **kw) -> str:
    return render_chat_template(HARMONY_TEMPLATE, {"messages": messages,
                                                   "add_generation_prompt": True, **kw})


SYSTEM = "<|start|>system<|message|>Date: 2025-08-05\nReasoning: {}<|end|>"


def test_harmony_template_plain_system_and_effort(fixed_date: None) -> None:
    user = [{"role": "user", "content": "Hi"}]
    assert render(user) == SYSTEM.format("medium") + \
        "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    assert render(user, reasoning_effort="high").startswith(SYSTEM.format("high"))
    assert render([{"role": "system", "content": "Be terse."}, *user]) == \
        SYSTEM.format("medium") + "<|start|>developer<|message|>Be terse.<|end|>" \
        "<|start|>user<|message|>Hi<|end|><|start|>assistant"


def test_responses_reasoning_effort_reaches_the_template(fixed_date: None) -> None:
    """The Responses API's `reasoning.effort` is chat completions' reasoning_effort; a
    summary may be asked for (none is written); an unknown effort is refused."""
    from pydantic import ValidationError

    from kvserve.entrypoints.server.protocol_responses import ResponsesRequest

    def kwargs(**body):
        return ResponsesRequest(input="Hi", **body).chat_request([]).template_kwargs()

    assert kwargs() is None
    assert kwargs(reasoning={"effort": "low", "summary": "auto"}) == {"reasoning_effort": "low"}
    assert render([{"role": "user", "content": "Hi"}],
                  **kwargs(reasoning={"effort": "high"})).startswith(SYSTEM.format("high"))
    with pytest.raises(ValidationError):
        kwargs(reasoning={"effort": "extreme"})


def test_harmony_template_tools_and_a_call_round_trip(fixed_date: None) -> None:
    from kvserve.tokenizer.chat_template import _template_message

    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        # as ChatMessage.for_template gives it: arguments as an object, reasoning_content
        # (which templates read as `thinking`)
        _template_message({"role": "assistant", "content": "", "reasoning_content": "Use it.",
                           "tool_calls": [{"id": "c1", "type": "function", "function": {
                               "name": "get_weather", "arguments": {"city": "Paris"}}}]}),
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    ]
    assert render(messages, tools=[TOOL]) == (
        SYSTEM.format("medium")
        + "<|start|>developer<|message|>namespace functions {\ntype get_weather = (_: "
        + json.dumps(TOOL["function"]["parameters"]) + ") => any;\n}<|end|>"
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Use it.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
        '{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"{\\"temp\\": 21}"<|end|><|start|>assistant')
    # After a later final answer, the call's thinking is dropped.
    done = [*messages, {"role": "assistant", "content": "21 C."}]
    rendered = render(done, add_generation_prompt=False)
    assert "analysis" not in rendered
    assert rendered.endswith("<|channel|>final<|message|>21 C.<|return|>")


def test_harmony_template_refuses_a_tool_result_without_a_call(fixed_date: None) -> None:
    with pytest.raises(ChatTemplateError, match="a tool result without a call"):
        render([{"role": "tool", "content": "x"}])
