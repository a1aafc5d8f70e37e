"""OpenAI's harmony format (gpt-oss) read as it streams: the generation is a run of messages,
each a header, `<|message|>` and a body, ended by `<|end|>` (more follows), `<|return|>` (the
answer is done), `<|call|>` (a tool call waits for its result) or the next `<|start|>`.

    <|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>
    answer<|return|>

The chat template's generation prompt ends with `<|start|>assistant`, so the first message's
header has no `<|start|>` and no role: it is `<|channel|>analysis`, or ` to=functions.f
<|channel|>commentary <|constrain|>json` for a call (`to=` may also follow the channel, and
`<|constrain|>` may be missing or written as a bare word).

The markers are control tokens: the server decodes them (skip_special_tokens off) for the
reasoning and tool parsers, which both read the text through `HarmonyScanner`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
# Every marker, as a parser's SPECIAL_TOKENS: the text must keep them.
MARKERS: tuple[str, ...] = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
# What ends a message's body. START too: a model (or a decode that dropped `<|end|>`) may
# begin the next message without closing this one.
_TERMINATORS = (END, RETURN, CALL, START)
# How the first message's header may begin (its `<|start|>assistant` is in the prompt).
_FIRST_HEADER_STARTS = (CHANNEL, CONSTRAIN, " to=", "to=")
# A header is short and on one line; text that is neither was never a header (a model that
# answers without the format), so the wait for `<|message|>` is bounded.
HEADER_LIMIT = 256
# Tool calls go to the `functions` namespace (the template's `namespace functions`);
# recipients in other namespaces (built-in browser or python tools) are not client calls.
FUNCTIONS = "functions."



def is_harmony_template(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony (its channel and call markers)."""
    t = chat_template or ""
    return CHANNEL in t and MESSAGE in t and CALL in t


_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


@dataclass(frozen=True)
class Header:
    """A message's header: its channel (`analysis`, `commentary`, `final`; None when it
    names none), its recipient (`functions.get_weather`; None for a message to the user)
    and the raw text that opened it, markers included ("" for a message with no header:
    text written outside the format)."""

    channel: str | None
    recipient: str | None
    raw: str

    @property
    def function(self) -> str | None:
        """The function a call message calls: its recipient less `functions.`; None when
        it is not a call of a client function."""
        r = self.recipient
        if r is None or not r.startswith(FUNCTIONS) or len(r) == len(FUNCTIONS):
            return None
        return r[len(FUNCTIONS):]


def parse_header(text: str, raw: str) -> Header:
    """The header whose text (between the message's start and `<|message|>`) is `text`."""
    channel = _CHANNEL_NAME.search(text)
    recipient = _RECIPIENT.search(text)
    return Header(channel.group(1) if channel else None,
                  recipient.group(1) if recipient else None, raw)


@dataclass(frozen=True)
class Piece:
    """One step of the scan. Each message gives one `open` (its header; `text` is the raw
    markup that opened it), its `body` pieces, then one `close` (`text`: the raw terminator,
    "" when the next `<|start|>` or the end of the text closed it). `markup` is raw text that
    belongs to no message (a header cut off at the end). Concatenating every piece's text
    gives back the scanned text, less nothing: each character is in exactly one piece."""

    kind: Literal["open", "body", "close", "markup"]
    text: str
    header: Header | None = None


def _partial_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(text), len(tag) - 1), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class HarmonyScanner:
    """Splits harmony text into messages as it arrives, however it is cut into deltas: the
    pieces of feed() calls and finish() depend only on the whole text (a marker split across
    deltas is held back until it is complete or cannot be).

    Text that does not open a message the harmony way (at the start, or after a message
    ended, anything but a header) is a message with no header and no channel, so a model
    that answers in plain text is read as one plain message."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state: Literal["start", "header", "body", "done"] = "start"
        self._first = True  # no message has begun yet
        self._opener = ""  # the `<|start|>` the header being read began with, if any
        self._header: Header | None = None
        self._finished = False

    def feed(self, delta: str) -> list[Piece]:
        """The pieces `delta` settles."""
        if self._finished:
            raise RuntimeError("HarmonyScanner: already finished")
        self._buffer += delta
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        """End of text: everything held back, and the last message's close."""
        if self._finished:
            raise RuntimeError("HarmonyScanner: already finished")
        self._finished = True
        return self._run(final=True)

    def _run(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while self._step(final, out):
            pass
        return out

    def _step(self, final: bool, out: list[Piece]) -> bool:
        """Advance one state; False when it needs more text (or the text is done)."""
        if self._state == "start":
            return self._at_start(final, out)
        if self._state == "header":
            return self._in_header(final, out)
        if self._state == "body":
            return self._in_body(final, out)
        return False

    def _plain(self, out: list[Piece]) -> None:
        """Begin a message with no header: the text from here is its body."""
        self._header = Header(None, None, "")
        out.append(Piece("open", "", self._header))
        self._state = "body"

    def _at_start(self, final: bool, out: list[Piece]) -> bool:
        b = self._buffer
        if not b:
            return False
        first = _FIRST_HEADER_STARTS if self._first else ()
        if b.startswith(START):
            self._buffer, self._opener = b[len(START):], START
        elif any(b.startswith(s) for s in first):
            self._opener = ""
        elif not final and any(s.startswith(b) for s in (START, *first)):
            return False  # the way a header begins may still be arriving
        else:
            self._first = False
            self._plain(out)
            return True
        self._first = False
        self._state = "header"
        return True

    def _in_header(self, final: bool, out: list[Piece]) -> bool:
        b = self._buffer
        i = b.find(MESSAGE)
        region = b if i < 0 else b[:i]
        broken = ("\n" in region or any(m in region for m in (START, END, RETURN, CALL))
                  or (i < 0 and len(b) > HEADER_LIMIT + len(MESSAGE)) or i > HEADER_LIMIT)
        if broken:
            # Never a header: the text from the message's start on is plain text.
            opener, self._opener = self._opener, ""
            self._plain(out)
            if opener:
                out.append(Piece("body", opener, self._header))
            return True
        if i >= 0:
            raw = self._opener + b[:i] + MESSAGE
            self._header = parse_header(b[:i], raw)
            out.append(Piece("open", raw, self._header))
            self._buffer, self._opener = b[i + len(MESSAGE):], ""
            self._state = "body"
            return True
        if not final:
            return False
        # A header cut off at the end: markup when it began as harmony, else plain text.
        if self._opener or "<|" in b:
            out.append(Piece("markup", self._opener + b))
        else:
            self._plain(out)
            out.append(Piece("body", b, self._header))
            out.append(Piece("close", "", self._header))
        self._buffer, self._opener, self._state = "", "", "done"
        return False

    def _in_body(self, final: bool, out: list[Piece]) -> bool:
        b = self._buffer
        found = [(j, m) for m in _TERMINATORS if (j := b.find(m)) >= 0]
        if found:
            j, marker = min(found)
            if j:
                out.append(Piece("body", b[:j], self._header))
            if marker == START:  # the next message's opener: read at the start state
                out.append(Piece("close", "", self._header))
                self._buffer = b[j:]
            else:
                out.append(Piece("close", marker, self._header))
                self._buffer = b[j + len(marker):]
            self._header, self._state = None, "start"
            return True
        keep = 0 if final else _partial_len(b, _TERMINATORS)
        if len(b) > keep:
            out.append(Piece("body", b[:len(b) - keep], self._header))
            self._buffer = b[len(b) - keep:]
        if final:
            out.append(Piece("close", "", self._header))
            self._header, self._state = None, "done"
        return False
