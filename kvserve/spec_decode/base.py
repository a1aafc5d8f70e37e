"""The drafter contract of speculative decoding."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

import torch

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request


class Drafter(ABC):
    """Proposes tokens that likely follow a request's verified tokens.

    The engine calls `propose` after each step for the requests that will decode in the
    next one, each with how many drafts it may have. A drafter sets `draft_token_ids` (at most
    that many; fewer or none is always allowed) and, when it sampled them from a distribution
    q, `draft_probs` [len(drafts), V] holding q for each position, which exact rejection
    sampling needs; without it the drafts count as one-hot. The target verifies the drafts in
    its next step, so a drafter affects speed only, never the output distribution.
    """

    # Set when the drafter reads the target's final hidden state of the newest token; the
    # model runner then keeps it and the engine hands it over through `take_hidden`.
    needs_hidden: bool = False


    # Draft steps as the drafter times them, (tokens the step ran, seconds): a drafter that
    # runs a model step by step logs its decode-like steps, the first included (it catches
    # up on the newest verified token), and the coordinator fits a step's cost per token to
    # them; a long catch-up after a pause is left out, paid once and not per draft. None:
    # the coordinator times whole proposals instead.
    draft_steps: deque[tuple[int, float]] | None = None

    @abstractmethod
    def propose(self, requests: list[Request], num_drafts: list[int]) -> None:
        """Fill `draft_token_ids` (and optionally `draft_probs`) of each request."""

    def catchup_tokens(self, req: Request) -> int:
        """Tokens the drafter must run for `req` before its next draft, besides the newest
        (a draft model that paused while tokens were verified); its first draft pays them."""
        del req  # a drafter without state per token has none
        return 0

    def kv_bytes_per_token(self) -> int:
        """Bytes of the drafter's own KV cache per target token slot (0: none)."""
        return 0

    def allocate(self, kv: KVCacheManager) -> None:
        """Allocate the drafter's own state for the target's KV pool, once it exists."""
        del kv  # a drafter without state per token slot has nothing to allocate

    def take_hidden(self, req: Request, hidden: torch.Tensor) -> None:
        """The target's final hidden state at the row that sampled `req`'s newest token
        (only called when `needs_hidden`)."""
        del req, hidden

    def forget(self, req: Request) -> None:
        """Drop per-request state of a finished request."""
        del req  # a drafter without state per request has nothing to drop
