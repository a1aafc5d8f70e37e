"""The message of a forward pass: one request's share of it (ForwardItem). Its own module so
that the runner and the CUDA graphs that replay its decode steps both read it without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ForwardItem:
    """One request's share of a forward pass: `token_ids` at positions start, start+1, ...,
    their K/V written into the slots of `block_ids` (and, per KV group after the first, of
    `group_tables`: see kv_cache.layout); hidden states are returned for the last
    `num_outputs` of them."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    num_outputs: int
    group_tables: list[list[int]] = field(default_factory=list)
