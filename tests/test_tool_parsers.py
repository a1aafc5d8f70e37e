"""Tool-call and reasoning parsers on text fixtures: whole parsing, and streaming checked against
it by feeding every fixture in chunks of every size 1..7 and at random cut points."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.entrypoints.server.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    get_reasoning_parser,
)
from kvserve.entrypoints.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    StreamDelta,
    ToolParser,
    detect_tool_parser,
    get_tool_parser,
)

CHUNK_SIZES = range(1, 8)


def chunked(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def random_splits(text: str, count: int = 20, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return out


def all_splits(text: str) -> list[list[str]]:
    # Empty deltas happen (a token that decodes to nothing); they must be harmless.
    return [chunked(text, n) for n in CHUNK_SIZES] + random_splits(text) + [["", text, ""]]


# --- tool parsers -------------------------------------------------------------------------------


def stream_tools(parser: ToolParser, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feed `pieces`, check the per-delta invariants, return (content, calls by index)."""
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        for tc in d.tool_calls:
            if tc.index == len(calls):
                # The first piece of a call names it.
                assert tc.id is not None and tc.name is not None
                calls.append({"id": tc.id, "name": tc.name, "arguments": tc.arguments})
            else:
                assert tc.index < len(calls), "indexes must start at 0 and go up by one"
                assert tc.id is None and tc.name is None
                calls[tc.index]["arguments"] += tc.arguments
    seen = parser.tool_calls()
    assert [c.id for c in seen] == [c["id"] for c in calls]
    assert [c.name for c in seen] == [c["name"] for c in calls]
    assert [c.arguments for c in seen] == [c["arguments"] for c in calls]
    return content, calls


def check_tool_stream(cls: type[ToolParser], text: str,
                      tool_names: list[str] | None = None,
                      schemas: dict[str, dict] | None = None) -> None:
    expected = cls(tool_names, schemas).parse(text)
    for call in expected.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    for pieces in all_splits(text):
        parser = cls(tool_names, schemas)
        content, calls = stream_tools(parser, pieces)
        if parser.broken:
            # A call that broke after its arguments began streaming was sent; parse() kept
            # its text as content. Every other call is the same, and no content is made up.
            assert all(calls[i]["arguments"] for i in parser.broken)
            calls = [c for i, c in enumerate(calls) if i not in parser.broken]
            assert is_subsequence(content, expected.content or ""), pieces
        else:
            assert content == (expected.content or ""), pieces
        assert [c["name"] for c in calls] == [c.name for c in expected.tool_calls], pieces
        assert [c["arguments"] for c in calls] == [c.arguments for c in expected.tool_calls]
        for c in calls:
            assert isinstance(json.loads(c["arguments"]), dict)


def is_subsequence(part: str, whole: str) -> bool:
    it = iter(whole)
    return all(ch in it for ch in part)


def call(name: str, args: dict | str, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


def hermes_block(name: str, args: dict | str) -> str:
    return f"<tool_call>\n{call(name, args)}\n</tool_call>"


WEATHER = {"city": "Zürich", "unit": "celsius"}
TIME = {"timezone": "Europe/Paris"}

# (text, expected content, expected [(name, arguments dict)])
HERMES_CASES = {
    "content_only": ("The weather is nice today.\nAnything else? a < b, <tool>",
                     "The weather is nice today.\nAnything else? a < b, <tool>", []),
    "one_call": (hermes_block("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    "two_calls": (hermes_block("get_weather", WEATHER) + "\n" + hermes_block("get_time", TIME),
                  None, [("get_weather", WEATHER), ("get_time", TIME)]),
    "content_then_call": ("Let me check that.\n\n" + hermes_block("get_weather", WEATHER),
                          "Let me check that.\n\n", [("get_weather", WEATHER)]),
    "text_after_call": (hermes_block("get_time", TIME) + "\nDone.", "\nDone.",
                        [("get_time", TIME)]),
    "malformed_stays_content": (
        '<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>\n'
        + hermes_block("get_time", TIME),
        '<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>\n', [("get_time", TIME)]),
    "no_name_stays_content": ('<tool_call>\n{"arguments": {}}\n</tool_call>',
                              '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    "unterminated_last": (hermes_block("get_weather", WEATHER) + "\n<tool_call>\n"
                          + call("get_time", TIME) + "\n",
                          None, [("get_weather", WEATHER), ("get_time", TIME)]),
    "unterminated_partial_end_tag": ("<tool_call>\n" + call("get_time", TIME) + "\n</tool_c",
                                     None, [("get_time", TIME)]),
    "unterminated_malformed": ('Hi <tool_call>\n{"name": "get_time", "argu',
                               'Hi <tool_call>\n{"name": "get_time", "argu', []),
    "string_arguments": (hermes_block("get_weather", json.dumps(WEATHER)), None,
                         [("get_weather", WEATHER)]),
    "no_arguments": ('<tool_call>\n{"name": "ping"}\n</tool_call>', None, [("ping", {})]),
    "partial_start_tag_at_end": ("Thinking about <tool_ca", "Thinking about <tool_ca", []),
    "whitespace_only_content": ("\n\n" + hermes_block("ping", {}) + "\n \n", None,
                                [("ping", {})]),
    # What small models write instead of the template's tags (issue 38's Qwen2.5 1.5B).
    "fenced_json": ("```json\n" + call("get_weather", WEATHER) + "\n```", None,
                    [("get_weather", WEATHER)]),
    "prose_then_fenced": ("I'll look it up.\n```json\n" + call("get_time", TIME, "parameters")
                          + "\n```\nOne moment.", "I'll look it up.\n\nOne moment.",
                          [("get_time", TIME)]),
    "fenced_tool_call_array": ("```tool_call\n[" + call("get_weather", WEATHER) + ", "
                               + call("get_time", TIME) + "]\n```", None,
                               [("get_weather", WEATHER), ("get_time", TIME)]),
    "fenced_json_not_a_call": ('Here:\n```json\n{"city": "Bern"}\n```',
                               'Here:\n```json\n{"city": "Bern"}\n```', []),
    "fenced_cut_off": ("```json\n" + call("get_time", TIME) + "\n``", None,
                       [("get_time", TIME)]),
    "fenced_cut_off_midway": ('```json\n{"name": "get_time", "argu',
                              '```json\n{"name": "get_time", "argu', []),
    "other_fence_is_content": ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    "bare_object": ("\n" + call("get_weather", WEATHER) + "\n", None,
                    [("get_weather", WEATHER)]),
    "bare_array": ("[" + call("get_time", TIME) + ", " + call("ping", {}) + "]", None,
                   [("get_time", TIME), ("ping", {})]),
    "bare_json_not_a_call": ('{"answer": 42}', '{"answer": 42}', []),
    "bare_empty_array": ("[]", "[]", []),
    "bare_cut_off": ('{"name": "get_time", "arguments": {"timezone": "Eu',
                     '{"name": "get_time", "arguments": {"timezone": "Eu', []),
    "bare_then_tagged": ('{"a": 1} ' + hermes_block("ping", {}), '{"a": 1} ', [("ping", {})]),
    "single_quotes_stay_content": ("<tool_call>\n{'name': 'ping', 'arguments': {}}\n</tool_call>",
                                   "<tool_call>\n{'name': 'ping', 'arguments': {}}\n</tool_call>",
                                   []),
}


@pytest.mark.parametrize("case", sorted(HERMES_CASES))
def test_hermes_parse(case: str) -> None:
    text, content, expected = HERMES_CASES[case]
    parsed = HermesToolParser().parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == expected
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)
    for c in parsed.tool_calls:
        assert c.id.startswith("call_")
        assert c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False)


@pytest.mark.parametrize("case", sorted(HERMES_CASES))
def test_hermes_stream_matches_parse(case: str) -> None:
    check_tool_stream(HermesToolParser, HERMES_CASES[case][0])


def test_hermes_arguments_keep_unicode() -> None:
    parsed = HermesToolParser().parse(hermes_block("get_weather", WEATHER))
    assert "Zürich" in parsed.tool_calls[0].arguments


def test_hermes_split_tag_streams_content_early() -> None:
    parser = HermesToolParser()
    assert parser.feed("Sure").content == "Sure"
    assert parser.feed(", checking. <").content == ", checking. "
    assert parser.feed("tool").content == ""  # might be a tag: held
    assert parser.feed("_call>\n{\"name\": \"get_time\", ").content == ""
    d = parser.feed('"arguments": {"timezone": "Europe/Paris"}}\n</tool')
    assert d.content == ""
    assert [(t.index, t.name) for t in d.tool_calls] == [(0, "get_time")]
    assert json.loads(d.tool_calls[0].arguments) == TIME
    assert d.tool_calls[0].id == parser.tool_calls()[0].id
    assert parser.feed("_call>") == StreamDelta()
    assert parser.feed("<too").content == ""
    assert parser.feed("l> is what I used").content == "<tool> is what I used"
    assert parser.finish().content == ""
    assert parser.broken == []


@pytest.mark.parametrize("opening, closing", [("<tool_call>\n", "\n</tool_call>"),
                                              ("```json\n", "\n```")])
def test_hermes_arguments_stream_piece_by_piece(opening: str, closing: str) -> None:
    """Once a block opens a declared function's call, its arguments go out as the model
    writes them, before the call or its block closes."""
    args = '{"city": "Z\\u00fcrich", "note": "a } and a ``` inside", "days": [1, {"x": 2}]}'
    text = "Let me look.\n" + opening + '{"name": "get_weather", "arguments": ' + args + "}" \
        + closing + "\nDone."
    parser = HermesToolParser(["get_weather"])
    pieces = []
    for i, ch in enumerate(text):
        for d in parser.feed(ch).tool_calls:
            pieces.append((i, d))
    assert parser.finish().tool_calls == [] and parser.broken == []
    assert pieces[0][1].name == "get_weather" and pieces[0][1].id is not None
    assert "".join(d.arguments for _, d in pieces) == args
    # One piece a character of the arguments (the first comes with the call's name), all
    # before the call object ends.
    assert len(pieces) == len(args)
    assert pieces[-1][0] < text.rindex(closing)
    assert HermesToolParser(["get_weather"]).parse(text).tool_calls[0].arguments == args


@pytest.mark.parametrize("cls, key", [(HermesToolParser, "arguments"),
                                      (Llama3JsonToolParser, "parameters")])
def test_a_bare_call_streams_piece_by_piece(cls, key) -> None:
    args = '{"city": "Bern", "days": [1, 2]}'
    text = '\n{"name": "get_weather", "' + key + '": ' + args + "}\n"
    parser = cls(["get_weather"])
    pieces = [tc for ch in text for tc in parser.feed(ch).tool_calls]
    assert parser.finish().tool_calls == [] and parser.broken == []
    assert pieces[0].name == "get_weather" and len(pieces) == len(args)
    assert "".join(p.arguments for p in pieces) == args == \
        cls(["get_weather"]).parse(text).tool_calls[0].arguments


@pytest.mark.parametrize("text, content", [
    # Cut off inside the arguments (max_tokens): sent as far as it went.
    ('<tool_call>\n{"name": "f", "arguments": {"a": "xy', ""),
    # Not JSON after all, then another block and prose.
    ('<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>hi', "hi"),
    # Text in the block after the call object.
    ('<tool_call>\n{"name": "f", "arguments": {}} and more\n</tool_call>hi', "hi"),
    ('```json\n{"name": "f", "arguments": {"a": 1 `\n```hi', "hi"),
])
def test_hermes_broken_streamed_call(text: str, content: str) -> None:
    """A call that breaks after its arguments began streaming stays sent and is listed in
    `broken`; the rest of its block is dropped and the stream goes on after the block. A whole
    parse keeps such a block as content."""
    parser = HermesToolParser(["f"])
    deltas = [parser.feed(ch) for ch in text] + [parser.finish()]
    assert parser.broken == [0]
    assert [c.name for c in parser.tool_calls()] == ["f"]
    assert "".join(d.content for d in deltas) == content
    parsed = HermesToolParser(["f"]).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize("text", [
    hermes_block("launch", {}),
    "```json\n" + call("launch", {}) + "\n```",
    call("launch", {}),
    "[" + call("get_time", TIME) + ", " + call("launch", {}) + "]",
])
def test_hermes_unknown_tool_name_stays_content(text: str) -> None:
    """A call of a function the request did not declare is the model's prose: all of its
    block (one unknown name among several included) is content, whole and streamed."""
    parsed = HermesToolParser(tool_names=["get_time"]).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    check_tool_stream(HermesToolParser, text, ["get_time"])
    known = HermesToolParser(tool_names=["get_time", "launch"]).parse(text)
    assert known.content is None and known.tool_calls


def test_hermes_fence_streams_prose_and_the_call_as_they_come() -> None:
    parser = HermesToolParser(["get_time"])
    assert parser.feed("Checking.\n``").content == "Checking.\n"  # may open a fence: held
    assert parser.feed("`js").content == ""
    d = parser.feed("on\n" + call("get_time", TIME) + "\n``")
    assert d.content == "" and [t.name for t in d.tool_calls] == ["get_time"]
    d = parser.feed("`\nDone ```")
    assert d.tool_calls == [] and d.content == "\nDone "
    assert parser.feed("py").content == "```py"  # no call's fence: prose again


def xml_block(name: str, params: dict[str, str]) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
    "where": {"type": "object"}, "tags": {"type": "array"}, "code": {"type": "string"}}}}

# parser -> case -> (text, expected content, expected [(name, arguments)])
FAMILY_CASES: dict[type[ToolParser], dict[str, tuple[str, str | None, list]]] = {
    Qwen3CoderToolParser: {
        "typed": (xml_block("get_weather", {"city": "Zürich", "days": "3", "hourly": "false",
                                            "where": '{"lat": 47.4}', "tags": '["a", 1]',
                                            "code": "42"}), None,
                  [("get_weather", {"city": "Zürich", "days": 3, "hourly": False,
                                    "where": {"lat": 47.4}, "tags": ["a", 1], "code": "42"})]),
        "multiline_string_and_prose": (
            "Let me see.\n" + xml_block("get_weather", {"city": "line 1\nline 2"}) + "\nOK",
            "Let me see.\n\nOK", [("get_weather", {"city": "line 1\nline 2"})]),
        "wrong_type_stays_text": (xml_block("get_weather", {"days": "three"}), None,
                                  [("get_weather", {"days": "three"})]),
        "two_calls": (xml_block("get_time", {"timezone": "UTC"}) + "\n"
                      + xml_block("get_weather", {"city": "Bern"}), None,
                      [("get_time", {"timezone": "UTC"}), ("get_weather", {"city": "Bern"})]),
        "hermes_json_inside": (hermes_block("get_time", TIME), None, [("get_time", TIME)]),
        "cut_off": ("<tool_call>\n<function=get_time>\n<parameter=timezone>\nUT",
                    "<tool_call>\n<function=get_time>\n<parameter=timezone>\nUT", []),
        "no_closing_tag_at_eos": (
            "<tool_call>\n<function=get_time>\n<parameter=timezone>\nUTC\n</parameter>\n"
            "</function>\n", None, [("get_time", {"timezone": "UTC"})]),
        "junk_between_parameters": (
            "<tool_call>\n<function=f>\nhello<parameter=a>\n1\n</parameter>\n</function>\n"
            "</tool_call>", "<tool_call>\n<function=f>\nhello<parameter=a>\n1\n</parameter>"
            "\n</function>\n</tool_call>", []),
    },
    MistralToolParser: {
        "v3_array": ("[TOOL_CALLS][" + call("get_weather", WEATHER) + ", "
                     + call("get_time", TIME) + "]", None,
                     [("get_weather", WEATHER), ("get_time", TIME)]),
        "v11_args": ("Sure.[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER)
                     + "[TOOL_CALLS]get_time[ARGS]" + json.dumps(TIME), "Sure.",
                     [("get_weather", WEATHER), ("get_time", TIME)]),
        "v11_call_id": ("[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]" + json.dumps(TIME),
                        None, [("get_time", TIME)]),
        "content_only": ("No tools needed [TOOL", "No tools needed [TOOL", []),
        "cut_off": ('[TOOL_CALLS]get_time[ARGS]{"timezone": "Eu',
                    '[TOOL_CALLS]get_time[ARGS]{"timezone": "Eu', []),
        "not_calls": ("[TOOL_CALLS] never mind", "[TOOL_CALLS] never mind", []),
    },
    PythonicToolParser: {
        "two_calls": ('[get_weather(city="Zürich", unit="celsius"), '
                      'get_time(timezone="Europe/Paris")]', None,
                      [("get_weather", WEATHER), ("get_time", TIME)]),
        "python_tag_and_literals": ('<|python_tag|>[f(a=[1, 2.5], b={"k": None}, c=True, '
                                    "d=false)]", None,
                                    [("f", {"a": [1, 2.5], "b": {"k": None}, "c": True,
                                            "d": False})]),
        "no_arguments": ("[ping()]", None, [("ping", {})]),
        "prose": ("The answer is [1, 2].", "The answer is [1, 2].", []),
        "list_not_calls": ("[1, 2]", "[1, 2]", []),
        "positional_refused": ('[f("x")]', '[f("x")]', []),
        "code_refused": ("[__import__('os').system('x')]", "[__import__('os').system('x')]",
                         []),
        "cut_off": ('[get_time(timezone="Eu', '[get_time(timezone="Eu', []),
        "expression_refused": ("[f(a=1 + 2)]", "[f(a=1 + 2)]", []),
    },
}


@pytest.mark.parametrize(("cls", "case"), [(cls, case) for cls, cases in FAMILY_CASES.items()
                                           for case in sorted(cases)])
def test_family_forms(cls: type[ToolParser], case: str) -> None:
    """Each family's forms, whole and streamed in every chunking."""
    text, content, expected = FAMILY_CASES[cls][case]
    parsed = cls(schemas=SCHEMAS).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == expected
    check_tool_stream(cls, text)
    check_tool_stream(cls, text, schemas=SCHEMAS)
    names = sorted({name for name, _ in expected})
    if names:  # declared: the same calls; one not declared: its text is content
        assert [c.name for c in cls(names, SCHEMAS).parse(text).tool_calls] == \
            [name for name, _ in expected]
        partial = cls(names[1:], SCHEMAS).parse(text)
        assert names[0] not in [c.name for c in partial.tool_calls]
        assert names[0] in (partial.content or "")
        check_tool_stream(cls, text, names[1:])


def test_qwen3_coder_streams_prose_and_arguments_typed_by_schema() -> None:
    """The XML form streams too: the object opens with the function, each key with its
    parameter, a string's text as it comes, other values whole when they close."""
    parser = Qwen3CoderToolParser(["get_weather"], SCHEMAS)
    assert parser.feed("Checking <tool").content == "Checking "
    d = parser.feed("_call>\n<function=get_weather>\n<parameter=days>\n2\n")
    assert d.content == "" and [(t.name, t.arguments) for t in d.tool_calls] == [
        ("get_weather", '{"days": ')]
    d = parser.feed("</parameter>\n<parameter=city>\nZü")
    assert [t.arguments for t in d.tool_calls] == ['2, "city": "Zü']
    d = parser.feed('"rich"\n')  # a newline that may be the closing's: held
    assert [t.arguments for t in d.tool_calls] == ['\\"rich\\"']
    d = parser.feed("</parameter>\n</function>\n</tool_call> ok")
    assert [t.arguments for t in d.tool_calls] == ['"}']
    assert d.content == " ok" and parser.finish().content == ""
    (whole,) = parser.tool_calls()
    assert json.loads(whole.arguments) == {"days": 2, "city": 'Zü"rich"'}
    assert whole.arguments == Qwen3CoderToolParser(["get_weather"], SCHEMAS).parse(
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
        '<parameter=city>\nZü"rich"\n</parameter>\n</function>\n</tool_call>'
    ).tool_calls[0].arguments
    assert parser.broken == []


def test_feed_after_finish_raises() -> None:
    for cls in TOOL_PARSERS.values():
        parser = cls()
        parser.finish()
        with pytest.raises(RuntimeError):
            parser.feed("x")


LLAMA_CASES = {
    "content_only": ("The capital of France is Paris.", "The capital of France is Paris.", []),
    "one_call": (call("get_weather", WEATHER, "parameters"), None, [("get_weather", WEATHER)]),
    "python_tag": ("<|python_tag|>" + call("get_time", TIME, "parameters"), None,
                   [("get_time", TIME)]),
    "two_calls": (call("get_weather", WEATHER, "parameters") + "; "
                  + call("get_time", TIME, "parameters"),
                  None, [("get_weather", WEATHER), ("get_time", TIME)]),
    "semicolon_in_string": (call("echo", {"text": "a; b"}, "parameters") + ";", None,
                            [("echo", {"text": "a; b"})]),
    "arguments_synonym": ("\n " + call("get_time", TIME), None, [("get_time", TIME)]),
    "string_arguments": (call("get_time", json.dumps(TIME), "parameters"), None,
                         [("get_time", TIME)]),
    "no_arguments": ('{"name": "ping"}', None, [("ping", {})]),
    "malformed": ('{"name": "f", "parameters": {"x": }}', '{"name": "f", "parameters": {"x": }}',
                  []),
    "unterminated_last": (call("get_time", TIME, "parameters") + '; {"name": "get_weather", "pa',
                          call("get_time", TIME, "parameters") + '; {"name": "get_weather", "pa',
                          []),
    "json_not_a_call": ('{"answer": 42}', '{"answer": 42}', []),
    "trailing_text": (call("ping", {}, "parameters") + " I called it.",
                      call("ping", {}, "parameters") + " I called it.", []),
    "tag_then_text": ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    "partial_tag_only": ("<|pyth", "<|pyth", []),
    "whitespace_only": ("\n  ", None, []),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama3_parse(case: str) -> None:
    text, content, expected = LLAMA_CASES[case]
    parsed = Llama3JsonToolParser().parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == expected


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama3_stream_matches_parse(case: str) -> None:
    check_tool_stream(Llama3JsonToolParser, LLAMA_CASES[case][0])


def test_llama3_streams_content_at_once_and_calls_as_they_come() -> None:
    parser = Llama3JsonToolParser()
    assert parser.feed("  ").content == ""
    assert parser.feed("Hel").content == "  Hel"
    assert parser.feed("lo {").content == "lo {"
    assert parser.finish().content == ""

    parser = Llama3JsonToolParser(["get_time", "ping"])
    pieces = ["<|py", "thon_tag|>", '{"name": "get_time", ', '"parameters": {"timezone": ',
              '"Europe/Paris"}}', " ; ", '{"parameters": {}, "name": "ping"}']
    deltas = [parser.feed(p) for p in pieces]
    assert all(d == StreamDelta() for d in deltas[:3])
    assert [(t.index, t.name, t.arguments) for t in deltas[3].tool_calls] == [
        (0, "get_time", '{"timezone": ')]
    assert [(t.index, t.name, t.arguments) for t in deltas[4].tool_calls] == [
        (0, None, '"Europe/Paris"}')]
    # Another key order is not streamed: it is sent whole at the end.
    assert deltas[5] == deltas[6] == StreamDelta()
    d = parser.finish()
    assert d.content == "" and [(t.index, t.name, t.arguments) for t in d.tool_calls] == [
        (1, "ping", "{}")]
    assert [c.name for c in parser.tool_calls()] == ["get_time", "ping"]
    assert parser.broken == []
    assert [(c.name, c.arguments) for c in parser.tool_calls()] == [
        (c.name, c.arguments) for c in Llama3JsonToolParser(["get_time", "ping"]).parse(
            "".join(pieces)).tool_calls]


@pytest.mark.parametrize("cls, text", [
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"a": 1}} and then prose'),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"a": '),
    (HermesToolParser, '{"name": "f", "arguments": {"a": 1}}\nand then prose'),
])
def test_a_streamed_answer_that_is_not_calls_after_all_is_broken(cls, text):
    parser = cls(["f"])
    deltas = [parser.feed(ch) for ch in text] + [parser.finish()]
    assert parser.broken == [0] and "".join(d.content for d in deltas) == ""
    assert cls(["f"]).parse(text).content == text


def test_get_tool_parser() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    with pytest.raises(ValueError, match="hermes") as err:
        get_tool_parser("nope")
    assert "llama3_json" in str(err.value) and "nope" in str(err.value)


# --- reasoning parsers --------------------------------------------------------------------------


def stream_reasoning(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


def check_reasoning_stream(cls: type[ReasoningParser], text: str) -> None:
    reasoning, content = cls().parse(text)
    for pieces in all_splits(text):
        parser = cls()
        assert stream_reasoning(parser, pieces) == (reasoning or "", content or ""), pieces
        if "</think>" in text and (reasoning is not None or cls is DeepSeekR1ReasoningParser):
            assert parser.reasoning_done


# (text, reasoning, content)
DEEPSEEK_CASES = {
    "both_tags": ("<think>\nAdd 2 and 2.\n</think>\n\nThe answer is 4.\n",
                  "Add 2 and 2.", "The answer is 4.\n"),
    "no_open_tag": ("Add 2 and 2.\n\n</think>\n\nThe answer is 4.", "Add 2 and 2.",
                    "The answer is 4."),
    "cut_off_thinking": ("Let me think\nabout this", "Let me think\nabout this", None),
    "cut_off_with_open_tag": ("\n<think>\nStill going\n", "Still going", None),
    "empty_thinking": ("<think>\n\n</think>\n\nHi", None, "Hi"),
    "no_content": ("<think>done</think>\n\n", "done", None),
    "second_tags_are_content": ("a</think>b <think>c</think>", "a", "b <think>c</think>"),
    "partial_tag_at_end": ("thinking </thi", "thinking </thi", None),
    "angle_brackets": ("if a<b and c</d\n</think>\nyes", "if a<b and c</d", "yes"),
}


@pytest.mark.parametrize("case", sorted(DEEPSEEK_CASES))
def test_deepseek_r1(case: str) -> None:
    text, reasoning, content = DEEPSEEK_CASES[case]
    assert DeepSeekR1ReasoningParser().parse(text) == (reasoning, content)
    check_reasoning_stream(DeepSeekR1ReasoningParser, text)


QWEN3_CASES = {
    "both_tags": ("<think>\nPlan the answer.\n</think>\n\nHere it is.",
                  "Plan the answer.", "Here it is."),
    "no_tags": ("Just an answer.\n", None, "Just an answer.\n"),
    "empty_think_block": ("<think>\n\n</think>\n\nHello!", None, "Hello!"),
    "cut_off_thinking": ("<think>\nHalf a thought", "Half a thought", None),
    "leading_whitespace": ("\n<think>x</think>y", "x", "y"),
    "mid_text_unclosed": ("Wrap it in <think> tags.", None, "Wrap it in <think> tags."),
    "mid_text_closed": ("Intro <think>\nhidden\n</think>\nrest", "hidden", "Intro \nrest"),
    "close_without_open": ("abc</think>def", None, "abc</think>def"),
    "partial_open_tag": ("<thi", None, "<thi"),
    "partial_close_tag": ("<think>\nhmm </thin", "hmm </thin", None),
}


@pytest.mark.parametrize("case", sorted(QWEN3_CASES))
def test_qwen3(case: str) -> None:
    text, reasoning, content = QWEN3_CASES[case]
    assert Qwen3ReasoningParser().parse(text) == (reasoning, content)
    check_reasoning_stream(Qwen3ReasoningParser, text)


def test_reasoning_split_tags_stream_early() -> None:
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>\nStep one") == ("Step one", "")
    assert parser.feed(".\n") == (".", "")  # the newline may be trailing: held
    assert parser.feed("</th") == ("", "")
    assert not parser.reasoning_done
    assert parser.feed("ink>\n") == ("", "")
    assert parser.reasoning_done
    assert parser.feed("\nFour") == ("", "Four")
    assert parser.finish() == ("", "")

    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>\nabc") == ("abc", "")
    assert parser.feed("</think>\n\nxyz") == ("", "xyz")
    assert parser.reasoning_done

    # After a <think> in mid text nothing is sent until </think> or the end decides.
    parser = Qwen3ReasoningParser()
    assert parser.feed("Use <think>") == ("", "Use ")
    assert parser.feed(" tags") == ("", "")
    assert parser.finish() == ("", "<think> tags")


def test_get_reasoning_parser() -> None:
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "gpt-oss", "harmony"}
    assert get_reasoning_parser("harmony") is get_reasoning_parser("gpt-oss")
    with pytest.raises(ValueError, match="deepseek_r1") as err:
        get_reasoning_parser("nope")
    assert "qwen3" in str(err.value)


# --- mixed fragments: the streaming contract on texts nobody wrote by hand ----------------------

FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "<think>", "</think>", "</thi", "<",
             "```json", "```", "``", "```tool_call", "[", "]", ", ", "[TOOL_CALLS]", "[TOOL",
             "f[ARGS]", "f(a=1)", 'g(b="x")', "<function=f>", "</function>", "<parameter=a>",
             "</parameter>", "<parame", "<tool_call>\n<function=f>\n", "<parameter=a>\nv",
             "\n</parameter>\n",
             "<|python_tag|>", "\n", "\n\n", " ", "hi", ";", '{"name": "f", "arguments": {}}',
             '{"name": "g", "parameters": {"a": 1}}', "{", "}", '"x"']


@pytest.mark.parametrize("seed", range(80))
def test_stream_matches_parse_on_random_texts(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(2, 14)))
    for cls in TOOL_PARSERS.values():
        check_tool_stream(cls, text)
        check_tool_stream(cls, text, ["f"])  # "g" is not declared: its calls are content
        check_tool_stream(cls, text, ["f"], {"f": {"properties": {"a": {"type": "string"}}}})
    for rcls in REASONING_PARSERS.values():
        check_reasoning_stream(rcls, text)


@pytest.mark.parametrize(("template", "parser"), [
    ("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}{{ '\\n</tool_call>' }}", "hermes"),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>", "qwen3_coder"),
    ("{{ '[TOOL_CALLS]' }}{{ calls | tojson }}", "mistral"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument '
     "name and its value}", "llama3_json"),
    ("{{- '<|python_tag|>' }}", "llama3_json"),
    ("[func_name1(params_name1=params_value1, params_name2=params_value2...)]", "pythonic"),
    ("{{ '<|start|>assistant to=functions.' + name + '<|channel|>commentary json<|message|>' }}"
     "{{ args | tojson }}{{ '<|call|>' }}", "gpt-oss"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_detect_tool_parser_from_the_template(template, parser):
    assert detect_tool_parser(template) == parser
