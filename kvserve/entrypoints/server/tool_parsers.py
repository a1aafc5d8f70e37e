"""Turn a chat model's generated text into OpenAI tool calls, for a whole generation and for a
stream of text deltas.

Each format is a `ToolParser` subclass registered in `TOOL_PARSERS` under the name the server's
`--tool-call-parser` style option uses. A parser instance holds the state of one stream: make a
new one per request.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


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
    streaming call used may differ from a separate parse() call; that's fine).

    Invariants: indexes start at 0 and increase by one per call, in the order of the text; the
    first delta of an index carries its id and name and later ones carry neither; once
    finish() has returned, tool_calls() lists every call streamed, with those same ids.

    `tool_names` (the request's declared functions) is kept for subclasses and callers, but a
    call naming an unknown function is still returned: the caller decides what to do with it.

    The default feed() holds everything back and finish() parses the whole text; subclasses
    override them to stream earlier."""

    name: ClassVar[str]

    def __init__(self, tool_names: list[str] | None = None) -> None:
        self.tool_names = list(tool_names) if tool_names is not None else None
        self._buffer = ""
        self._calls: list[ToolCall] = []
        self._content = _ContentChannel()
        self._finished = False

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

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}: stream already finished")

    def _emit_call(self, call: ToolCall) -> ToolCallDelta:
        index = len(self._calls)
        self._calls.append(call)
        return ToolCallDelta(index=index, id=call.id, name=call.name, arguments=call.arguments)


class HermesToolParser(ToolParser):
    """Qwen 2.5 / Qwen 3 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    possibly several, possibly after some plain text.

    A block whose JSON does not decode to a call stays in the content verbatim, tags included.
    An unterminated last block (generation cut off) is a call if its JSON decodes anyway."""

    name: ClassVar[str] = "hermes"

    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"
    _ARG_KEYS: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def __init__(self, tool_names: list[str] | None = None) -> None:
        super().__init__(tool_names)
        self._in_call = False

    def _closed_block(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        return call_from_object(obj, self._ARG_KEYS)

    def _open_block(self, body: str) -> ToolCall | None:
        # A cut-off generation may end partway through the end tag; that part is not JSON.
        cut = partial_suffix_len(body, self.END)
        return self._closed_block(body[: len(body) - cut])

    def parse(self, text: str) -> ParsedMessage:
        # The same scan as _drain() (first start tag, then first end tag after it), so streaming
        # and whole parsing agree on every input, malformed ones included.
        parts: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            i = text.find(self.START, pos)
            if i < 0:
                parts.append(text[pos:])
                break
            parts.append(text[pos:i])
            body_start = i + len(self.START)
            j = text.find(self.END, body_start)
            if j < 0:
                body = text[body_start:]
                call = self._open_block(body)
                if call is not None:
                    calls.append(call)
                else:
                    parts.append(self.START + body)
                break
            body = text[body_start:j]
            call = self._closed_block(body)
            if call is not None:
                calls.append(call)
            else:
                parts.append(self.START + body + self.END)
            pos = j + len(self.END)
        return ParsedMessage(content=_content_or_none("".join(parts)), tool_calls=calls)

    def feed(self, delta: str) -> StreamDelta:
        self._check_open()
        self._buffer += delta
        return self._drain(final=False)

    def finish(self) -> StreamDelta:
        self._check_open()
        self._finished = True
        return self._drain(final=True)

    def _drain(self, final: bool) -> StreamDelta:
        """Emit everything the buffer settles. Outside a block the buffer holds at most a
        partial start tag; inside one it holds the block's text since the start tag."""
        out = StreamDelta()
        while True:
            if not self._in_call:
                i = self._buffer.find(self.START)
                if i < 0:
                    keep = 0 if final else partial_suffix_len(self._buffer, self.START)
                    text = self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(text):]
                    out.content += self._content.push(text)
                    break
                out.content += self._content.push(self._buffer[:i])
                self._buffer = self._buffer[i + len(self.START):]
                self._in_call = True
                continue
            j = self._buffer.find(self.END)
            if j < 0:
                if final:
                    body, self._buffer = self._buffer, ""
                    self._in_call = False
                    self._settle(out, self._open_block(body), self.START + body)
                break
            body = self._buffer[:j]
            self._buffer = self._buffer[j + len(self.END):]
            self._in_call = False
            self._settle(out, self._closed_block(body), self.START + body + self.END)
        if final:
            out.content += self._content.close()
        return out

    def _settle(self, out: StreamDelta, call: ToolCall | None, raw: str) -> None:
        if call is not None:
            out.tool_calls.append(self._emit_call(call))
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

    def __init__(self, tool_names: list[str] | None = None) -> None:
        super().__init__(tool_names)
        # None: undecided; "content": streaming plain text; "json": holding until finish().
        self._mode: str | None = None

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
            try:
                obj, pos = decoder.raw_decode(s, pos)
            except json.JSONDecodeError:
                return None
            call = call_from_object(obj, self._ARG_KEYS)
            if call is None:
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
                self._mode = "json" if start.startswith("{") else "content"
            if self._mode == "content":
                text, self._buffer = self._buffer, ""
                return StreamDelta(content=self._content.push(text))
        return StreamDelta()

    def finish(self) -> StreamDelta:
        if self._mode == "content":
            self._check_open()
            self._finished = True
            return StreamDelta(content=self._content.close())
        # Undecided or held JSON: the base class parses the whole buffer.
        return super().finish()


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; known: {known}") from None
