"""KV cache manager: which blocks each request holds, and prefix reuse of full blocks.

A full block is identified by a chained hash H(parent hash, its token ids, extra keys), so a
block's hash covers the whole prefix before it; a request's cache salt enters the first
block's hash, so salted prompts only ever share blocks with the same salt. Blocks are
registered in the cache when they are allocated for the step that computes them: a second
request scheduled later in the same step may reuse them, which is safe because every layer
writes the step's K/V before any attention reads it. The last token of a request is never
served from the cache, since its logits are needed.

With lower tiers (`store`), a hashed block evicted from the pool is copied down first, and a
prefix hit found only in a lower tier is copied back into a fresh block at admission. The
manager only decides these copies: it lists them (`take_transfers`) for the scheduler's output,
and the engine core has the store carry them out after scheduling and before the step's
forward (saves first, then loads), so no tier I/O runs while the scheduler decides. A copy
that turns out bad when read is reported back (`drop_failed_loads`), and the requests that
counted on it compute those tokens instead.

With several KV groups (kv_cache.layout: models mixing sliding-window and global layers) a
request holds one table per group, all drawing on the one pool; a group's blocks are keyed
by a hash derived from the chained one. A sliding-window group hands back the blocks its
next token no longer reads, and a prefix hit of n blocks needs, per group, only the blocks
the token after them reads (all n for a global group).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvserve.kv_cache.block_pool import BlockPool, KVBlock
from kvserve.kv_cache.events import KVEventLog
from kvserve.kv_cache.hashing import ROOT_HASH, BlockKey, chain_hashes, hash_block
from kvserve.kv_cache.layout import KVLayout
from kvserve.kv_cache.tiers import TieredKVStore
from kvserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Stored:
    """A prefix block found in a lower tier (or on its way there), to be loaded into a fresh
    pool block before the step runs."""

    key: BlockKey
    tier: str


@dataclass
class KVTransfers:
    """The tier copies one step needs, in order: `saves` (pool block, key) copy evicted
    blocks down before anything overwrites them, then `loads` (pool block, key) fill fresh
    blocks from the tiers."""

    saves: list[tuple[int, BlockKey]] = field(default_factory=list)
    loads: list[tuple[int, BlockKey]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


Entry = KVBlock | Stored | None  # None: a sliding-window group's block before its window


@dataclass
class PrefixHit:
    """The longest cached run at the start of a request: per KV group (see KVLayout), in
    order, pool blocks to share, blocks to load from a lower tier, or None where a
    sliding-window group needs no block (before its window)."""

    groups: list[list[Entry]] = field(default_factory=lambda: [[]])

    @property
    def entries(self) -> list[Entry]:
        """Group 0's entries (every layer's, with one group)."""
        return self.groups[0]

    @property
    def num_blocks(self) -> int:
        return len(self.groups[0])

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        """Tokens of the hit per tier it came from ("device" is the fast pool); a block
        position counts for the tier of its first group that holds a block there, or where
        none does (before every window), for that of the next position."""
        out: dict[str, int] = {}
        tier = "device"
        for column in reversed(list(zip(*self.groups, strict=True))):
            e = next((x for x in column if x is not None), None)
            if e is not None:
                tier = "device" if isinstance(e, KVBlock) else e.tier
            out[tier] = out.get(tier, 0) + block_size
        return out


@dataclass
class PrefixCacheStats:
    """Tokens looked up and tokens served, per tier ("device" is the fast pool)."""

    queries: int = 0
    hits: Counter = field(default_factory=Counter)


class KVCacheManager:
    """Blocks per request and per KV group (`layout`; one group unless the model mixes
    sliding-window and whole-context layers). A sliding-window group hands back each block
    once every key in it is older than the window of the request's next token, so its
    table holds block 0 (whose contents the window masks) in the places before."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 store: TieredKVStore | None = None, layout: KVLayout | None = None,
                 events: KVEventLog | None = None) -> None:
        """With `events`, the pool and the tiers log what they store and drop there
        (kv_cache.events); what the tiers hold already (a disk tier's blocks from an earlier
        run) is logged as stored at once."""
        if store is not None and not enable_prefix_caching:
            raise ValueError("KV cache tiers need prefix caching")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.store = store
        self.layout = layout if layout is not None else KVLayout.single(1)
        self.windows = self.layout.group_windows
        self.events = events
        self.pool = BlockPool(num_blocks, self._save_evicted if store is not None else None,
                              events)
        if events is not None and store is not None:
            for tier in store.tiers:
                tier.events = events
            self._announce_tiers()
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[list[KVBlock | None]]] = {}  # per request, per group
        self._num_cached: dict[str, int] = {}  # per request: leading blocks already hashed
        self._hashes: dict[str, list[int]] = {}
        self._computed_this_step: list[KVBlock] = []  # write-through candidates
        self._transfers = KVTransfers()  # decided, not yet carried out
        self._saving: dict[int, BlockKey] = {}  # block hash -> key of the pending saves

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int, chunk: int) -> int:
        """Most blocks a request of `num_tokens` tokens computed `chunk` at a time holds."""
        return self.layout.blocks_for(num_tokens, self.block_size, chunk)

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(req.all_token_ids[i * bs:(i + 1) * bs])

    def block_hashes(self, req: Request) -> list[int]:
        """Chained hashes of the request's full blocks, extended as tokens arrive."""
        hashes = self._hashes.setdefault(req.request_id, [])
        if len(hashes) < req.num_tokens // self.block_size:
            hashes += chain_hashes(req.all_token_ids, self.block_size, req.cache_salt,
                                   len(hashes), hashes[-1] if hashes else ROOT_HASH)
        return hashes

    def _key(self, req: Request, i: int, group: int = 0) -> BlockKey:
        """Block i's identity in `group`: group 0 keys by the chained hash itself, other
        groups by a hash derived from it (their blocks hold other layers' K/V)."""
        hashes = self.block_hashes(req)
        h = hashes[i] if group == 0 else hash_block(hashes[i], (group,), b"kv group")
        return BlockKey(h, hashes[i - 1] if i else ROOT_HASH, self._block_tokens(req, i))

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first block a sliding-window group still reads once `num_computed` tokens are
        computed: the next token, at position num_computed, sees num_computed - W + 1 on."""
        w = self.windows[group]
        return max(num_computed - w + 1, 0) // self.block_size if w else 0

    def _hit_length(self, req: Request, limit: int, present) -> int:
        """The most leading blocks n <= limit such that every group has what it reads after
        n blocks: a whole-context group all n, a sliding-window group those of its window.
        `present(group, i)` says whether block i of `group` is available; each block is
        asked about once."""
        seen: dict[tuple[int, int], bool] = {}

        def ok(g: int, i: int) -> bool:
            if (g, i) not in seen:
                seen[g, i] = present(g, i)
            return seen[g, i]

        n = limit
        changed = True
        while changed and n:
            changed = False
            for g, w in enumerate(self.windows):
                if not w:  # the run of blocks from the start
                    m = next((i for i in range(n) if not ok(g, i)), n)
                else:
                    m = n
                    while m and not all(ok(g, i) for i in range(
                            self._first_needed(g, m * self.block_size), m)):
                        m -= 1
                if m < n:
                    n, changed = m, True
        return n

    def get_computed_blocks(self, req: Request) -> PrefixHit:
        """The longest cached run at the start of the request's tokens that every KV group
        can serve, from the pool or (loaded before the step) from a lower tier. Reads no
        tier: it asks only their indexes. Call only for a request with nothing computed.
        A request that wants prompt logprobs or a mean-pooled embedding gets no hit: they
        need every prompt position computed (its blocks are still cached for others)."""
        sp = req.sampling_params
        if (not self.enable_prefix_caching or req.num_computed_tokens
                or sp.prompt_logprobs is not None or sp.pooling == "mean"):
            return PrefixHit([[] for _ in self.windows])
        pool_block: dict[tuple[int, int], KVBlock | None] = {}
        found: dict[tuple[int, int], bool] = {}

        def present(g: int, i: int) -> bool:
            if (g, i) not in found:
                key = self._key(req, i, g)
                pool_block[g, i] = block = self.pool.lookup(key)
                found[g, i] = block is not None or self._stored_tier(key) is not None
            return found[g, i]

        n = self._hit_length(req, (req.num_tokens - 1) // self.block_size, present)
        return PrefixHit([self._hit_entries(req, g, n, pool_block)
                          for g in range(len(self.windows))])

    def _stored_tier(self, key: BlockKey) -> str | None:
        """The lower tier that holds `key` (or will, once this step's saves are done)."""
        if self.store is None:
            return None
        if self._saving.get(key.block_hash) == key:
            return self.store.top.name
        tier = self.store.find(key)
        return None if tier is None else tier.name

    def _hit_entries(self, req: Request, group: int, n: int,
                     pool_block: dict[tuple[int, int], KVBlock | None]) -> list[Entry]:
        """The entries of `group` for a hit of n blocks."""
        first = self._first_needed(group, n * self.block_size)
        entries: list[Entry] = [None] * first
        for i in range(first, n):
            block = pool_block[group, i]
            if block is None:
                key = self._key(req, i, group)
                tier = self._stored_tier(key)
                assert tier is not None
                entries.append(Stored(key, tier))
            else:
                entries.append(block)
        return entries

    def num_pool_hit_tokens(self, req: Request) -> int:
        """Tokens at the start of `req` whose K/V the fast pool holds now: a cheap look for
        the scheduler's ordering that fetches nothing from lower tiers and changes nothing."""
        if not self.enable_prefix_caching or req.num_computed_tokens:
            return 0

        def present(g: int, i: int) -> bool:
            return self.pool.lookup(self._key(req, i, g)) is not None

        limit = (req.num_tokens - 1) // self.block_size
        return self._hit_length(req, limit, present) * self.block_size

    def _table(self, req: Request, group: int) -> list[int]:
        if group == 0:
            return req.block_ids
        while len(req.group_tables) < group:
            req.group_tables.append([])
        return req.group_tables[group - 1]

    def _release_out_of_window(self, req: Request, num_computed: int) -> None:
        """Hand back the blocks of sliding-window groups that no later token reads (tail
        first, as `free` does; hashed ones stay in the prefix cache until evicted)."""
        blocks = self._blocks.get(req.request_id)
        if blocks is None:
            return
        for g, w in enumerate(self.windows):
            if not w:
                continue
            held, table = blocks[g], self._table(req, g)
            done = []
            for i in range(min(self._first_needed(g, num_computed), len(held))):
                if held[i] is not None:
                    done.append(held[i])
                    held[i] = None
                    table[i] = 0
            self.pool.free(reversed(done))

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       hit: PrefixHit | None = None) -> bool:
        """Give `req` room for `num_new_tokens` more tokens after its computed ones (which
        include `hit`, prefix blocks not yet attached). False when the pool cannot supply
        the blocks, with nothing changed but blocks before a sliding window handed back."""
        groups = hit.groups if hit is not None else [[] for _ in self.windows]
        n_hit = len(groups[0])
        blocks = self._blocks.setdefault(req.request_id, [[] for _ in self.windows])
        assert len(blocks[0]) * self.block_size >= req.num_computed_tokens
        computed = req.num_computed_tokens + n_hit * self.block_size
        self._release_out_of_window(req, computed)
        total = computed + num_new_tokens
        shared = [e for entries in groups for e in entries if isinstance(e, KVBlock)]
        loads = [e for entries in groups for e in entries if isinstance(e, Stored)]
        need = [max(cdiv(total, self.block_size) - len(held) - n_hit, 0) for held in blocks]
        revived = sum(1 for b in shared if b.ref_cnt == 0)
        if sum(need) + len(loads) + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(shared)  # before allocating, so a hit is never the one evicted
        fresh = self.pool.allocate(len(loads) + sum(need))
        # The first len(loads) blocks receive the loads, in the order `loads` lists them
        # (group by group), the rest are the new blocks: the two must not be interleaved
        # when a later group loads while an earlier one needs new blocks.
        for block, e in zip(fresh[:len(loads)], loads, strict=True):
            self._transfers.loads.append((block.block_id, e.key))
            self.pool.cache(block, e.key)
        loaded, empty = iter(fresh[:len(loads)]), iter(fresh[len(loads):])
        for g, entries in enumerate(groups):
            new: list[KVBlock | None] = [
                next(loaded) if isinstance(e, Stored) else e for e in entries]
            new += [next(empty) for _ in range(need[g])]
            blocks[g].extend(new)
            self._table(req, g).extend(0 if b is None else b.block_id for b in new)
        if n_hit:
            self._num_cached[req.request_id] = n_hit
        if hit is not None:
            self._record(req, hit)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, min(total, req.num_tokens) // self.block_size)
        return True

    def _record(self, req: Request, hit: PrefixHit) -> None:
        self.stats.queries += req.num_tokens
        for tier, n in hit.tokens_by_tier(self.block_size).items():
            self.stats.hits[tier] += n
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.num_blocks * self.block_size

    def _cache_full_blocks(self, req: Request, num_full: int) -> None:
        start = self._num_cached.get(req.request_id, 0)
        if num_full <= start:
            return
        write_through = self.store is not None and self.store.write_policy == "write-through"
        for g, held in enumerate(self._blocks[req.request_id]):
            for i in range(start, num_full):
                block = held[i]
                if block is None:
                    continue
                key = self._key(req, i, g)
                self.pool.cache(block, key)
                if write_through and block.key == key:
                    self._computed_this_step.append(block)
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
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every block hash in the pool (blocks in use stay with their requests, no
        longer shared). The lower tiers keep theirs: the event log, which has just said all
        cleared, hears of them again."""
        self.pool.reset_prefix_cache()
        self._announce_tiers()

    def _announce_tiers(self) -> None:
        if self.events is None or self.store is None:
            return
        for tier in self.store.tiers:
            for key in tier.held_keys():
                self.events.stored(key, tier.medium)

    def _save_evicted(self, blocks: list[KVBlock]) -> None:
        """A pool block about to be handed out again: copy it down before the step (its K/V
        stay intact until the step's loads and forward write into it)."""
        for b in blocks:
            assert b.key is not None
            self._transfers.saves.append((b.block_id, b.key))
            self._saving[b.key.block_hash] = b.key

    def take_transfers(self) -> KVTransfers:
        """The tier copies decided since the last call, for the step about to run."""
        out, self._transfers = self._transfers, KVTransfers()
        self._saving.clear()
        return out

    def drop_failed_loads(self, block_ids: set[int]) -> None:
        """Loads into these pool blocks failed (a bad copy, dropped by its tier): no hash may
        point at them. The scheduler recomputes the requests that hold them."""
        for block_id in block_ids:
            self.pool.uncache(self.pool.blocks[block_id])

    def flush_to_disk(self) -> int:
        """Persist every cached block to the lowest tier (for a clean shutdown)."""
        if self.store is None:
            return 0
        keyed = [(b.block_id, b.key) for b in self.pool.cached.values()]
        return self.store.flush(keyed)  # type: ignore[arg-type]

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Make `req`'s block tables cover `num_tokens` token positions without registering
        anything in the prefix cache: room for a drafter to write K/V of tokens that are not
        verified yet. False, with nothing changed, when the pool is short."""
        blocks = self._blocks.setdefault(req.request_id, [[] for _ in self.windows])
        need = [max(cdiv(num_tokens, self.block_size) - len(held), 0) for held in blocks]
        if sum(need) > self.pool.num_free_blocks:
            return False
        fresh = iter(self.pool.allocate(sum(need)))
        for g, held in enumerate(blocks):
            new = [next(fresh) for _ in range(need[g])]
            held.extend(new)
            self._table(req, g).extend(b.block_id for b in new)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks after the first cdiv(num_tokens, block_size): those held only
        for rejected drafts. They hold no verified token, so none of them is hashed."""
        keep = cdiv(num_tokens, self.block_size)
        for g, held in enumerate(self._blocks.get(req.request_id, [])):
            if len(held) <= keep:
                continue
            assert keep >= self._num_cached.get(req.request_id, 0)
            tail = held[keep:]
            del held[keep:]
            del self._table(req, g)[keep:]
            self.pool.free(b for b in reversed(tail) if b is not None)

    def free(self, req: Request) -> None:
        """Return every block of `req` to the pool, tail first so tails are evicted first
        (with several groups, position by position: a hit needs every group's blocks)."""
        groups = self._blocks.pop(req.request_id, [])
        self.pool.free(held[i] for i in reversed(range(len(groups[0]) if groups else 0))
                       for held in groups if held[i] is not None)
        self._num_cached.pop(req.request_id, None)
        req.block_ids.clear()
        req.group_tables.clear()

    def forget(self, req: Request) -> None:
        """Drop per-request hash state once the request is gone for good."""
        self._hashes.pop(req.request_id, None)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for groups in self._blocks.values():
            for blocks in groups:
                for b in blocks:
                    if b is not None:
                        held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks.made():  # the others are fresh: unheld
            assert held.get(b.block_id, 0) == b.ref_cnt, (
                f"{b}: ref count {b.ref_cnt} but held by {held.get(b.block_id, 0)} requests")
