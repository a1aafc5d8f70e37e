"""Split a generation's "thinking" from its answer, for a whole generation and for a stream.

Each format is a `ReasoningParser` subclass registered in `REASONING_PARSERS`. An instance holds
the state of one stream: make a new one per request.

Whitespace, the same for every format: leading and trailing newlines are stripped from the
reasoning, leading newlines from the content, and either is None when nothing but whitespace is
left. Streaming holds back exactly what those rules might still remove, plus partial tags.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kvserve.entrypoints.server import harmony
from kvserve.entrypoints.server.tool_parsers import partial_suffix_len

THINK_START = "<think>"
THINK_END = "</think>"
_NEWLINES = "\r\n"


def _finalize(text: str, strip_trailing: bool) -> str | None:
    text = text.lstrip(_NEWLINES)
    if strip_trailing:
        text = text.rstrip(_NEWLINES)
    return text if text.strip() else None


class _Channel:
    """Streams one output (reasoning or content) so that its pieces concatenate to exactly what
    _finalize() makes of the whole: leading newlines dropped, trailing ones (if stripped) held
    until something else follows, and everything held until it is more than whitespace."""

    def __init__(self, strip_trailing: bool) -> None:
        self._strip_trailing = strip_trailing
        self._held = ""
        self._leading = True  # still dropping leading newlines
        self._started = False  # a non-whitespace character has been emitted

    def push(self, text: str) -> str:
        if self._leading:
            text = text.lstrip(_NEWLINES)
            if not text:
                return ""
            self._leading = False
        held = self._held + text
        if not self._started:
            if not held.strip():
                self._held = held
                return ""
            self._started = True
        # Only newlines after the last non-whitespace character can be stripped, so only those
        # are held; rstrip cannot reach past that character.
        out = held.rstrip(_NEWLINES) if self._strip_trailing else held
        self._held = held[len(out):]
        return out

    def close(self) -> str:
        # What is held is either trailing newlines or whitespace only: both are dropped.
        self._held = ""
        return ""


class ReasoningParser(ABC):
    """Splits a generation into (reasoning, content). Contract as for tool parsers: feed()
    deltas then finish(); concatenated pieces equal parse(full).

    That is: joining every reasoning piece from feed()/finish() gives parse(full)[0] (or ""
    when that is None), and likewise for content, however the text was split into deltas."""

    name: ClassVar[str]
    # Other names the registry knows this format by.
    aliases: ClassVar[tuple[str, ...]] = ()
    # The text that ends the thinking, after which a constraint (tools, response_format)
    # applies; None: the format has no such text, and a constraint holds from the first
    # token (the model then answers without thinking).
    END_TAG: ClassVar[str | None] = THINK_END
    # Control tokens the format is written with: the text must keep them (the server then
    # decodes without skipping special tokens).
    SPECIAL_TOKENS: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._buffer = ""
        self._reasoning = _Channel(strip_trailing=True)
        self._content = _Channel(strip_trailing=False)
        self._done = False
        self._finished = False

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole generation; None when empty. No stream state."""

    @abstractmethod
    def _route(self, final: bool) -> tuple[str, str]:
        """Move what the buffer settles into (raw reasoning, raw content); when `final`,
        settle everything."""

    def feed(self, delta: str) -> tuple[str, str]:
        """Take the next piece of text; return the (reasoning piece, content piece) to send."""
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}: stream already finished")
        self._buffer += delta
        return self._emit(*self._route(final=False))

    def finish(self) -> tuple[str, str]:
        """End of stream: flush whatever is held back."""
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}: stream already finished")
        self._finished = True
        reasoning, content = self._emit(*self._route(final=True))
        return reasoning + self._reasoning.close(), content + self._content.close()

    @property
    def reasoning_done(self) -> bool:
        """Streaming: the end-of-thinking tag was seen."""
        return self._done

    def _emit(self, reasoning: str, content: str) -> tuple[str, str]:
        return self._reasoning.push(reasoning), self._content.push(content)

    def _opening(self, final: bool) -> bool | None:
        """At the start: True when the text opens with `<think>` (after whitespace; both are
        dropped), False when it cannot, None while it still could."""
        s = self._buffer.lstrip()
        if s.startswith(THINK_START):
            self._buffer = s[len(THINK_START):]
            return True
        if (not s or THINK_START.startswith(s)) and not final:
            return None
        return False

    def _reason(self, final: bool) -> tuple[str, bool]:
        """In the reasoning phase: the reasoning released so far, and whether the end tag
        came (then the phase is content and the buffer holds what follows the tag)."""
        reasoning, after = self._split_at_tag(THINK_END, final)
        if after is None:
            return reasoning, False
        self._phase = "content"
        self._done = True
        self._buffer = after
        return reasoning, True

    def _split_at_tag(self, tag: str, final: bool) -> tuple[str, str | None]:
        """Take the buffer up to `tag`: (text before it, None) while the tag has not appeared,
        holding back a partial tag unless `final`; (text before, text after) once it has."""
        i = self._buffer.find(tag)
        if i >= 0:
            before, after = self._buffer[:i], self._buffer[i + len(tag):]
            self._buffer = ""
            return before, after
        keep = 0 if final else partial_suffix_len(self._buffer, tag)
        before = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(before):]
        return before, None


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek R1 (and its distills): the chat template usually opens `<think>` in the prompt,
    so the generation may lack it. Everything up to `</think>` is reasoning (a leading
    `<think>`, after optional whitespace, is dropped); what follows is content. Without
    `</think>` it is all reasoning: the model was cut off while thinking."""

    name: ClassVar[str] = "deepseek_r1"

    def __init__(self) -> None:
        super().__init__()
        self._phase = "start"  # start -> reasoning -> content

    def parse(self, text: str) -> tuple[str | None, str | None]:
        s = text.lstrip()
        body = s[len(THINK_START):] if s.startswith(THINK_START) else text
        i = body.find(THINK_END)
        if i < 0:
            return _finalize(body, True), None
        return _finalize(body[:i], True), _finalize(body[i + len(THINK_END):], False)

    def _route(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._phase == "start":
            if self._opening(final) is None:
                return "", ""
            self._phase = "reasoning"
        if self._phase == "reasoning":
            reasoning, ended = self._reason(final)
            if not ended:
                return reasoning, ""
        content, self._buffer = self._buffer, ""
        return reasoning, content


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen 3: reasoning only when the text holds `<think>`...`</think>`; the text between is
    reasoning, the rest (before `<think>`, usually nothing, and after `</think>`) is content.
    With no `</think>` it is all content, unless it starts with `<think>` (after optional
    whitespace, which is then dropped): then it is all reasoning, cut off mid-thought.

    Streaming: text before a `<think>` is content and streams at once. After a leading `<think>`
    reasoning streams at once too. After a `<think>` in mid text, nothing can be sent until
    `</think>` or the end decides whether it was thinking at all."""

    name: ClassVar[str] = "qwen3"

    def __init__(self) -> None:
        super().__init__()
        # start -> (reasoning | pre) ; pre -> pending ; (reasoning | pending) -> content
        self._phase = "start"

    def parse(self, text: str) -> tuple[str | None, str | None]:
        if text.lstrip().startswith(THINK_START):
            text = text.lstrip()
        i = text.find(THINK_START)
        if i < 0:
            return None, _finalize(text, False)
        j = text.find(THINK_END, i + len(THINK_START))
        if j < 0:
            if i == 0:
                return _finalize(text[len(THINK_START):], True), None
            return None, _finalize(text, False)
        reasoning = text[i + len(THINK_START):j]
        content = text[:i] + text[j + len(THINK_END):]
        return _finalize(reasoning, True), _finalize(content, False)

    def _route(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._phase == "start":
            opened = self._opening(final)
            if opened is None:
                return "", ""
            self._phase = "reasoning" if opened else "pre"
        if self._phase == "reasoning":
            reasoning, ended = self._reason(final)
            if not ended:
                return reasoning, ""
        elif self._phase == "pre":
            content, after = self._split_at_tag(THINK_START, final)
            if after is None:
                return "", content
            self._phase = "pending"
            self._buffer = after
        if self._phase == "pending":
            i = self._buffer.find(THINK_END)
            if i < 0:
                if not final:
                    return "", content
                # Never closed: the mid-text <think> was not thinking, just text.
                content += THINK_START + self._buffer
                self._buffer = ""
                return "", content
            reasoning = self._buffer[:i]
            self._buffer = self._buffer[i + len(THINK_END):]
            self._phase = "content"
            self._done = True
        content += self._buffer
        self._buffer = ""
        return reasoning, content


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony messages (kvserve.entrypoints.server.harmony): the `analysis`
    channel is reasoning; the `final` channel, `commentary` written to the user (preambles)
    and text outside the format are content; a message to a recipient (a tool call) goes to
    the content whole, from `<|start|>` to its terminator, for the harmony tool parser to
    read (the first message's `<|start|>assistant`, which is in the prompt, is written in
    front). Other markup is dropped. Consecutive messages of one kind are joined by a blank
    line.

    Works on text with the markers kept (they are control tokens: the server decodes them
    for this parser). A generation that never opens a final channel has no content; one cut
    off while thinking has only reasoning."""

    name: ClassVar[str] = "gpt-oss"
    aliases: ClassVar[tuple[str, ...]] = ("harmony",)
    END_TAG: ClassVar[str | None] = None
    SPECIAL_TOKENS: ClassVar[tuple[str, ...]] = harmony.MARKERS

    def __init__(self) -> None:
        super().__init__()
        self._scanner = harmony.HarmonyScanner()
        self._route_to: str = "content"  # the current message's: reasoning | content | call
        self._written = {"reasoning": False, "content": False}  # text sent, for separators
        self._separate = False  # the current message follows one of its kind: a blank line

    def parse(self, text: str) -> tuple[str | None, str | None]:
        whole = type(self)()
        whole._buffer = text
        reasoning, content = whole._route(final=True)
        return _finalize(reasoning, True), _finalize(content, False)

    def _route(self, final: bool) -> tuple[str, str]:
        delta, self._buffer = self._buffer, ""
        pieces = self._scanner.feed(delta)
        if final:
            pieces += self._scanner.finish()
        out = {"reasoning": "", "content": ""}
        for piece in pieces:
            if piece.kind == "open":
                assert piece.header is not None
                self._open(piece.header, out)
            elif piece.kind == "body" and self._route_to == "call":
                out["content"] += piece.text
            elif piece.kind == "body" and piece.text:
                text = piece.text
                if self._separate:
                    text, self._separate = "\n\n" + text, False
                out[self._route_to] += text
                self._written[self._route_to] = True
            elif piece.kind == "close" and self._route_to == "call":
                out["content"] += piece.text
            # other markup (headers, terminators, a cut-off header) is not text
        return out["reasoning"], out["content"]

    def _open(self, header: harmony.Header, out: dict[str, str]) -> None:
        if header.recipient is not None:
            self._route_to = "call"
            raw = header.raw
            # The first message's `<|start|>assistant` is in the prompt: written back so
            # that the call reads as a whole message.
            out["content"] += raw if raw.startswith(harmony.START) else \
                harmony.START + "assistant" + raw
            self._done = True
            return
        self._route_to = "reasoning" if header.channel == "analysis" else "content"
        if self._route_to == "content":
            self._done = True
        self._separate = self._written[self._route_to]


# Every parser under its name and its aliases.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    key: cls
    for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser)
    for key in (cls.name, *cls.aliases)
}


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The reasoning parser a chat template's format cannot be read without, used when
    --reasoning-parser is not given: gpt-oss's for harmony, whose every answer is inside
    channel markup. None for other templates (their thinking is optional: a flag asks)."""
    return GptOssReasoningParser.name if harmony.is_harmony_template(chat_template) else None


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None
