"""Streaming detokenization: the ids a request generates, turned into text deltas that never
end inside a UTF-8 character or any part of a stop string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.tokenizer.vocab import BYTE_TOKEN

if TYPE_CHECKING:
    from kvserve.tokenizer.tokenizer import Tokenizer


def _incomplete_utf8_tail(data: bytes) -> bool:
    """Whether `data` ends in the valid beginning of a multi-byte character that more bytes could
    complete. Any other ending (complete, or definitively invalid) decodes the same whatever
    follows, so it is safe to emit."""
    tail = data[-4:]
    for start in range(len(tail) - 1, -1, -1):
        lead = tail[start]
        if lead & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
            break
    else:
        return False
    if 0xC2 <= lead <= 0xDF:
        need, second = 2, (0x80, 0xBF)
    elif 0xE0 <= lead <= 0xEF:
        need = 3
        second = (0xA0, 0xBF) if lead == 0xE0 else (0x80, 0x9F) if lead == 0xED else (0x80, 0xBF)
    elif 0xF0 <= lead <= 0xF4:
        need = 4
        second = (0x90, 0xBF) if lead == 0xF0 else (0x80, 0x8F) if lead == 0xF4 else (0x80, 0xBF)
    else:
        return False
    rest = tail[start + 1 :]
    if len(rest) >= need - 1:
        return False
    return not rest or second[0] <= rest[0] <= second[1]


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas for streaming.

    Invariants:
      * Without stop strings, the deltas of all `add_tokens` calls plus `finish()` concatenate to
        exactly `tokenizer.decode(all_ids, skip_special_tokens)`, however the ids are chunked.
      * A delta never ends inside a UTF-8 character that later tokens could complete; such text is
        held back until it completes, or until `finish()`.
      * Stop strings are searched in the generated text only, across token boundaries. The match
        that completes first wins (earliest end; for equal ends, the earliest start). `text` then
        ends right before it (or after it with include_stop_str_in_output), and nothing after it is
        ever emitted. Text that might be the start of a stop string is held back until it cannot
        be, or until `finish()`.

    Cost per token is O(1) in the output length: decoding works on a short window of recent ids
    (vLLM/TGI's prefix/read offsets) rather than on everything generated so far.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self.stop_reason: str | None = None
        # Ids that reach the decoder: with skip_special_tokens, special ids are dropped up front
        # (decode would drop them anyway) so they never stall or widen the window.
        self._ids: list[int] = []
        # ids[prefix:read] is context already emitted; ids[read:] is not emitted yet.
        self._prefix_offset = 0
        self._read_offset = 0
        self._decoded_chars = 0  # length of all text released by the decode window
        self._held = ""  # released text withheld because it may begin a stop string
        self._chunks: list[str] = []
        self._done = False

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; returns the text that may now be shown ("" after a stop)."""
        if self._done:
            return ""
        tok = self.tokenizer
        skip = self.skip_special_tokens
        self._ids.extend(int(t) for t in token_ids if not (skip and tok.is_special(int(t))))
        return self._emit(self._release(final=False), final=False)

    def finish(self) -> str:
        """End of the request (for any reason but a stop string): return all held-back text."""
        if self._done:
            return ""
        delta = self._emit(self._release(final=True), final=True)
        self._done = True
        return delta

    # -- decode window

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _unfinished(self, end: int) -> bool:
        """Whether the unemitted ids[read:end] stop part-way through a character."""
        ids, read = self._ids, self._read_offset
        kind = self.tokenizer.decode_kind
        if kind == "byte_level":
            tail = b""
            for i in range(end - 1, read - 1, -1):
                tail = self.tokenizer.token_bytes(ids[i]) + tail
                if len(tail) >= 4:
                    break
            return _incomplete_utf8_tail(tail)
        if kind == "byte_fallback":
            # ByteFallback turns a whole run of byte tokens into text at once, and all of it into
            # U+FFFD if the run is invalid, so a run is never split: wait for its end.
            last = self.tokenizer.convert_ids_to_tokens(ids[end - 1])[0]
            return BYTE_TOKEN.fullmatch(last) is not None
        return self._decode(ids[self._prefix_offset : end]).endswith("\ufffd")

    def _release(self, final: bool) -> str:
        """Decode newly complete text: the window ids[prefix:end] minus its emitted prefix."""
        ids = self._ids
        end = len(ids)
        if not final:
            # Stop before an unfinished character, releasing whatever precedes it.
            while end > self._read_offset and self._unfinished(end):
                end -= 1
        if end <= self._read_offset:
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(ids[self._prefix_offset : end])
        if window_text.startswith(prefix_text):
            delta = window_text[len(prefix_text) :]
        else:
            # Decoding the window alone disagreed with its own prefix (a decoder quirk at the
            # window's start); decode everything once to stay exact.
            delta = self._decode(ids[:end])[self._decoded_chars :]
        if not delta and not final:
            # Nothing visible yet (e.g. a lone leading "▁"); keep these ids in the window so the
            # next window's prefix is never empty text.
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._decoded_chars += len(delta)
        return delta

    # -- stop strings

    def _emit(self, released: str, final: bool) -> str:
        if not self._stops:
            return self._push(released)
        # A stop string can only start inside the held text or the new text: anything emitted
        # earlier was not a possible stop-string start (or it would have been held).
        buf = self._held + released
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            end, start, stop = best
            self._held = ""
            self.stop_reason = stop
            self._done = True
            return self._push(buf[: end if self.include_stop_str_in_output else start])
        keep = 0 if final else self._stop_prefix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return self._push(buf[: len(buf) - keep])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = max(len(s) for s in self._stops) - 1
        for n in range(min(longest, len(text)), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0

    def _push(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta
