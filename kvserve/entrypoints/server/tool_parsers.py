"""Turn a chat model's generated text into OpenAI tool calls, for a whole generation and for a
stream of text deltas.

Each format is a `ToolParser` subclass registered in `TOOL_PARSERS` under the name the server's
`--tool-call-parser` style option uses. A parser instance holds the state of one stream: make a
new one per request.
"""

from __future__ import annotations

import ast
import json
import keyword
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvserve.entrypoints.server import harmony
from kvserve.entrypoints.server.call_scan import CallScan, Scan, scan_whole
from kvserve.sample.sampling_params import JSON_OPTIONS


@dataclass
class ToolCall:
    """One complete call. `arguments` is always a JSON object as text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ParsedMessage:
    """A whole generation split into plain text and calls.

    `content` is None when the text outside the calls is empty or whitespace only; otherwise it
    is that text verbatim (not stripped), in order, with malformed call blocks left in it."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """A piece of call number `index`; `id` and `name` come only with its first piece."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one feed()/finish() step lets the server send on."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none):
    the part a stream must hold back because the next delta may complete the tag."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def regex_literal(text: str) -> str:
    """`text` as a regex (for a Lark /.../ terminal) matching exactly it."""
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else f"\\x{{{ord(c):x}}}"
                   for c in text)


def _object(schema: dict) -> dict:
    """A parameters schema that says no type held to objects (what a call's arguments are)."""
    return schema if "type" in schema else {**schema, "type": "object"}


def json_call_rule(key: str, functions: dict[str, dict]) -> str:
    """Rule tool_json: one `{"name": ..., <key>: {...}}` call of a declared function, its
    arguments valid against the function's schema, written as json.dumps writes it
    (structured.JSON_OPTIONS), so that a lazy grammar's calls are what templates show."""
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                          key: _object(params)},
                         "required": ["name", key], "additionalProperties": False}
                        for name, params in functions.items()],
              "x-guidance": JSON_OPTIONS}
    return "tool_json: %json " + json.dumps(schema) + "\n"


def normalize_arguments(raw: Any) -> str | None:
    """The call's arguments as JSON object text, or None when they cannot be an object.

    Models sometimes emit the arguments as a string holding JSON (copying the OpenAI wire
    format); decode it so clients always get one shape."""
    if raw is None:
        return "{}"
    if isinstance(raw, str):
        if not raw.strip():
            return "{}"
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return None
    if not isinstance(raw, dict):
        return None
    return json.dumps(raw, ensure_ascii=False)


def call_from_object(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from a decoded `{"name": ..., <keys[0]>: {...}}`, or None if it is not one.
    `keys` lists the accepted names of the arguments field, preferred first."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    raw = next((obj[k] for k in keys if k in obj), None)
    arguments = normalize_arguments(raw)
    if arguments is None:
        return None
    return ToolCall(name=name, arguments=arguments)


class _ContentChannel:
    """Streams content so that it concatenates to exactly what parse() reports.

    parse() reports None for whitespace-only content, so whitespace is held back until the first
    non-whitespace character arrives; after that everything passes straight through."""

    def __init__(self) -> None:
        self._held = ""
        self._started = False

    def push(self, text: str) -> str:
        if self._started:
            return text
        self._held += text
        if not self._held.strip():
            return ""
        self._started = True
        out, self._held = self._held, ""
        return out

    def close(self) -> str:
        # Anything still held is whitespace only, which parse() reports as None.
        self._held = ""
        return ""


def _content_or_none(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser(ABC):
    """Contract: parse(text) on a whole generation; for streaming, feed() the text deltas in
    order then finish(); the concatenated StreamDelta.content equals parse(full).content (or ""
    when that is None), and, per index, the concatenated ToolCallDelta.arguments equal
    parse(full).tool_calls[i].arguments exactly, names equal, ids consistent (the same id a
    streaming call used may differ from a separate parse() call; that's fine). The one
    exception: a call whose arguments a parser streams before the call ends is sent even if
    its text then breaks (cut off by max_tokens, or not JSON after all); such calls are listed
    in `broken`, and only a stream with broken calls may differ from parse().

    Invariants: indexes start at 0 and increase by one per call, in the order of the text; the
    first delta of an index carries its id and name and later ones carry neither; once
    finish() has returned, tool_calls() lists every call streamed, with those same ids.

    `tool_names` (the request's declared functions; None: any) decides what is a call: text
    that would be a call of another function stays content, since a model that names a tool it
    was not given is writing prose (or an example), and a client cannot run it anyway.

    The default feed() holds everything back and finish() parses the whole text; subclasses
    override them to stream earlier."""

    name: ClassVar[str]
    # Other names the registry knows this format by.
    aliases: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tool_names: list[str] | None = None,
                 schemas: dict[str, dict] | None = None) -> None:
        self.tool_names = list(tool_names) if tool_names is not None else None
        # Each declared function's parameters schema, for forms whose arguments are text (XML).
        self.schemas = dict(schemas) if schemas is not None else {}
        self._buffer = ""
        self._calls: list[ToolCall] = []
        self._content = _ContentChannel()
        self._finished = False
        # Indexes of streamed calls whose text broke after their arguments began to stream
        # (cut off, or not JSON in the end): sent as they were, unlike parse(), which
        # reports such a call's text as content.
        self.broken: list[int] = []

    @abstractmethod
    def parse(self, text: str) -> ParsedMessage:
        """Split a whole generation into content and calls. Does not touch stream state."""

    def feed(self, delta: str) -> StreamDelta:
        """Take the next piece of generated text; return what can be sent now."""
        self._check_open()
        self._buffer += delta
        return StreamDelta()

    def finish(self) -> StreamDelta:
        """End of stream: flush whatever is held back."""
        self._check_open()
        self._finished = True
        text, self._buffer = self._buffer, ""
        parsed = self.parse(text)
        out = StreamDelta()
        if parsed.content is not None:
            out.content += self._content.push(parsed.content)
        out.content += self._content.close()
        for call in parsed.tool_calls:
            out.tool_calls.append(self._emit_call(call))
        return out

    def tool_calls(self) -> list[ToolCall]:
        """The calls seen so far in the stream (after finish: all)."""
        return list(self._calls)

    # The name of the arguments in this form's JSON calls (a call is {"name", ARGUMENTS}).
    ARGUMENTS: ClassVar[str] = "arguments"

    @classmethod
    def lazy_grammar(cls, functions: dict[str, dict],
                     token_ids: Mapping[str, int] | None = None) -> str | None:
        """A Lark grammar (llguidance's) for tool_choice auto over the declared `functions`
        (name: parameters schema), or None where this form has none: the output is free
        until the model opens a call in one of this form's ways, and from there the call is
        held to a declared function with arguments that fit its schema. The model still
        decides whether to call; when it does, the call parses. `token_ids` holds the ids of
        those of SPECIAL_TOKENS the model's vocabulary has as single tokens."""
        return None

    # Control tokens this form's calls are written with (a grammar names them by id, and the
    # text must keep them: the server then decodes without skipping special tokens).
    SPECIAL_TOKENS: ClassVar[tuple[str, ...]] = ()

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}: stream already finished")

    def _emit_call(self, call: ToolCall) -> ToolCallDelta:
        index = len(self._calls)
        self._calls.append(call)
        return ToolCallDelta(index=index, id=call.id, name=call.name, arguments=call.arguments)


def decode_calls(text: str, keys: tuple[str, ...], tool_names: list[str] | None
                 ) -> list[ToolCall] | None:
    """`text` as calls: one `{"name", <keys[0]>: {...}}` object or a non-empty JSON array of
    them, whitespace around; None when it is anything else, or when `tool_names` is given and
    a call names a function not among them (such text is the model's prose, not a call)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_object(item, keys) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    if tool_names is not None and any(c.name not in tool_names for c in calls):
        return None
    return calls  # type: ignore[return-value]  # no None left


class _CallRun:
    """Streams the arguments of JSON calls written one after another as a whole answer
    (Llama 3's `{...}; {...}`, Hermes's bare object), each as CallScan reads it, until the
    text is something it cannot stream; the rest waits for the whole text (`settle`). It adds
    to its parser's stream state (its calls, `broken`) as the parser's own code does."""

    def __init__(self, parser: ToolParser, keys: tuple[str, ...], separators: str) -> None:
        self.parser = parser
        self.keys = keys
        self.separators = separators
        self.sent: list[ToolCall] = []  # calls streamed, the last perhaps unfinished
        self._active = True
        self._pos = 0  # where the next call may start
        self._scan: CallScan | None = None
        self._start = 0  # offset of the current call in the text
        self._fed = 0
        self._open = False  # the current call has been sent

    def feed(self, text: str, start: int) -> list[ToolCallDelta]:
        """New pieces of calls in `text` (the whole answer so far; calls start at `start`)."""
        out: list[ToolCallDelta] = []
        self._pos = max(self._pos, start)
        while self._active:
            if self._scan is None:
                i = self._pos
                while i < len(text) and (text[i].isspace() or text[i] in self.separators):
                    i += 1
                if i == len(text):
                    break
                if text[i] != "{":
                    self._active = False
                    break
                self._scan = CallScan(self.keys, self.parser.tool_names)
                self._start = self._fed = i
            scan = self._scan
            piece = scan.feed(text[self._fed:])
            self._fed = len(text)
            if scan.status is Scan.HEAD:
                break
            if scan.status in (Scan.OTHER, Scan.BROKEN):
                self._active = False
                break
            calls = self.parser._calls
            if not self._open:
                assert scan.name is not None
                call = ToolCall(name=scan.name, arguments="")
                calls.append(call)
                self.sent.append(call)
                self._open = True
                out.append(ToolCallDelta(len(calls) - 1, call.id, call.name, piece))
            elif piece:
                out.append(ToolCallDelta(len(calls) - 1, arguments=piece))
            self.sent[-1].arguments += piece
            if scan.status is not Scan.DONE:
                break
            self._pos, self._scan, self._open = self._start + scan.end, None, False
        return out

    def settle(self, calls: list[ToolCall] | None) -> list[ToolCallDelta] | None:
        """At the end, against the whole text's calls (None: it is not calls): the calls not
        streamed yet, or None when the streamed ones are not what the whole text holds
        (they are then `broken`, and the text is not sent again as content)."""
        first = len(self.parser._calls) - len(self.sent)
        if calls is not None and len(calls) >= len(self.sent) and all(
                (s.name, s.arguments) == (c.name, c.arguments)
                for s, c in zip(self.sent, calls, strict=False)):
            return [self.parser._emit_call(c) for c in calls[len(self.sent):]]
        if self.sent:
            self.parser.broken.extend(range(first, first + len(self.sent)))
            return []
        return None


class HermesToolParser(ToolParser):
    """Qwen 2.5 / Qwen 3 / Hermes, in the forms these models write:

    - `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, possibly several,
      possibly after some plain text, the last one possibly cut off before its end tag;
    - a fenced ```` ```json ```` or ```` ```tool_call ```` block holding such an object (or a
      JSON array of them), which small models write when they answer in markdown;
    - such an object, or an array of them, as the whole answer.

    `arguments` may be `parameters`, and may be a string holding the JSON object. A block that
    does not decode to calls of declared functions (`tool_names`; any name when None) stays in
    the content verbatim, its tags or fences included, as does a whole answer that is JSON but
    no call.

    Streaming: text outside blocks is sent at once, except a tail that may be the start of an
    opening tag or fence; a block is held until it closes, then sent as calls or as content. An
    answer whose first non-blank character is `{` or `[` is held whole until finish(), since
    only its end tells a call from a JSON answer. parse() is this scan run over the whole
    text, so a stream and a parse agree on every input, malformed ones included."""

    name: ClassVar[str] = "hermes"

    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"
    # (opening, closing) of the blocks that may hold calls, in the text.
    BLOCKS: ClassVar[tuple[tuple[str, str], ...]] = (
        (START, END), ("```json", "```"), ("```tool_call", "```"))
    _ARG_KEYS: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    BARE: ClassVar[bool] = True  # whether an answer that is JSON may be calls

    def __init__(self, tool_names: list[str] | None = None,
                 schemas: dict[str, dict] | None = None, stream_arguments: bool = True) -> None:
        super().__init__(tool_names, schemas)
        self._block: tuple[str, str] | None = None  # the block being held, if any
        # Whether the answer is held whole (None: not known yet).
        self._bare: bool | None = None if self.BARE else False
        # Streaming the arguments of a call in a block as they come (parse() holds blocks).
        self._stream_arguments = stream_arguments
        self._scan: CallScan | None = None  # the block's call, read as it arrives
        self._scanned = 0  # how much of the block's text the scan has had
        self._streaming: ToolCall | None = None  # the call whose arguments are streaming
        self._dropping = False  # a streamed call broke: its block's text up to the closing
        self._run: _CallRun | None = None  # a bare call's stream

    def _new_scan(self) -> CallScan | _EitherScan:
        """What reads a block's call as it arrives."""
        return CallScan(self._ARG_KEYS, self.tool_names)

    def _decode(self, body: str) -> list[ToolCall] | None:
        whole = scan_whole(body, self._ARG_KEYS, self.tool_names)
        if whole is not None:
            return [ToolCall(name=whole[0], arguments=whole[1])]
        return decode_calls(body, self._ARG_KEYS, self.tool_names)

    @classmethod
    def lazy_grammar(cls, functions: dict[str, dict],
                     token_ids: Mapping[str, int] | None = None) -> str | None:
        # Free text, then any number of calls each opened by the tag or a fence (lazy: the
        # shortest text before an opening), then free text; or the whole answer one bare call,
        # opened by `{"name": "<declared name>"` (a JSON answer naming anything else stays
        # free). One call a block, written as the chat template shows it (a newline after the
        # opening and before the closing). TEXT is any bytes, valid UTF-8 or not (the
        # negation's half), so that text without a call is what the model would write
        # unconstrained.
        lines = ["start: call* TEXT | bare", "TEXT: /(?s:.*)/ | ~/(?s:.*)/",
                 "call: tag_call | fence_call",
                 f"tag_open[lazy]: TEXT {lark_string(cls.START)}",
                 f"tag_call: tag_open \"\\n\" tool_json \"\\n{cls.END}\"",
                 "fence_open[lazy]: TEXT /```(json|tool_call)/",
                 "fence_call: fence_open \"\\n\" tool_json \"\\n```\"",
                 "bare: " + " | ".join(f"bare{i}" for i in range(len(functions))),
                 "BLANK: /[ \\t\\r\\n]+/"]
        key = lark_string(f", {lark_string(cls.ARGUMENTS)}: ")
        for i, (name, params) in enumerate(functions.items()):
            opening = regex_literal('{"name": ' + lark_string(name))
            lines += [f"bare{i}_open[lazy]: /[ \\t\\r\\n]*{opening}/",
                      f"bare{i}: bare{i}_open {key} bare{i}_args \"}}\" BLANK?",
                      f"bare{i}_args: %json " + json.dumps(
                          {**_object(params), "x-guidance": JSON_OPTIONS})]
        return "\n".join(lines) + "\n" + json_call_rule(cls.ARGUMENTS, functions)

    def parse(self, text: str) -> ParsedMessage:
        scan = type(self)(self.tool_names, self.schemas, stream_arguments=False)
        out = scan.feed(text)
        last = scan.finish()
        return ParsedMessage(content=_content_or_none(out.content + last.content),
                             tool_calls=scan.tool_calls())

    def feed(self, delta: str) -> StreamDelta:
        self._check_open()
        self._buffer += delta
        if self._bare is None:
            start = self._buffer.lstrip()
            if not start:
                return StreamDelta()
            self._bare = start[0] in "{["
            if self._bare and self._stream_arguments:
                # One bare object streams; an array waits for the whole answer.
                self._run = _CallRun(self, self._ARG_KEYS, "") if start[0] == "{" else None
        if self._bare:
            if self._run is not None:
                return StreamDelta(tool_calls=self._run.feed(self._buffer, 0))
            return StreamDelta()
        return self._drain(final=False)

    def finish(self) -> StreamDelta:
        self._check_open()
        self._finished = True
        if self._bare:
            calls = self._decode(self._buffer)
            if self._run is not None:
                rest = self._run.settle(calls)
                if rest is not None:
                    self._buffer = ""
                    return StreamDelta(content=self._content.close(), tool_calls=rest)
            elif calls is not None:
                self._buffer = ""
                return StreamDelta(content=self._content.close(),
                                   tool_calls=[self._emit_call(c) for c in calls])
        return self._drain(final=True)

    def _drain(self, final: bool) -> StreamDelta:
        """Emit everything the buffer settles. Outside a block the buffer holds at most a
        partial opening; inside one it holds the block's text since its opening."""
        out = StreamDelta()
        while True:
            if self._block is None:
                found = [(i, block) for block in self.BLOCKS
                         if (i := self._buffer.find(block[0])) >= 0]
                if not found:
                    keep = 0 if final else max(partial_suffix_len(self._buffer, opening)
                                               for opening, _ in self.BLOCKS)
                    text = self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(text):]
                    out.content += self._content.push(text)
                    break
                i, self._block = min(found, key=lambda f: f[0])
                out.content += self._content.push(self._buffer[:i])
                self._buffer = self._buffer[i + len(self._block[0]):]
                self._scan, self._scanned = self._new_scan(), 0
                continue
            if not self._in_block(out, final):
                break
        if final:
            out.content += self._content.close()
        return out

    def _in_block(self, out: StreamDelta, final: bool) -> bool:
        """Settle the block being held if its text allows; False when it needs more text."""
        opening, closing = self._block  # type: ignore[misc]  # set by the caller
        if self._dropping:
            j = self._buffer.find(closing)
            if j < 0:
                self._buffer = self._buffer[len(self._buffer) - partial_suffix_len(
                    self._buffer, closing):] if not final else ""
                if final:
                    self._end_block()
                return False
            self._buffer = self._buffer[j + len(closing):]
            self._end_block()
            return True
        scan = self._scan
        if scan is not None and scan.status is not Scan.OTHER:
            piece = scan.feed(self._buffer[self._scanned:])
            self._scanned = len(self._buffer)
            if scan.status is Scan.HEAD and not final:
                return False
            if scan.status in (Scan.ARGS, Scan.REST, Scan.DONE, Scan.BROKEN):
                if self._stream_arguments:
                    self._stream_piece(out, scan, piece)
                if scan.status in (Scan.ARGS, Scan.REST) and not final:
                    return False
                settled = self._after_call(out, scan, closing, final)
                if settled is not None:
                    return settled
        # Not the streamed form (or a held call that did not end well): the whole block.
        j = self._buffer.find(closing)
        if j < 0:
            if final:
                # Cut off: a call if its text decodes without the partial closing.
                body, self._buffer = self._buffer, ""
                cut = partial_suffix_len(body, closing)
                self._end_block()
                self._settle(out, self._decode(body[: len(body) - cut]), opening + body)
            return False
        body = self._buffer[:j]
        self._buffer = self._buffer[j + len(closing):]
        self._end_block()
        self._settle(out, self._decode(body), opening + body + closing)
        return True

    def _stream_piece(self, out: StreamDelta, scan: CallScan, piece: str) -> None:
        if self._streaming is None:
            assert scan.name is not None
            self._streaming = ToolCall(name=scan.name, arguments="")
            index = len(self._calls)
            self._calls.append(self._streaming)
            out.tool_calls.append(ToolCallDelta(index, self._streaming.id, scan.name, piece))
        elif piece:
            out.tool_calls.append(ToolCallDelta(len(self._calls) - 1, arguments=piece))
        self._streaming.arguments += piece

    def _after_call(self, out: StreamDelta, scan: CallScan, closing: str, final: bool
                    ) -> bool | None:
        """The block's call has ended (or the text has): settle the block if its closing
        follows. True: settled; False: needs more text; None: read the block whole."""
        rest = self._buffer[scan.end:] if scan.status is Scan.DONE else None
        if rest is not None:
            tail = rest.lstrip()
            if tail.startswith(closing) or (final and closing.startswith(tail)):
                cut = len(rest) - len(tail) + min(len(closing), len(tail))
                self._buffer = rest[cut:]
                if not self._stream_arguments:
                    assert scan.name is not None
                    out.tool_calls.append(self._emit_call(
                        ToolCall(name=scan.name, arguments=scan.arguments)))
                self._end_block()
                return True
            if not final and closing.startswith(tail):
                return False
        if not self._stream_arguments:
            return None
        # A call already streamed broke (cut off, not JSON, or text before its closing): it
        # stays sent (finish_reason tells a cut), and the rest of its block is dropped.
        self.broken.append(len(self._calls) - 1)
        self._dropping = True
        self._buffer = self._buffer[scan.end:] if scan.status is not Scan.ARGS and \
            scan.status is not Scan.REST else ""
        return self._in_block(out, final)

    def _end_block(self) -> None:
        self._block, self._scan, self._streaming, self._dropping = None, None, None, False

    def _settle(self, out: StreamDelta, calls: list[ToolCall] | None, raw: str) -> None:
        if calls is not None:
            out.tool_calls.extend(self._emit_call(c) for c in calls)
        else:
            out.content += self._content.push(raw)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calling: the whole output (after an optional `<|python_tag|>`)
    is `{"name": ..., "parameters": {...}}`, or several such objects separated by `;`.

    Output that does not start with `{` is plain content, streamed at once. Output that does is
    held back whole until finish(), because only the complete text tells a call from content
    that happens to begin with a brace; if it does not decode as calls, it is all content."""

    name: ClassVar[str] = "llama3_json"

    PYTHON_TAG: ClassVar[str] = "<|python_tag|>"
    _ARG_KEYS: ClassVar[tuple[str, ...]] = ("parameters", "arguments")
    ARGUMENTS: ClassVar[str] = "parameters"
    _OPEN: ClassVar[str] = "{"  # how output that may be calls starts

    @classmethod
    def lazy_grammar(cls, functions: dict[str, dict],
                     token_ids: Mapping[str, int] | None = None) -> str | None:
        # Any bytes that do not start with a brace, or one call. (<|python_tag|> is a special
        # token, which the grammar's text does not include: Llama 3.1 writes custom tools'
        # calls without it.)
        return ("start: TEXT | tool_json\n"
                "TEXT: ~BRACED\nBRACED: \"{\" BYTES\nBYTES: /(?s:.*)/ | ~/(?s:.*)/\n"
                + json_call_rule(cls.ARGUMENTS, functions))

    STREAM_JSON: ClassVar[bool] = True  # whether held calls stream their arguments

    def __init__(self, tool_names: list[str] | None = None,
                 schemas: dict[str, dict] | None = None) -> None:
        super().__init__(tool_names, schemas)
        # None: undecided; "content": streaming plain text; "json": calls, perhaps.
        self._mode: str | None = None
        self._run = _CallRun(self, self._ARG_KEYS, ";") if self.STREAM_JSON else None
        self._json_at = 0  # where the JSON starts in the buffer (after the python tag)

    def _json_start(self, text: str) -> str | None:
        """The text after leading whitespace and an optional python tag, or None when that
        cannot be known yet (only whitespace or a partial tag so far)."""
        s = text.lstrip()
        if s.startswith(self.PYTHON_TAG):
            s = s[len(self.PYTHON_TAG):].lstrip()
        elif self.PYTHON_TAG.startswith(s):
            return None
        return s or None

    def _decode_calls(self, text: str) -> list[ToolCall] | None:
        s = text.strip()
        if s.startswith(self.PYTHON_TAG):
            s = s[len(self.PYTHON_TAG):].strip()
        if not s.startswith("{"):
            return None
        # raw_decode rather than split(";"): a ';' may sit inside a string argument.
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = pos
            try:
                obj, pos = decoder.raw_decode(s, pos)
            except json.JSONDecodeError:
                return None
            # The model's own text of the arguments where it streams them, as feed() does.
            whole = scan_whole(s[start:pos], self._ARG_KEYS, self.tool_names)
            call = ToolCall(*whole) if whole is not None else \
                call_from_object(obj, self._ARG_KEYS)
            if call is None or (self.tool_names is not None and call.name not in self.tool_names):
                return None
            calls.append(call)
            while pos < len(s) and s[pos].isspace():
                pos += 1
            if pos == len(s):
                return calls
            if s[pos] != ";":
                return None
            pos += 1
            while pos < len(s) and s[pos].isspace():
                pos += 1
            if pos == len(s):  # a trailing ';' is harmless
                return calls

    def parse(self, text: str) -> ParsedMessage:
        calls = self._decode_calls(text)
        if calls is None:
            return ParsedMessage(content=_content_or_none(text), tool_calls=[])
        return ParsedMessage(content=None, tool_calls=calls)

    def feed(self, delta: str) -> StreamDelta:
        self._check_open()
        if self._mode == "content":
            return StreamDelta(content=self._content.push(delta))
        self._buffer += delta
        if self._mode is None:
            start = self._json_start(self._buffer)
            if start is not None:
                self._mode = "json" if start.startswith(self._OPEN) else "content"
                self._json_at = len(self._buffer) - len(start)
            if self._mode == "content":
                text, self._buffer = self._buffer, ""
                return StreamDelta(content=self._content.push(text))
        if self._mode == "json" and self._run is not None:
            return StreamDelta(tool_calls=self._run.feed(self._buffer, self._json_at))
        return StreamDelta()

    def finish(self) -> StreamDelta:
        if self._mode == "content":
            self._check_open()
            self._finished = True
            return StreamDelta(content=self._content.close())
        if self._run is not None and self._run.sent:
            self._check_open()
            self._finished = True
            rest = self._run.settle(self._decode_calls(self._buffer))
            self._buffer = ""
            return StreamDelta(content=self._content.close(), tool_calls=rest or [])
        # Undecided or held JSON: the base class parses the whole buffer.
        return super().finish()


def _typed_value(text: str, schema: Any) -> Any:
    """An XML parameter's text as its schema's type says: strings as written (less the
    newline after the opening tag and before the closing one), numbers, booleans, objects and
    arrays decoded from JSON; text that does not decode as its type stays a string, which the
    client's own validation then sees."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    if kind is None or (isinstance(kind, list)):
        return value
    fits = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
    check = fits.get(kind)
    return value if check is None or check(value) else text


def _xml_value(rule: str, schema: Any) -> list[str]:
    """Grammar lines for an XML parameter's value and its closing tag, as _typed_value reads
    it back: a string as text (its enum's or pattern's where it has one), any other type as
    its JSON held to its schema, and anything where the schema says nothing."""
    closing = lark_string("\n</parameter>")
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        texts = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                 for v in values]
        return [f"{rule}: (" + " | ".join(lark_string(t) for t in texts) + f") {closing}"]
    if kind == "string":
        pattern = schema.get("pattern")
        if isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$"):
            body = pattern[1:-1].replace("/", "\\/")
            return [f"{rule}: /{body}/ {closing}"]
        return [f"{rule}[lazy]: /(?s:.*)/ {closing}"]
    if kind is None or isinstance(kind, list):
        return [f"{rule}[lazy]: /(?s:.*)/ {closing}"]
    return [f"{rule}: {rule}_json {closing}",
            f"{rule}_json: %json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})]


def _json_text(text: str) -> str:
    """`text`'s characters as json.dumps writes them inside a string (ensure_ascii off):
    escaping is per character, so pieces escaped apart join to the whole's escaping."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _XmlCallScan:
    """Reads a Qwen3-Coder call, `<function=NAME>` then `<parameter=P>` blocks, as it arrives,
    with CallScan's statuses, and streams its arguments as the JSON object the parser makes of
    them: each parameter's key as it opens, a string-typed value's text as it comes, any other
    value whole at its closing tag (its type decides how it reads). The call ends at
    `</function>` (DONE, `end` past it) or, as the parser also allows, at the block's
    closing tag; the arguments are then checked against the parser's own reading of the
    text, and any difference makes the call BROKEN."""

    _HEAD = re.compile(r"\s*<function=([^>\n]+)>")
    PARAM, PARAM_END = "<parameter=", "</parameter>"
    FUNCTION_END, BLOCK_END = "</function>", "</tool_call>"

    def __init__(self, parser: Qwen3CoderToolParser) -> None:
        self.parser = parser
        self.status = Scan.HEAD
        self.name: str | None = None
        self.arguments = ""
        self.end = 0
        self._text = ""
        self._pos = 0
        self._count = 0  # parameters read
        self._value: int | None = None  # where the open parameter's value starts
        self._key = ""  # the open parameter's name
        self._string = False  # whether it streams as a string
        self._sent = 0  # how far its text has been sent

    def feed(self, piece: str) -> str:
        self._text += piece
        out: list[str] = []
        if self.status is Scan.HEAD:
            self._read_head(out)
        while self.status is Scan.ARGS and self._step(out):
            pass
        text = "".join(out)
        self.arguments += text
        return text

    def _read_head(self, out: list[str]) -> None:
        m = self._HEAD.match(self._text)
        if m is None:
            start, opening = self._text.lstrip(), "<function="
            if len(start) < len(opening):
                viable = opening.startswith(start)
            else:  # a name still open: no newline, and not a runaway
                viable = start.startswith(opening) and "\n" not in start and len(start) < 256
            if not viable:
                self.status = Scan.OTHER
            return
        name = m.group(1).strip()
        names = self.parser.tool_names
        if not name or (names is not None and name not in names):
            self.status = Scan.OTHER
            return
        self.name, self.status, self._pos = name, Scan.ARGS, m.end()
        out.append("{")

    def _step(self, out: list[str]) -> bool:
        """Read on; False when more text is needed (or the call ended)."""
        t = self._text
        if self._value is not None:
            return self._in_value(out)
        i = self._pos
        while i < len(t) and t[i].isspace():
            i += 1
        rest = t[i:]
        if rest.startswith(self.PARAM):
            close = rest.find(">")
            key = rest[len(self.PARAM):close] if close >= 0 else rest[len(self.PARAM):]
            if "\n" in key or (close >= 0 and not key.strip()):
                return self._broken(i)
            if close < 0 or i + close + 1 >= len(t):
                return False  # the key, or whether a newline follows it, is not known yet
            start = i + close + 1
            self._value = start + 1 if t[start] == "\n" else start
            key = key.strip()
            props = (self.parser.schemas.get(self.name or "") or {}).get("properties") or {}
            schema = props.get(key)
            self._string = isinstance(schema, dict) and schema.get("type") == "string"
            self._sent = self._value
            out.append(("" if self._count == 0 else ", ") + json.dumps(key, ensure_ascii=False)
                       + ": " + ('"' if self._string else ""))
            self._key = key
            return True
        for ending, consumed in ((self.FUNCTION_END, True), (self.BLOCK_END, False)):
            if rest.startswith(ending):
                return self._done(i + (len(ending) if consumed else 0), out)
        if any(tag.startswith(rest) for tag in (self.PARAM, self.FUNCTION_END, self.BLOCK_END)):
            return False
        return self._broken(i)

    def _in_value(self, out: list[str]) -> bool:
        t, start = self._text, self._value
        assert start is not None
        j = t.find(self.PARAM_END, start)
        if j < 0:
            if self._string:
                safe = len(t) - partial_suffix_len(t[start:], "\n" + self.PARAM_END)
                if safe > self._sent:
                    out.append(_json_text(t[self._sent:safe]))
                    self._sent = safe
            return False
        end = j - 1 if j > start and t[j - 1] == "\n" else j
        if self._string:
            out.append(_json_text(t[self._sent:end]) + '"')
        else:
            props = (self.parser.schemas.get(self.name or "") or {}).get("properties") or {}
            value = _typed_value(t[start:end], props.get(self._key))
            out.append(json.dumps(value, ensure_ascii=False))
        self._value, self._pos = None, j + len(self.PARAM_END)
        self._count += 1
        return True

    def _done(self, end: int, out: list[str]) -> bool:
        out.append("}")
        self.end = end
        whole = self.arguments + "".join(out)
        # The parser's own reading is the authority: the stream must have said the same.
        calls = self.parser._decode_xml(self._text[:end])
        ok = calls is not None and (calls[0].name, calls[0].arguments) == (self.name, whole)
        self.status = Scan.DONE if ok else Scan.BROKEN
        return False

    def _broken(self, at: int) -> bool:
        self.status, self.end = Scan.BROKEN, at
        return False


class _EitherScan:
    """A block's call in whichever form its first character shows: JSON (`{`) or XML (`<`)."""

    def __init__(self, json_scan: CallScan, xml_scan: _XmlCallScan) -> None:
        self._scans = (json_scan, xml_scan)
        self._chosen: CallScan | _XmlCallScan | None = None
        self._held = ""

    def feed(self, piece: str) -> str:
        if self._chosen is None:
            self._held += piece
            start = self._held.lstrip()
            if not start:
                return ""
            self._chosen = self._scans[0] if start[0] == "{" else self._scans[1]
            piece, self._held = self._held, ""
        return self._chosen.feed(piece)

    @property
    def status(self) -> Scan:
        return Scan.HEAD if self._chosen is None else self._chosen.status

    @property
    def name(self) -> str | None:
        return None if self._chosen is None else self._chosen.name

    @property
    def arguments(self) -> str:
        return "" if self._chosen is None else self._chosen.arguments

    @property
    def end(self) -> int:
        return 0 if self._chosen is None else self._chosen.end


class Qwen3CoderToolParser(HermesToolParser):
    """Qwen3-Coder: `<tool_call>` blocks holding XML rather than JSON,

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Zürich
        </parameter>
        </function>
        </tool_call>

    each parameter's text typed by the declared function's schema (`_typed_value`). A block
    holding Hermes JSON is read as Hermes reads it. The scan, the streaming and what stays
    content are HermesToolParser's (no fenced or bare forms: this family writes its tags)."""

    name: ClassVar[str] = "qwen3_coder"

    BLOCKS: ClassVar[tuple[tuple[str, str], ...]] = ((HermesToolParser.START,
                                                      HermesToolParser.END),)
    BARE: ClassVar[bool] = False

    @classmethod
    def lazy_grammar(cls, functions: dict[str, dict],
                     token_ids: Mapping[str, int] | None = None) -> str | None:
        # Free text, then calls opened by the tag, as the template writes them: a declared
        # function, then its declared parameters in the schema's order (the required ones
        # always), each value held to its schema (_xml_value), then free text.
        lines = ["start: call* TEXT", "TEXT: /(?s:.*)/ | ~/(?s:.*)/",
                 f"tag_open[lazy]: TEXT {lark_string(cls.START)}",
                 f"call: tag_open \"\\n\" function \"\\n{cls.END}\"",
                 "function: " + " | ".join(f"f{i}" for i in range(len(functions)))]
        for i, (name, params) in enumerate(functions.items()):
            props = params.get("properties") or {}
            required = set(params.get("required") or [])
            parts = []
            for j, (key, schema) in enumerate(props.items()):
                rule = f"p{i}_{j}"
                lines.append(f"{rule}: {lark_string(f'<parameter={key}>' + chr(10))} "
                             f"v{i}_{j} \"\\n\"")
                lines.extend(_xml_value(f"v{i}_{j}", schema))
                parts.append(rule if key in required else f"{rule}?")
            lines.append(f"f{i}: {lark_string(f'<function={name}>' + chr(10))} "
                         + " ".join(parts) + " \"</function>\"")
        return "\n".join(lines) + "\n"

    def _new_scan(self) -> CallScan | _EitherScan:
        return _EitherScan(CallScan(self._ARG_KEYS, self.tool_names), _XmlCallScan(self))

    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def _decode(self, body: str) -> list[ToolCall] | None:
        if self._FUNCTION.match(body) is None:
            return super()._decode(body)
        return self._decode_xml(body)

    def _decode_xml(self, body: str) -> list[ToolCall] | None:
        """`body` (a block's text) as one XML call of a declared function, or None."""
        m = self._FUNCTION.match(body)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        if self.tool_names is not None and name not in self.tool_names:
            return None
        props = (self.schemas.get(name) or {}).get("properties") or {}
        arguments: dict[str, Any] = {}
        pos = 0
        for p in self._PARAMETER.finditer(inner):
            if inner[pos:p.start()].strip():
                return None  # text between parameters: not this form
            key = p.group(1).strip()
            arguments[key] = _typed_value(p.group(2), props.get(key))
            pos = p.end()
        if inner[pos:].strip():
            return None
        return [ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))]


class MistralToolParser(ToolParser):
    """Mistral: text, then `[TOOL_CALLS]` and the calls, either as a JSON array of
    `{"name", "arguments"}` (v0.3 tokenizers) or as `name[ARGS]{...}`, repeated after further
    `[TOOL_CALLS]` markers (v11 and later; a `[CALL_ID]id` before `[ARGS]` is skipped).

    Text before the first marker streams at once (less a tail that may be the marker's
    start); what follows it is held until finish(), and is content, marker included, unless
    all of it reads as calls of declared functions."""

    name: ClassVar[str] = "mistral"

    MARKER: ClassVar[str] = "[TOOL_CALLS]"
    _ARGS: ClassVar[str] = "[ARGS]"
    _CALL_ID: ClassVar[str] = "[CALL_ID]"
    _ARG_KEYS: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    SPECIAL_TOKENS: ClassVar[tuple[str, ...]] = (MARKER, _ARGS, _CALL_ID)

    @classmethod
    def lazy_grammar(cls, functions: dict[str, dict],
                     token_ids: Mapping[str, int] | None = None) -> str | None:
        # Free text, or free text and then the calls, which end the answer: opened by the
        # marker (its token where the vocabulary has one, else its text, lazily, as the other
        # forms' tags), written the way the vocabulary says: `name[ARGS]{...}` after each
        # marker where [ARGS] is a token (v11 and later), else one JSON array of calls (v3).
        ids = token_ids or {}
        if cls.MARKER in ids:
            # Free text that cannot hold the marker's token: valid UTF-8, which llguidance's
            # special tokens (a 0xFF byte, then the name) never are.
            lines = ["start: TEXT | TEXT? calls", "TEXT: /(?s:.*)/"]
            marker = f"<[{ids[cls.MARKER]}]>"
        else:
            lines = ["start: TEXT | marker_text calls_rest", "TEXT: /(?s:.*)/ | ~/(?s:.*)/",
                     f"marker_text[lazy]: TEXT {lark_string(cls.MARKER)}",
                     "calls_rest: \"[\" tool_json (\", \" tool_json)* \"]\""]
            return "\n".join(lines) + "\n" + json_call_rule("arguments", functions)
        if cls._ARGS in ids:
            lines += [f"calls: ({marker} function)+",
                      "function: " + " | ".join(
                          f"{lark_string(name)} <[{ids[cls._ARGS]}]> args{i}"
                          for i, name in enumerate(functions))]
            lines += [f"args{i}: %json " + json.dumps({**_object(params),
                                                        "x-guidance": JSON_OPTIONS})
                      for i, params in enumerate(functions.values())]
        else:
            lines += [f"calls: {marker} \"[\" tool_json (\", \" tool_json)* \"]\""]
        return "\n".join(lines) + "\n" + json_call_rule("arguments", functions)

    def __init__(self, tool_names: list[str] | None = None,
                 schemas: dict[str, dict] | None = None) -> None:
        super().__init__(tool_names, schemas)
        self._held = False  # past the first marker

    def _decode(self, tail: str) -> list[ToolCall] | None:
        if tail.lstrip().startswith("["):
            return decode_calls(tail, self._ARG_KEYS, self.tool_names)
        calls: list[ToolCall] = []
        for part in tail.split(self.MARKER):
            if not part.strip():
                continue
            name, sep, raw = part.partition(self._ARGS)
            name = name.split(self._CALL_ID)[0].strip()
            if not sep or not name or (self.tool_names is not None and
                                       name not in self.tool_names):
                return None
            arguments = normalize_arguments(raw.strip()) if raw.strip().startswith("{") else None
            if arguments is None:
                return None
            calls.append(ToolCall(name=name, arguments=arguments))
        return calls or None

    def _split(self, text: str) -> tuple[str, str | None]:
        i = text.find(self.MARKER)
        return (text, None) if i < 0 else (text[:i], text[i + len(self.MARKER):])

    def parse(self, text: str) -> ParsedMessage:
        before, tail = self._split(text)
        calls = self._decode(tail) if tail is not None else None
        if calls is None:
            return ParsedMessage(content=_content_or_none(text), tool_calls=[])
        return ParsedMessage(content=_content_or_none(before), tool_calls=calls)

    def feed(self, delta: str) -> StreamDelta:
        self._check_open()
        self._buffer += delta
        if self._held:
            return StreamDelta()
        before, tail = self._split(self._buffer)
        if tail is not None:
            self._held = True
            self._buffer = self.MARKER + tail
            return StreamDelta(content=self._content.push(before))
        keep = partial_suffix_len(self._buffer, self.MARKER)
        text = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(text):]
        return StreamDelta(content=self._content.push(text))

    def finish(self) -> StreamDelta:
        self._check_open()
        self._finished = True
        text, self._buffer = self._buffer, ""
        out = StreamDelta()
        calls = self._decode(text[len(self.MARKER):]) if self._held else None
        if calls is None:
            out.content += self._content.push(text)
        else:
            out.tool_calls.extend(self._emit_call(c) for c in calls)
        out.content += self._content.close()
        return out


class _PythonicCall(Exception):
    """The text is not a list of calls with literal keyword arguments."""


def _literal(node: ast.AST) -> Any:
    """A keyword argument's value: a Python literal, or JSON's true/false/null (as models
    write them in calls too)."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _PythonicCall  # a ** expansion
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise _PythonicCall from e


def _python_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def _in_order(items: list[tuple[str, bool]]) -> str:
    """A Lark expression for `items` (expression, required) in order, the required ones
    always, any of the others, separated by ", "."""
    def rest(j: int) -> str:  # items j.. after at least one item
        if j == len(items):
            return ""
        item, needed = items[j]
        head = f'", " {item}' if needed else f'(", " {item})?'
        return f"{head} {rest(j + 1)}".strip()

    def first(j: int) -> str:  # items j.. with none before
        if j == len(items):
            return ""
        item, needed = items[j]
        here = f"{item} {rest(j + 1)}".strip()
        if needed:
            return here
        later = first(j + 1)
        return f"({here} | {later})" if later else f"({here})?"

    return first(0)


class PythonicToolParser(Llama3JsonToolParser):
    """Llama 3.2 / Llama 4 pythonic calls: the whole output (after an optional
    `<|python_tag|>`) is a Python list of calls with keyword arguments,
    `[get_weather(city="Zürich"), get_time(timezone="Europe/Paris")]`. It is read with `ast`,
    never evaluated. Output that does not start with `[` streams as content at once; output
    that does is held until finish(), and is content unless it is all such calls of declared
    functions."""

    name: ClassVar[str] = "pythonic"

    _OPEN: ClassVar[str] = "["
    STREAM_JSON: ClassVar[bool] = False

    @classmethod
    def lazy_grammar(cls, functions: dict[str, dict],
                     token_ids: Mapping[str, int] | None = None) -> str | None:
        # Free text, or (opened by `[` and a declared name's call) a list of calls of
        # declared functions, each with its parameters as keywords in the schema's order (the
        # required ones always), each value JSON held to its schema: JSON's literals are
        # Python's, with true/false/null, which the parser reads as JSON's. Names Python
        # cannot write as a call or keyword (`from`, `a-b`) are left out: a function that
        # requires one cannot be called in this form.
        functions = {name: params for name, params in functions.items()
                     if _python_name(name) and all(
                         _python_name(k) for k in params.get("required") or [])}
        if not functions:
            return None
        lines = ["start: TEXT | calls", "TEXT: /(?s:.*)/ | ~/(?s:.*)/",
                 "BLANK: /[ \\t\\r\\n]+/",
                 "calls: first (\", \" call)* \"]\" BLANK?",
                 "first: " + " | ".join(f"open{i} args{i}" for i in range(len(functions))),
                 "call: " + " | ".join(f"{lark_string(name + '(')} args{i}"
                                       for i, name in enumerate(functions))]
        for i, (name, params) in enumerate(functions.items()):
            lines.append(f"open{i}[lazy]: /[ \\t\\r\\n]*\\[{regex_literal(name + '(')}/")
            props = params.get("properties") or {}
            required = set(params.get("required") or [])
            keywords = []
            for j, (key, schema) in enumerate(props.items()):
                if not _python_name(key):
                    continue
                keywords.append((f"{lark_string(key + '=')} v{i}_{j}", key in required))
                lines.append(f"v{i}_{j}: %json " + json.dumps(
                    {**(schema if isinstance(schema, dict) else {}),
                     "x-guidance": JSON_OPTIONS}))
            lines.append(f"args{i}: {_in_order(keywords)} \")\"")
        return "\n".join(lines) + "\n"

    def _decode_calls(self, text: str) -> list[ToolCall] | None:
        s = text.strip()
        if s.startswith(self.PYTHON_TAG):
            s = s[len(self.PYTHON_TAG):].strip()
        if not s.startswith("["):
            return None
        try:
            tree = ast.parse(s, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or \
                        node.args or any(k.arg is None for k in node.keywords):
                    return None
                if self.tool_names is not None and node.func.id not in self.tool_names:
                    return None
                arguments = {k.arg: _literal(k.value) for k in node.keywords}
                calls.append(ToolCall(name=node.func.id,
                                      arguments=json.dumps(arguments, ensure_ascii=False)))
            return calls
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError, _PythonicCall):
            return None


class GptOssToolParser(ToolParser):
    """gpt-oss's harmony calls (kvserve.entrypoints.server.harmony): a message to
    `functions.<name>`, its body the arguments object, ended by `<|call|>`:

        <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>

    (`to=` may come before `<|channel|>`; the first message of a generation has no
    `<|start|>assistant`, which the prompt holds). Several calls may follow one another.
    A call of an undeclared function, or whose body is not a JSON object, stays content,
    markup and all; so does every other message, verbatim (the gpt-oss reasoning parser
    has already taken the markup off the messages meant for the user).

    Text outside calls streams at once; a call is held until its message ends, then sent
    whole."""

    name: ClassVar[str] = "gpt-oss"
    aliases: ClassVar[tuple[str, ...]] = ("harmony",)
    SPECIAL_TOKENS: ClassVar[tuple[str, ...]] = harmony.MARKERS

    @classmethod
    def lazy_grammar(cls, functions: dict[str, dict],
                     token_ids: Mapping[str, int] | None = None) -> str | None:
        # Harmony's messages, with its markers as the control tokens they are (a text
        # terminal cannot hold one, so the free parts are runs of text and markers): each
        # message a header, then `<|message|>` and a body, or a call. A header's text that
        # names `to=functions.` (after its start, a space or a marker, as the parser reads
        # a recipient) opens a call, lazily: a declared name, the rest of a short header
        # (a space or a marker first, so that no name runs into a longer one; words such
        # as `json`, never a second `to=`), then the arguments object and `<|call|>`. No
        # grammar where the vocabulary lacks a marker.
        ids = token_ids or {}
        if any(m not in ids for m in harmony.MARKERS):
            return None
        start, channel, message, constrain, end, ret, call = (
            f"<[{ids[m]}]>" for m in harmony.MARKERS)
        # header text between markers, one lexeme a run (two in a row could split the
        # trigger between them and read past it)
        head = f"(HTEXT? ({channel} | {constrain}))* HTEXT?"
        names = "(" + " | ".join(f"call{i}" for i in range(len(functions))) + ")"
        lines = [f"start: (msg | first_call) ({start} (msg | call))*",
                 f"msg: {head} ({message} BODY)? ({end} | {ret})?",
                 # The first message's header (its `<|start|>assistant` is in the prompt)
                 # opens with a marker or with ` to=`, as the parser reads it; later ones
                 # open with `assistant`.
                 f"first_call: ({channel} | {constrain}) {head} call_open {names}"
                 f" | first_open {names}",
                 f"call: {head} call_open {names}",
                 "HTEXT: /(?s:.+)/ & ~/(?s:.*to=functions\\..*)/",
                 "BODY: /(?s:.*)/",
                 "call_open[lazy]: /([^\\n]{0,64}[ \\t])?to=functions\\./",
                 "first_open[lazy]: / ?to=functions\\./",
                 f"rest: ((SPACED | {channel} | {constrain}) (LINE | {channel} | {constrain})"
                 "{0,3})?",
                 "SPACED: / [A-Za-z0-9_ .:-]{0,48}/", "LINE: /[A-Za-z0-9_ .:-]{1,48}/"]
        for i, (name, params) in enumerate(functions.items()):
            lines += [f"call{i}: {lark_string(name)} rest {message} args{i} {call}",
                      f"args{i}: %json " + json.dumps({**_object(params),
                                                        "x-guidance": JSON_OPTIONS})]
        return "\n".join(lines) + "\n"

    def __init__(self, tool_names: list[str] | None = None,
                 schemas: dict[str, dict] | None = None) -> None:
        super().__init__(tool_names, schemas)
        self._scanner = harmony.HarmonyScanner()
        self._call: str | None = None  # the function of the call message being read
        self._held: list[str] = []  # its raw text so far (content if it is no call)

    def parse(self, text: str) -> ParsedMessage:
        whole = type(self)(self.tool_names, self.schemas)
        first, last = whole.feed(text), whole.finish()
        content = first.content + last.content
        return ParsedMessage(content or None, whole.tool_calls())

    def feed(self, delta: str) -> StreamDelta:
        self._check_open()
        return self._take(self._scanner.feed(delta))

    def finish(self) -> StreamDelta:
        self._check_open()
        out = self._take(self._scanner.finish())
        self._finished = True
        out.content += self._content.close()
        return out

    def _take(self, pieces: list[harmony.Piece]) -> StreamDelta:
        out = StreamDelta()
        for piece in pieces:
            if piece.kind == "open" and piece.header is not None and (
                    name := piece.header.function) is not None and (
                    self.tool_names is None or name in self.tool_names):
                self._call, self._held = name, [piece.text]
            elif self._call is None:
                out.content += self._content.push(piece.text)
            elif piece.kind != "close":
                self._held.append(piece.text)
            else:
                body = "".join(self._held[1:])
                arguments = normalize_arguments(body.strip())
                if arguments is None:  # not an arguments object: the message is text
                    out.content += self._content.push("".join(self._held) + piece.text)
                else:
                    out.tool_calls.append(self._emit_call(ToolCall(self._call, arguments)))
                self._call, self._held = None, []
        return out


# Every parser under its name and its aliases.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    key: cls
    for cls in (HermesToolParser, Qwen3CoderToolParser, Llama3JsonToolParser,
                PythonicToolParser, MistralToolParser, GptOssToolParser)
    for key in (cls.name, *cls.aliases)
}


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser of the tool-call form a chat template writes or asks for (what
    `--tool-call-parser auto` picks), from its own markers; None when it shows none."""
    t = chat_template or ""
    # harmony's markers are unambiguous (and its template names "tool_call" variables)
    if harmony.is_harmony_template(t):
        return GptOssToolParser.name
    if "<function=" in t and "<parameter=" in t:
        return Qwen3CoderToolParser.name
    if HermesToolParser.START in t:
        return HermesToolParser.name
    if MistralToolParser.MARKER in t:
        return MistralToolParser.name
    if re.search(r"\[func_name\d*\(", t):
        return PythonicToolParser.name
    if Llama3JsonToolParser.PYTHON_TAG in t or '"parameters": dictionary' in t:
        return Llama3JsonToolParser.name
    return None


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; known: {known}") from None
