"""KV cache manager: which blocks each request holds, and prefix reuse of full blocks.

A full block is identified by a chained hash H(parent hash, its token ids), so a block's hash
covers the whole prefix before it. Blocks are registered in the cache when they are
allocated for the step that computes them: a second request scheduled later in the same step
may reuse them, which is safe because every layer writes the step's K/V before any attention
reads it. The last token of a request is never served from the cache, since its logits are
needed.
"""

from __future__ import annotations

from kvserve.kv_cache.block_pool import BlockPool, KVBlock
from kvserve.request import Request

ROOT_HASH = 0x6B7673  # parent of the first block; a constant so hashes are stable across runs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # per request: leading blocks already hashed
        self._hashes: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(req.all_token_ids[i * bs:(i + 1) * bs])

    def block_hashes(self, req: Request) -> list[int]:
        """Chained hashes of the request's full blocks, extended as tokens arrive."""
        hashes = self._hashes.setdefault(req.request_id, [])
        for i in range(len(hashes), req.num_tokens // self.block_size):
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash((parent, self._block_tokens(req, i))))
        return hashes

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The longest run of cached blocks that starts the request's tokens."""
        if not self.enable_prefix_caching or req.num_computed_tokens:
            return []
        hashes = self.block_hashes(req)
        hits: list[KVBlock] = []
        parent = ROOT_HASH
        for i in range((req.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(hashes[i], parent, self._block_tokens(req, i))
            if block is None:
                break
            hits.append(block)
            parent = hashes[i]
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Give `req` room for `num_new_tokens` more tokens after its computed ones (which
        include `computed_blocks`, prefix hits not yet attached). False, with nothing changed,
        when the pool cannot supply the blocks."""
        computed_blocks = computed_blocks or []
        blocks = self._blocks.setdefault(req.request_id, [])
        assert len(blocks) * self.block_size >= req.num_computed_tokens
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(need, 0) + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed_blocks)
        new = computed_blocks + (self.pool.allocate(need) if need > 0 else [])
        blocks.extend(new)
        req.block_ids.extend(b.block_id for b in new)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, min(total, req.num_tokens) // self.block_size)
        return True

    def _cache_full_blocks(self, req: Request, num_full: int) -> None:
        start = self._num_cached.get(req.request_id, 0)
        if num_full <= start:
            return
        blocks, hashes = self._blocks[req.request_id], self.block_hashes(req)
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else ROOT_HASH
            self.pool.cache(blocks[i], hashes[i], parent, self._block_tokens(req, i))
        self._num_cached[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Return every block of `req` to the pool, tail first so tails are evicted first."""
        blocks = self._blocks.pop(req.request_id, [])
        self.pool.free(reversed(blocks))
        self._num_cached.pop(req.request_id, None)
        req.block_ids.clear()

    def forget(self, req: Request) -> None:
        """Drop per-request hash state once the request is gone for good."""
        self._hashes.pop(req.request_id, None)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert held.get(b.block_id, 0) == b.ref_cnt, (
                f"{b}: ref count {b.ref_cnt} but held by {held.get(b.block_id, 0)} requests")
