"""Block pool: the bookkeeping half of the paged KV cache (the tensors live in the runner).

Invariants, checked by `check_integrity()`:
- every block is either in use (ref_cnt > 0) or in the free queue (ref_cnt == 0), never both;
- a block with a hash is registered under that hash, and vice versa;
- ref counts are never negative.

A freed block keeps its hash and K/V: it waits in the LRU free queue and can be revived by a
prefix-cache hit until it is handed out again, which is when its hash is forgotten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from kvserve.kv_cache.events import MEDIUM_POOL, KVEventLog
from kvserve.kv_cache.hashing import BlockKey


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Prefix-cache identity of a full block; None while the block is partial or unhashed.
    key: BlockKey | None = None
    # Intrusive links of the free queue, so a cache hit removes a block in O(1).
    prev: KVBlock | None = None
    next: KVBlock | None = None

    def __repr__(self) -> str:
        h = None if self.key is None else f"{self.key.block_hash:x}"[:8]
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class _Blocks(Sequence[KVBlock]):
    """A pool's blocks by id, each made on first use: the pool of a small model under a
    large memory budget has hundreds of thousands of blocks (a 1 GiB budget for the tests'
    tiny models: 131k), and making them all up front took ~0.4 s of each engine start and
    left as many objects for the garbage collector to walk."""

    def __init__(self, n: int) -> None:
        self._made: list[KVBlock | None] = [None] * n

    def __len__(self) -> int:
        return len(self._made)

    @overload
    def __getitem__(self, i: int) -> KVBlock: ...

    @overload
    def __getitem__(self, i: slice) -> list[KVBlock]: ...

    def __getitem__(self, i: int | slice) -> KVBlock | list[KVBlock]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        block = self._made[i]
        if block is None:
            block = self._made[i] = KVBlock(range(len(self))[i])
        return block

    def made(self) -> Iterator[KVBlock]:
        """The blocks made so far; every other one is fresh: free, unhashed, unheld."""
        return (b for b in self._made if b is not None)


class FreeBlockQueue:
    """The free blocks, the head evicted first (least recently freed): the blocks never
    handed out yet, in id order (they sit ahead of every freed block, as all blocks did at
    the start), then a doubly linked list of freed blocks."""

    def __init__(self, blocks: _Blocks) -> None:
        self._blocks = blocks
        self._fresh = 0  # blocks[_fresh:] have never been handed out
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._linked = 0

    @property
    def num_free(self) -> int:
        return len(self._blocks) - self._fresh + self._linked

    @property
    def fresh(self) -> range:
        """The ids of the blocks never handed out."""
        return range(self._fresh, len(self._blocks))

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self._linked += 1

    def remove(self, block: KVBlock) -> None:
        """Take a freed block out (a prefix-cache hit revives it); never a fresh one, which
        holds no K/V to hit."""
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._linked -= 1

    def popleft(self) -> KVBlock:
        if self._fresh < len(self._blocks):
            self._fresh += 1
            return self._blocks[self._fresh - 1]
        first = self._head.next
        if first is self._tail or first is None:
            raise RuntimeError("no free KV blocks")
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[KVBlock]:
        for i in self.fresh:
            yield self._blocks[i]
        yield from self.freed()

    def freed(self) -> Iterator[KVBlock]:
        """The freed blocks, least recently freed first."""
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """`on_evict(blocks)` is called with hashed blocks about to be handed out again, while
    their K/V are still intact (a lower cache tier copies them there). With `events`, every
    block that enters the prefix cache is logged as stored and every one that leaves it as
    removed (medium "GPU", see kv_cache.events), and a reset as all cleared."""

    def __init__(self, num_blocks: int,
                 on_evict: Callable[[list[KVBlock]], None] | None = None,
                 events: KVEventLog | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = _Blocks(num_blocks)
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.on_evict = on_evict
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including cached blocks nobody uses)."""
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = [self.free_queue.popleft() for _ in range(n)]
        evicted = [b for b in out if b.key is not None]
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        for block in out:
            self._forget(block)
            block.ref_cnt = 1
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; pass a request's blocks tail first so tails are evicted first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(self, key: BlockKey) -> KVBlock | None:
        """The cached block holding `key`, verified against the stored identity (parent hash
        and tokens), so that a hash collision can never serve another prompt's K/V."""
        block = self.cached.get(key.block_hash)
        return block if block is not None and block.key == key else None

    def cache(self, block: KVBlock, key: BlockKey) -> None:
        if block.key is not None:
            return
        if key.block_hash in self.cached:
            # Another block already holds this content (e.g. two requests computed the same
            # prefix in one step); keep the first, this one stays private and unhashed.
            return
        block.key = key
        self.cached[key.block_hash] = block
        if self.events is not None:
            self.events.stored(key, MEDIUM_POOL)

    def uncache(self, block: KVBlock) -> None:
        """Take a block out of the prefix cache (its contents are not what its key says)."""
        self._forget(block)

    def _forget(self, block: KVBlock) -> None:
        if block.key is not None:
            del self.cached[block.key.block_hash]
            if self.events is not None:
                self.events.removed(block.key.block_hash, MEDIUM_POOL)
            block.key = None

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.key = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()

    def check_integrity(self) -> None:
        """The invariants of the module docstring, over the blocks made so far (a fresh one is
        free, unhashed and unlinked by construction)."""
        q = self.free_queue
        freed = [b.block_id for b in q.freed()]
        assert len(freed) == q.num_free - len(q.fresh), "free count out of sync"
        assert len(set(freed)) == len(freed), "a block is in the free queue twice"
        free_set = set(freed)
        assert not any(i in q.fresh for i in free_set), "a fresh block was freed"
        used = 0
        for b in self.blocks.made():
            assert b.ref_cnt >= 0, f"negative ref count on {b}"
            fresh = b.block_id in q.fresh
            assert (b.ref_cnt == 0) == (fresh or b.block_id in free_set), \
                f"{b} free/used mismatch"
            assert not fresh or (b.key is None and b.prev is None), f"fresh {b} was used"
            used += b.ref_cnt > 0
            if b.key is not None:
                assert self.cached.get(b.key.block_hash) is b, f"{b} hashed but not registered"
        for h, b in self.cached.items():
            assert b.key is not None and b.key.block_hash == h, f"entry {h:x} points at {b}"
        assert used + q.num_free == self.num_blocks, "free + used != total"
