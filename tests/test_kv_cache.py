"""Block pool and KV cache manager with toy sizes: exact block ids, LRU order, prefix hits,
integrity after every scenario, and no leaks under random arrival/finish/abort sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.hashing import BlockKey
from kvserve.kv_cache.layout import KVLayout
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sample.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), frozenset(), max_tokens)


def test_pool_allocates_in_order_and_frees_to_lru_tail():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    b = pool.allocate(1)
    assert [x.block_id for x in b] == [2]
    assert pool.num_free_blocks == 1
    pool.free(reversed(a))  # tail first: block 1 is evicted before block 0
    assert [x.block_id for x in pool.free_queue] == [3, 1, 0]
    assert [x.block_id for x in pool.allocate(3)] == [3, 1, 0]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.check_integrity()


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 12), ops=st.lists(
    st.tuples(st.sampled_from(["allocate", "free", "cache", "touch", "uncache"]),
              st.integers(0, 11)), max_size=40))
def test_pool_hands_out_blocks_as_an_eager_lru_queue_would(n, ops):
    """Blocks are made on first use (_Blocks): whatever the allocations, frees, prefix-cache
    hits and uncaching, the pool hands out the ids an eager queue of every block would (all
    blocks in id order at the start, freed ones to the tail), and its integrity holds with
    only the blocks made so far."""
    pool = BlockPool(n)
    queue = list(range(n))  # the reference: free ids, head first
    held: list = []
    keys = 0
    for op, i in ops:
        if op == "allocate":
            k = min(i % 3 + 1, pool.num_free_blocks)
            got = [b.block_id for b in pool.allocate(k)]
            assert got == queue[:k]
            queue = queue[k:]
            held += [pool.blocks[j] for j in got]
        elif op == "free" and held:
            b = held.pop(i % len(held))
            pool.free([b])
            if b.ref_cnt == 0:
                queue.append(b.block_id)
        elif op == "cache" and held:
            keys += 1
            pool.cache(held[i % len(held)], BlockKey(keys, 0, (keys,)))
        elif op == "touch" and pool.cached:
            b = list(pool.cached.values())[i % len(pool.cached)]
            if b.ref_cnt == 0:
                queue.remove(b.block_id)
            pool.touch([b])
            held.append(b)
        elif op == "uncache" and pool.cached:
            pool.uncache(list(pool.cached.values())[i % len(pool.cached)])
        assert pool.num_free_blocks == len(queue)
        pool.check_integrity()
    assert [b.block_id for b in pool.free_queue] == queue


def test_pool_double_free_is_caught():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_allocate_slots_exact_blocks_and_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert r.block_ids == [0, 1, 2]
    r.num_computed_tokens = 10
    r.append_token(99)
    assert kv.allocate_slots(r, 1)  # token 11 still fits in block 2
    assert r.block_ids == [0, 1, 2]
    r.num_computed_tokens = 11
    for t in (100, 101):
        r.append_token(t)
    assert kv.allocate_slots(r, 2)  # tokens 12, 13 need block 3
    assert r.block_ids == [0, 1, 2, 3]
    kv.free(r)
    assert r.block_ids == []
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert r.block_ids == [] and kv.num_free_blocks == 2
    kv.check_integrity()


def test_prefix_hit_shares_full_blocks_and_recomputes_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    a = make_req("a", prompt)
    assert kv.get_computed_blocks(a).entries == []
    assert kv.allocate_slots(a, 12)
    b = make_req("b", prompt)
    hits = kv.get_computed_blocks(b)
    # The last token must be recomputed, so only the first two blocks are served.
    assert [h.block_id for h in hits.entries] == [0, 1]
    assert kv.allocate_slots(b, 4, hits)
    assert b.block_ids == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[2].ref_cnt == 1
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    # Freed blocks keep their hashes: a third request still hits them.
    c = make_req("c", prompt + [7])
    assert [h.block_id for h in kv.get_computed_blocks(c).entries] == [0, 1, 2]


def test_prefix_cache_is_not_fooled_by_a_different_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.allocate_slots(a, 9)
    # Same second block, different first block: the chained hash must miss entirely.
    b = make_req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b).entries == []


def test_hash_collision_never_serves_wrong_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    b = make_req("b", [9, 9, 9, 9, 5])
    # Force b's hash to equal a's: the stored token ids must still reject the hit.
    kv._hashes["b"] = list(kv.block_hashes(a))
    assert kv.get_computed_blocks(b).entries == []


def test_eviction_forgets_hash_of_reused_block():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    kv.free(a)
    b = make_req("b", [7, 7, 7, 7, 7, 7, 7, 7])
    kv.allocate_slots(b, 8)  # takes both blocks, evicting a's cached block
    kv.check_integrity()
    c = make_req("c", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(c).entries == []


def test_reviving_a_free_cached_block_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_req("a", list(range(9)))
    kv.allocate_slots(a, 9)  # blocks 0,1,2; 0 and 1 full and cached
    kv.free(a)
    b = make_req("b", list(range(8)) + [50] * 8)
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits.entries] == [0, 1]
    # b needs 4 blocks: 2 revived + 2 new, only 1 more exists.
    assert not kv.allocate_slots(b, 8, hits)
    kv.check_integrity()
    assert kv.allocate_slots(b, 4, hits)
    assert b.block_ids == [0, 1, 2]
    kv.check_integrity()


ops = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "finish"]), st.integers(0, 7),
              st.integers(1, 40)),
    min_size=1, max_size=60)


def _table(r: Request, g: int) -> list[int]:
    return r.block_ids if g == 0 else r.group_tables[g - 1]


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans(),
       windows=st.sampled_from([(0,), (0,), (0, 8), (5,), (0, 6, 6), (0, 13)]))
def test_random_sequences_never_leak(ops, caching, windows):
    """Random arrivals, growth and finishes, with one block table or several (windows:
    KV groups, 0 for a whole-context group). Besides integrity and no leaks: a fake cache
    records what each block holds (group, the tokens up to its end), and every block a
    request reads must hold its own tokens, whether computed, shared or revived."""
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs, enable_prefix_caching=caching,
                        layout=KVLayout(windows, tuple(range(len(windows))),
                                        (0,) * len(windows)))
    content: dict[int, tuple] = {}
    live: dict[int, Request] = {}

    def compute(r: Request) -> None:
        """Check that nothing before a sliding window is held any more (given back when
        the step was allocated), write r's new tokens, then check what the next token
        reads."""
        end = r.num_tokens
        for g, w in enumerate(windows):
            first = max(r.num_computed_tokens - w + 1, 0) // bs if w else 0
            assert kv._blocks[r.request_id][g][:first] == [None] * first
        for g in range(len(windows)):
            for i in range(r.num_computed_tokens // bs, -(-end // bs)):
                content[_table(r, g)[i]] = (g, tuple(r.all_token_ids[:min((i + 1) * bs, end)]))
        r.num_computed_tokens = end
        for g, w in enumerate(windows):
            first = max(end - w + 1, 0) // bs if w else 0
            for i in range(first, -(-end // bs)):
                want = (g, tuple(r.all_token_ids[:min((i + 1) * bs, end)]))
                assert content[_table(r, g)[i]] == want, (g, i)

    for step, (op, slot, n) in enumerate(ops):
        if op == "add" and slot not in live:
            # Few distinct prompts so that prefix hits happen.
            r = make_req(f"r{step}", [slot % 3] * n)
            hits = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - hits.num_blocks * bs, hits):
                r.num_computed_tokens = hits.num_blocks * bs
                compute(r)
                live[slot] = r
        elif op == "grow" and slot in live:
            r = live[slot]
            for _ in range(n % 7 + 1):
                r.append_token(slot)
            if kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens):
                compute(r)
            else:  # out of memory: preempt it, as the scheduler would
                kv.free(live.pop(slot))
        elif op == "finish" and slot in live:
            r = live.pop(slot)
            kv.free(r)
            kv.forget(r)
        kv.check_integrity()
    for r in live.values():
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def two_groups(num_blocks: int, window: int = 8, **kw) -> KVCacheManager:
    """Group 0 whole-context, group 1 a sliding window, blocks of 4 tokens."""
    return KVCacheManager(num_blocks, 4, layout=KVLayout((0, window), (0, 1), (0, 0)), **kw)


def test_sliding_window_group_hands_back_blocks_before_its_window():
    kv = two_groups(32)
    r = make_req("a", list(range(40)))
    computed = 0
    for chunk in (8, 8, 8, 8, 8):
        assert kv.allocate_slots(r, chunk)
        computed += chunk
        r.num_computed_tokens = computed
    assert len(set(r.block_ids + r.group_tables[0][6:])) == 14
    # Before the last chunk (32 computed), the next token's window began at 25: blocks
    # 0..5 of group 1 were handed back; 6..9 kept.
    assert r.group_tables[0][:6] == [0] * 6 and 0 not in r.group_tables[0][6:]
    assert kv.num_free_blocks == 32 - 10 - 4
    r.append_token(7)
    assert kv.allocate_slots(r, 1)  # 40 computed: the window begins at 33, in block 8
    assert r.group_tables[0][:8] == [0] * 8
    assert kv.num_free_blocks == 32 - 11 - 3
    kv.free(r)
    assert kv.num_free_blocks == 32
    kv.check_integrity()


def test_prefix_hit_needs_only_the_window_of_a_sliding_group():
    kv = two_groups(32)
    prompt = list(range(100, 132))  # 8 full blocks
    a = make_req("a", prompt)
    assert kv.allocate_slots(a, 32)
    a.num_computed_tokens = 32
    kv.free(a)  # every block cached and free
    b = make_req("b", prompt + [1])
    hit = kv.get_computed_blocks(b)
    assert hit.num_blocks == 8
    # group 1: the next token (position 32) reads 25..31: blocks 6 and 7 only
    assert hit.groups[1][:6] == [None] * 6
    assert all(e is not None for e in hit.groups[1][6:] + hit.groups[0])
    assert kv.allocate_slots(b, 1, hit)
    assert b.group_tables[0][:6] == [0] * 6
    assert kv.num_pool_hit_tokens(make_req("c", prompt + [2])) == 32
    kv.check_integrity()


def test_prefix_hit_shrinks_to_what_every_group_holds():
    kv = two_groups(32)
    prompt = list(range(100, 124))
    a = make_req("a", prompt)
    assert kv.allocate_slots(a, 24)
    a.num_computed_tokens = 24
    held = kv._blocks["a"]
    kv.free(a)
    for block in held[1][4:6]:  # as if evicted: group 1's blocks 4 and 5 are gone
        kv.pool._forget(block)
    b = make_req("b", prompt + [1])
    hit = kv.get_computed_blocks(b)
    # Group 0 holds all 6 blocks, but after 6 (or 5) blocks the next token reads group 1's
    # block 4 or 5; after 4 it reads positions 9..15: blocks 2 and 3, still cached.
    assert hit.num_blocks == 4
    assert hit.groups[1][:2] == [None, None] and None not in hit.groups[1][2:]
    assert kv.allocate_slots(b, 25 - 16, hit)
    assert b.group_tables[0][:2] == [0, 0]
    kv.check_integrity()
