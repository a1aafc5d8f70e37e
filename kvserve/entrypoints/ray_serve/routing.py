"""Prefix-aware replica choice keyed by kvserve's block hashes: which replicas are believed to
hold which blocks, and the ranking of replicas for one request. No I/O and no ray: the Ray
Serve request router (request_router.KVServeRequestRouter) holds one PrefixTable and calls
`rank`; the tests call both directly.

The policy is the one the retired `kvserve router` had, on the prefix cache's own keys
instead of pieces of text:
- a request whose leading blocks a replica holds goes there (replicas ranked by how many
  leading block hashes each holds, best first), unless that replica has more than
  `balance_slack` requests in flight beyond the least loaded one (16: a hit saves the
  prefix's prefill, and a replica takes up to --max-num-seqs, 64, requests into one step, so
  16 more in flight than the least loaded mostly join its running batch; the old router's 4
  sent a burst's requests away from their prefix: on the shared-prefix workload at c=32, 51%
  of prompt tokens hit against 67% at 16 and 68% on one replica, docs/results-history.md);
- a weak match (fewer than `min_match_blocks` leading blocks, 64 tokens at the default block
  size: about the old router's 256-character piece, and more than a chat template's header,
  which every chat shares) counts as none;
- a new prefix, or a busy owner, goes to a least loaded replica; ties are split by the
  prefix's first hash, so new prefixes spread out and one prefix's concurrent requests agree.

What a replica holds is learned from what was routed where, not read back from the replicas
(their KV events are for routers outside Ray): each routed request's hashes are recorded for
its replica. The table is bounded (`capacity` hashes, least recently used forgotten first),
as the replicas' caches are, and a replica that leaves is forgotten."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutePolicy:
    balance_slack: int = 16  # in-flight requests an owner may have beyond the least loaded
    min_match_blocks: int = 4  # leading blocks that make a match (or all of a shorter key)
    capacity: int = 100_000  # block hashes remembered (LRU)

    def __post_init__(self) -> None:
        if self.balance_slack < 0 or self.min_match_blocks < 1 or self.capacity < 1:
            raise ValueError("balance_slack must be >= 0, min_match_blocks and capacity >= 1")


class PrefixTable:
    """block hash -> the replicas believed to hold that block, for at most `capacity`
    hashes, least recently used forgotten first."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._holders: OrderedDict[int, dict[str, None]] = OrderedDict()  # ordered sets

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, hashes: Sequence[int], replica: str) -> None:
        """`replica` was sent a prompt with these leading block hashes: it holds them now."""
        holders = self._holders
        for h in hashes:
            holders.setdefault(h, {})[replica] = None
            holders.move_to_end(h)
        while len(holders) > self.capacity:
            holders.popitem(last=False)

    def matched(self, hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """How many leading block hashes each of `replicas` holds (0 for none); the hashes
        read count as used."""
        out = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for i, h in enumerate(hashes):
            held = self._holders.get(h)
            if not held:
                break
            self._holders.move_to_end(h)
            alive.intersection_update(held)
            if not alive:
                break
            for r in alive:
                out[r] = i + 1
        return out

    def forget(self, replica: str) -> None:
        """A replica left: it holds nothing (blocks no one holds are dropped)."""
        for h in [h for h, held in self._holders.items() if replica in held]:
            held = self._holders[h]
            del held[replica]
            if not held:
                del self._holders[h]


def rank(table: PrefixTable, policy: RoutePolicy, hashes: Sequence[int],
         load: Mapping[str, int]) -> tuple[list[list[str]], str]:
    """(ranks of the replicas in `load`, best first; why) for a request whose prompt has the
    leading block hashes `hashes` (empty: no key), with `load` the requests in flight at each
    candidate replica. The caller sends the request to the least loaded replica of the first
    rank that has room."""
    if not load:
        return [], "no replica"
    least = min(load.values())
    by_load = sorted(load, key=lambda r: (load[r], r))
    idle = [r for r in by_load if load[r] == least]
    if not hashes:
        random.shuffle(idle)  # nothing to split ties by
        return [idle[:1], by_load], "no key"
    matched = table.matched(hashes, by_load)
    best = max(matched.values())
    if best >= min(policy.min_match_blocks, len(hashes)):
        owners = [r for r in by_load if matched[r] == best]
        if load[owners[0]] <= least + policy.balance_slack:
            ranks = [[r for r in by_load if matched[r] == n]
                     for n in sorted({n for n in matched.values() if n}, reverse=True)]
            return [*ranks, by_load], "prefix hit"
        why = "prefix owner busy"
    else:
        why = "new prefix" if best == 0 else "weak match"
    first = idle[hashes[0] % len(idle)]
    return [[first], by_load], why
