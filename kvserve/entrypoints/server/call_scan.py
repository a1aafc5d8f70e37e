"""Read one JSON tool call, `{"name": N, "arguments": {...}}`, as its text arrives, so that a
stream can send the arguments piece by piece before the call ends.

The arguments a call reports are the model's own text of its arguments object (valid JSON,
since the whole call decodes), not a re-serialization: only the model's text can be streamed
before it is complete, and a stream and a whole parse must report the same string.
"""

from __future__ import annotations

import json
from enum import Enum

_WS = " \t\r\n"
# What JSON allows outside strings: anything else (a closing tag, a fence) ends the call broken.
_JSON_OUTSIDE_STRINGS = frozenset(_WS + "{}[],:0123456789+-.eE" + "truefalsn")
# A head longer than this without a decision is not the form (a runaway name string).
_HEAD_LIMIT = 512


class Scan(Enum):
    HEAD = "head"  # not yet known whether the text opens such a call
    OTHER = "other"  # it does not (another shape, key order, or an undeclared name)
    ARGS = "args"  # inside the arguments object: `name` is known, pieces are streaming
    REST = "rest"  # after the arguments, reading the rest of the call object
    DONE = "done"  # the call object closed at `end` and decodes as JSON
    BROKEN = "broken"  # the call object closed but does not decode


class _Partial(Exception):
    """The head's text ends before the head does."""


class _Mismatch(Exception):
    """The head's text is not this form."""


class CallScan:
    """One call object, fed in pieces. Leading whitespace is skipped; the call's head must be
    `{"name": "<declared name>", "<key>": {` (whitespace anywhere JSON allows it), with <key>
    one of `keys`. Invariants: `status` only moves forward (HEAD -> OTHER, or HEAD -> ARGS ->
    REST -> DONE | BROKEN); the pieces feed() returns concatenate to `arguments`; once DONE,
    `arguments` is the arguments object's text, `end` the offset just past the call object in
    the text fed, and json.loads of the call's text gives a dict naming `name`. BROKEN: the
    object closed but does not decode, or a character JSON does not allow outside strings
    (a closing tag's `<`, a fence's backtick) came first; `end` is where the call's text
    stops."""

    def __init__(self, keys: tuple[str, ...], tool_names: list[str] | None) -> None:
        self.keys = keys
        self.tool_names = tool_names
        self.status = Scan.HEAD
        self.name: str | None = None
        self.arguments = ""
        self.end = 0
        self._text = ""
        self._start = 0  # offset of the call object's opening brace
        self._pos = 0  # next character to scan (ARGS and REST)
        self._depth = 0  # brace and bracket depth, the call object being 1
        self._in_string = False
        self._escape = False

    def feed(self, piece: str) -> str:
        """Take the next text; return the arguments text it completes (may be empty)."""
        self._text += piece
        if self.status is Scan.HEAD:
            self._read_head()
        if self.status not in (Scan.ARGS, Scan.REST):
            return ""
        return self._scan()

    def _read_head(self) -> None:
        try:
            name, args_at = self._head()
        except _Partial:
            if len(self._text) - self._start > _HEAD_LIMIT:
                self.status = Scan.OTHER
            return
        except _Mismatch:
            self.status = Scan.OTHER
            return
        if self.tool_names is not None and name not in self.tool_names:
            self.status = Scan.OTHER
            return
        self.name, self.status = name, Scan.ARGS
        self._pos, self._depth = args_at, 1

    def _head(self) -> tuple[str, int]:
        """The name and the offset of the arguments' opening brace; _Partial or _Mismatch."""
        t = self._text

        def ws(i: int) -> int:
            while i < len(t) and t[i] in _WS:
                i += 1
            return i

        def literal(i: int, s: str) -> int:
            i = ws(i)
            if t.startswith(s, i):
                return i + len(s)
            if s.startswith(t[i:]):
                raise _Partial
            raise _Mismatch

        def string(i: int) -> tuple[str, int]:
            i = ws(i)
            if i >= len(t):
                raise _Partial
            if t[i] != '"':
                raise _Mismatch
            j = i + 1
            while j < len(t):
                if t[j] == "\\":
                    j += 2
                elif t[j] == '"':
                    try:
                        return json.loads(t[i:j + 1]), j + 1
                    except json.JSONDecodeError:
                        raise _Mismatch from None
                else:
                    j += 1
            raise _Partial

        self._start = ws(0)
        i = literal(0, "{")
        key, i = string(i)
        if key != "name":
            raise _Mismatch
        i = literal(i, ":")
        name, i = string(i)
        i = literal(i, ",")
        key, i = string(i)
        if key not in self.keys or not name:
            raise _Mismatch
        i = literal(i, ":")
        i = literal(i, "{")
        return name, i - 1

    def _scan(self) -> str:
        """Scan from _pos: strings and nesting, to find where the arguments and the call end."""
        t = self._text
        args_from = self._pos if self.status is Scan.ARGS else None
        i = self._pos
        while i < len(t):
            c = t[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                continue
            if c == '"':
                self._in_string = True
            elif c not in _JSON_OUTSIDE_STRINGS:
                self.status, self.end = Scan.BROKEN, i - 1
                self._pos = i - 1
                piece = t[args_from:i - 1] if args_from is not None else ""
                self.arguments += piece
                return piece
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and self.status is Scan.ARGS:
                    self.status = Scan.REST
                    assert args_from is not None
                    piece = t[args_from:i]
                    self.arguments += piece
                    self._pos = i
                    return piece + self._scan()
                if self._depth == 0:
                    self._close(i)
                    return ""
        self._pos = i
        if args_from is None:
            return ""
        piece = t[args_from:i]
        self.arguments += piece
        return piece

    def _close(self, end: int) -> None:
        self.end = end
        try:
            obj = json.loads(self._text[self._start:end])
        except json.JSONDecodeError:
            self.status = Scan.BROKEN
            return
        ok = isinstance(obj, dict) and obj.get("name") == self.name and \
            isinstance(json.loads(self.arguments), dict)
        self.status = Scan.DONE if ok else Scan.BROKEN


def scan_whole(text: str, keys: tuple[str, ...], tool_names: list[str] | None
               ) -> tuple[str, str] | None:
    """(name, arguments text) when `text` is exactly one call in the streamed form, with
    whitespace around; None otherwise."""
    scan = CallScan(keys, tool_names)
    scan.feed(text)
    if scan.status is not Scan.DONE or text[scan.end:].strip():
        return None
    assert scan.name is not None
    return scan.name, scan.arguments
