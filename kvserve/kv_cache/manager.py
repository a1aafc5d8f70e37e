"""KV cache manager: which blocks each request holds, and prefix reuse of full blocks.

A full block is identified by a chained hash H(parent hash, its token ids, extra keys), so a
block's hash covers the whole prefix before it; a request's cache salt enters the first
block's hash, so salted prompts only ever share blocks with the same salt. Blocks are
registered in the cache when they are allocated for the step that computes them: a second
request scheduled later in the same step may reuse them, which is safe because every layer
writes the step's K/V before any attention reads it. The last token of a request is never
served from the cache, since its logits are needed.

With lower tiers (`store`), a hashed block evicted from the pool is copied down first, and a
prefix hit found only in a lower tier is copied back into a fresh block at admission.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from kvserve.kv_cache.block_pool import BlockPool, KVBlock
from kvserve.kv_cache.hashing import ROOT_HASH, BlockKey, hash_block
from kvserve.kv_cache.tiers import TieredKVStore
from kvserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Loaded:
    """A prefix block found in a lower tier, already fetched (and verified) into memory."""

    key: BlockKey
    payload: torch.Tensor
    tier: str


@dataclass
class PrefixHit:
    """The longest cached run at the start of a request, in order: pool blocks to share, or
    blocks to load from a lower tier."""

    entries: list[KVBlock | Loaded] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.entries)

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        """Tokens of the hit per tier it came from ("device" is the fast pool)."""
        out: dict[str, int] = {}
        for e in self.entries:
            tier = "device" if isinstance(e, KVBlock) else e.tier
            out[tier] = out.get(tier, 0) + block_size
        return out


@dataclass
class PrefixCacheStats:
    """Tokens looked up and tokens served, per tier ("device" is the fast pool)."""

    queries: int = 0
    hits: Counter = field(default_factory=Counter)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 store: TieredKVStore | None = None) -> None:
        if store is not None and not enable_prefix_caching:
            raise ValueError("KV cache tiers need prefix caching")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.store = store
        self.pool = BlockPool(num_blocks, self._save_evicted if store is not None else None)
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # per request: leading blocks already hashed
        self._hashes: dict[str, list[int]] = {}
        self._computed_this_step: list[KVBlock] = []  # write-through candidates

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
            if hashes:
                hashes.append(hash_block(hashes[-1], self._block_tokens(req, i)))
            else:
                salt = (req.cache_salt or "").encode()
                hashes.append(hash_block(ROOT_HASH, self._block_tokens(req, i), salt))
        return hashes

    def _key(self, req: Request, i: int) -> BlockKey:
        hashes = self.block_hashes(req)
        return BlockKey(hashes[i], hashes[i - 1] if i else ROOT_HASH, self._block_tokens(req, i))

    def get_computed_blocks(self, req: Request) -> PrefixHit:
        """The longest run of cached blocks that starts the request's tokens, from the pool or
        (fetched now) from a lower tier. Call only for a request with nothing computed."""
        hit = PrefixHit()
        if not self.enable_prefix_caching or req.num_computed_tokens:
            return hit
        for i in range((req.num_tokens - 1) // self.block_size):
            key = self._key(req, i)
            block = self.pool.lookup(key)
            if block is not None:
                hit.entries.append(block)
                continue
            found = self.store.fetch(key) if self.store is not None else None
            if found is None:
                break
            hit.entries.append(Loaded(key, *found))
        return hit

    def num_pool_hit_tokens(self, req: Request) -> int:
        """Tokens at the start of `req` whose K/V the fast pool holds now: a cheap look for
        the scheduler's ordering that fetches nothing from lower tiers and changes nothing."""
        if not self.enable_prefix_caching or req.num_computed_tokens:
            return 0
        n = 0
        while n < (req.num_tokens - 1) // self.block_size and self.pool.lookup(self._key(req, n)):
            n += 1
        return n * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       hit: PrefixHit | None = None) -> bool:
        """Give `req` room for `num_new_tokens` more tokens after its computed ones (which
        include `hit`, prefix blocks not yet attached). False, with nothing changed, when
        the pool cannot supply the blocks."""
        entries = hit.entries if hit is not None else []
        blocks = self._blocks.setdefault(req.request_id, [])
        assert len(blocks) * self.block_size >= req.num_computed_tokens
        shared = [e for e in entries if isinstance(e, KVBlock)]
        loads = [e for e in entries if isinstance(e, Loaded)]
        total = req.num_computed_tokens + len(entries) * self.block_size + num_new_tokens
        need = max(cdiv(total, self.block_size) - len(blocks) - len(entries), 0)
        revived = sum(1 for b in shared if b.ref_cnt == 0)
        if need + len(loads) + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(shared)  # before allocating, so a hit is never the one evicted
        fresh = self.pool.allocate(len(loads) + need)
        if loads:
            assert self.store is not None
            targets = fresh[:len(loads)]
            self.store.write_blocks([b.block_id for b in targets],
                                    torch.stack([e.payload for e in loads]))
            for block, e in zip(targets, loads, strict=True):
                self.pool.cache(block, e.key)
        it = iter(fresh)
        ordered = [e if isinstance(e, KVBlock) else next(it) for e in entries]
        new = ordered + list(it)
        blocks.extend(new)
        req.block_ids.extend(b.block_id for b in new)
        if entries:
            self._num_cached[req.request_id] = len(entries)
        if hit is not None:
            self._record(req, hit)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, min(total, req.num_tokens) // self.block_size)
        return True

    def _record(self, req: Request, hit: PrefixHit) -> None:
        self.stats.queries += req.num_tokens
        for e in hit.entries:
            self.stats.hits["device" if isinstance(e, KVBlock) else e.tier] += self.block_size
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.num_blocks * self.block_size

    def _cache_full_blocks(self, req: Request, num_full: int) -> None:
        start = self._num_cached.get(req.request_id, 0)
        if num_full <= start:
            return
        blocks = self._blocks[req.request_id]
        write_through = self.store is not None and self.store.write_policy == "write-through"
        for i in range(start, num_full):
            key = self._key(req, i)
            self.pool.cache(blocks[i], key)
            if write_through and blocks[i].key == key:
                self._computed_this_step.append(blocks[i])
        self._num_cached[req.request_id] = num_full

    def after_step(self) -> None:
        """Called once the step's K/V are written: write-through copies the blocks it
        computed down to the lower tiers."""
        done, self._computed_this_step = self._computed_this_step, []
        live = [b for b in done if b.key is not None]
        if live:
            assert self.store is not None
            self.store.save([b.block_id for b in live], [b.key for b in live])  # type: ignore[misc]

    def discard_step(self) -> None:
        """After a failed step: the blocks registered for it were never written, so no hash
        may point at them. Dropping the whole registry is the simple, safe answer."""
        self._computed_this_step = []
        self.pool.reset_prefix_cache()

    def _save_evicted(self, blocks: list[KVBlock]) -> None:
        assert self.store is not None
        self.store.save([b.block_id for b in blocks], [b.key for b in blocks])  # type: ignore[misc]

    def flush_to_disk(self) -> int:
        """Persist every cached block to the lowest tier (for a clean shutdown)."""
        if self.store is None:
            return 0
        keyed = [(b.block_id, b.key) for b in self.pool.cached.values()]
        return self.store.flush(keyed)  # type: ignore[arg-type]

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Make `req`'s block table cover `num_tokens` token positions without registering
        anything in the prefix cache: room for a drafter to write K/V of tokens that are not
        verified yet. False, with nothing changed, when the pool is short."""
        blocks = self._blocks.setdefault(req.request_id, [])
        need = cdiv(num_tokens, self.block_size) - len(blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        fresh = self.pool.allocate(need)
        blocks.extend(fresh)
        req.block_ids.extend(b.block_id for b in fresh)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks after the first cdiv(num_tokens, block_size): those held only
        for rejected drafts. They hold no verified token, so none of them is hashed."""
        blocks = self._blocks.get(req.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        if len(blocks) <= keep:
            return
        assert keep >= self._num_cached.get(req.request_id, 0)
        tail = blocks[keep:]
        del blocks[keep:]
        del req.block_ids[keep:]
        self.pool.free(reversed(tail))

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
