"""Prompt-lookup drafting: continue a request the way it continued before.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up among
the request's earlier tokens, prompt and output alike; the tokens that followed their most
recent earlier occurrence become the drafts. Summaries, code edits and quoting answers repeat
their input, so this costs no model at all and often hits.
"""

from __future__ import annotations

from kvserve.request import Request
from kvserve.spec_decode.base import Drafter


class _Index:
    """n-gram -> position after its most recent occurrence, for every n in [lo, hi], built
    incrementally (each new token adds hi - lo + 1 entries)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.next_pos: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the table

    def update(self, tokens: list[int]) -> None:
        # An n-gram ending at i is indexed only once a token follows it, so the request's
        # own suffix never matches itself.
        for i in range(self.indexed, len(tokens) - 1):
            for n in range(self.lo, min(self.hi, i + 1) + 1):
                self.next_pos[tuple(tokens[i - n + 1:i + 1])] = i + 1
        self.indexed = max(self.indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            start = self.next_pos.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class NgramDrafter(Drafter):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self._index: dict[str, _Index] = {}

    def propose(self, requests: list[Request], num_drafts: list[int]) -> None:
        for req, k in zip(requests, num_drafts, strict=True):
            index = self._index.get(req.request_id)
            if index is None:
                index = self._index[req.request_id] = _Index(self.lo, self.hi)
            index.update(req.all_token_ids)
            req.draft_token_ids = index.lookup(req.all_token_ids, k)
            req.draft_probs = None

    def forget(self, req: Request) -> None:
        self._index.pop(req.request_id, None)
