"""KV-cache events: what the prefix cache stored and dropped, in vLLM's wire layout, so that a
KV-aware router written for vLLM (llm-d's KV-cache indexer, NVIDIA Dynamo) can index kvserve.

The messages are msgspec Structs encoded as MessagePack arrays, fields in declaration order
(vLLM's `vllm/distributed/kv_events.py` layout before its events became maps): an event is
`[tag, field, ...]` with the class name as its tag, a batch is `[ts, [event, ...],
data_parallel_rank]`. Do not reorder, rename or insert fields: a consumer reads them by
position. A trailing field with a default is left out when it holds the default.

Block hashes on the wire are kvserve's own chained hashes (kv_cache.hashing: the same chain
as the prefix cache, cache salt included), cut to their low 64 bits so that they are
MessagePack integers, as vLLM sends its own; a block whose parent is the root has parent
None. Every BlockStored carries its token ids, so a consumer that keys blocks by its own hash
of the tokens can index kvserve without knowing kvserve's hash function.

Media (the `medium` field), named by the role the tier plays, as the routers read them:
- "GPU": the pool attention reads (the runner's KV tensors). It is host RAM on a CPU-only
  machine, and is still "GPU" there: routers score hits in "GPU" as ready to use and treat
  "CPU" as an offload tier a request must first copy from, which is what kvserve's pool and
  host tier are to each other on any machine;
- "CPU": the host-memory tier (kv_cache.tiers), vLLM's name for its CPU offload tier;
- "DISK": the disk tier, SGLang's name for the same.

KVEventLog collects a step's events where the cache changes (block_pool, tier_media); the
engine takes them after the step and hands them to a publisher (engine.kv_events).
"""

from __future__ import annotations

import msgspec

from kvserve.kv_cache.hashing import ROOT_HASH, BlockKey

MEDIUM_POOL = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"

_LOW64 = (1 << 64) - 1


def wire_hash(block_hash: int) -> int:
    """A block hash as events carry it: the low 64 bits, unsigned (a MessagePack uint64)."""
    return block_hash & _LOW64


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to what a cache medium holds; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks now held in `medium`: a chain, each block the parent of the next, the
    first one's parent `parent_block_hash` (None: the root). `token_ids` are the blocks'
    tokens, `block_size` per block, in order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # kvserve serves no adapters: always None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer held in `medium` (evicted, or dropped as unusable)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Everything this publisher announced is gone. kvserve's reset forgets the pool only, so
    the lower tiers' blocks follow it again as BlockStored in the same batch."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events, in the order they happened; `ts` is Unix time."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events of the step under way, in order. Consecutive stores that continue one chain
    in one medium become one BlockStored, and consecutive removals in one medium one
    BlockRemoved, as vLLM sends them, so a long prompt is one event, not one per block."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[Event] = []
        self._chain_tail: int | None = None  # full hash of the last block of a trailing store

    def stored(self, key: BlockKey, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if (isinstance(last, BlockStored) and last.medium == medium
                and self._chain_tail == key.parent_hash):
            last.block_hashes.append(wire_hash(key.block_hash))
            last.token_ids.extend(key.token_ids)
        else:
            parent = None if key.parent_hash == ROOT_HASH else wire_hash(key.parent_hash)
            self._events.append(BlockStored(
                [wire_hash(key.block_hash)], parent, list(key.token_ids), self.block_size,
                None, medium))
        self._chain_tail = key.block_hash

    def removed(self, block_hash: int, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(wire_hash(block_hash))
        else:
            self._events.append(BlockRemoved([wire_hash(block_hash)], medium))
        self._chain_tail = None

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())
        self._chain_tail = None

    def take(self) -> list[Event]:
        """The events since the last call, oldest first; the log starts empty again."""
        out, self._events = self._events, []
        self._chain_tail = None
        return out

    def __len__(self) -> int:
        return len(self._events)
