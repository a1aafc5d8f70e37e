"""Prefix-cache tiers with toy sizes: host LRU, disk persistence and its failure modes, the
manager moving blocks down and back, salts, and a property test that every block served from
any tier holds exactly the K/V that was computed for it."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv_cache.hashing import ROOT_HASH, BlockKey, hash_block
from kvserve.kv_cache.layout import KVLayout
from kvserve.kv_cache.manager import KVCacheManager, Stored
from kvserve.kv_cache.tier_media import DiskTier, HostTier, KVTier
from kvserve.kv_cache.tiers import TieredKVStore
from kvserve.request import Request
from kvserve.sample.sampling_params import SamplingParams

BS = 4
LAYERS = 2
SHAPE = (LAYERS, 2, 1, BS, 3)  # per-block payload: layers, K/V, KV heads, tokens, width


def key(n: int) -> BlockKey:
    return BlockKey(hash_block(ROOT_HASH, [n] * BS), ROOT_HASH, (n,) * BS)


def payload(k: BlockKey, dtype=torch.float32) -> torch.Tensor:
    """Deterministic contents for a block: what 'computing' it would write."""
    g = torch.Generator().manual_seed(k.block_hash % (2**63))
    return (torch.randn(SHAPE, generator=g) * 50).to(dtype)


class Recorder(KVTier):
    name = "rec"

    def __init__(self) -> None:
        self.keys: list[BlockKey] = []

    def contains(self, key):
        return key in self.keys

    def get(self, key):
        return None

    def put(self, key, p):
        self.keys.append(key)

    def __len__(self):
        return len(self.keys)


# ------------------------------------------------------------------------------ host tier


def test_host_tier_lru_and_spill():
    spill = Recorder()
    host = HostTier(2, SHAPE, torch.float32, spill=spill)
    a, b, c, d = key(1), key(2), key(3), key(4)
    host.put(a, payload(a))
    host.put(b, payload(b))
    host.put(c, payload(c))  # evicts a (least recently used) into the spill tier
    assert spill.keys == [a] and not host.contains(a)
    assert torch.equal(host.get(b), payload(b))  # b becomes most recently used
    host.put(d, payload(d))  # evicts c, not b
    assert spill.keys == [a, c]
    assert host.contains(b) and host.contains(d) and len(host) == 2


def test_host_tier_verifies_the_whole_key():
    host = HostTier(2, SHAPE, torch.float32)
    a = key(1)
    host.put(a, payload(a))
    forged = BlockKey(a.block_hash, a.parent_hash, (9,) * BS)  # same hash, other tokens
    assert host.get(forged) is None


class InFlight:
    """A device-to-host copy that lands only when waited on, as a non_blocking copy from a
    GPU may: until then the destination keeps what it held."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, log: list[str]) -> None:
        self.dst, self.src, self.log = dst, src.clone(), log

    def synchronize(self) -> None:
        self.dst.copy_(self.src)
        self.log.append("landed")


def deferred_host(num_blocks: int, spill: KVTier | None = None) -> tuple[HostTier, list[str]]:
    log: list[str] = []
    host = HostTier(num_blocks, SHAPE, torch.float32, spill=spill,
                    copy=lambda dst, src: InFlight(dst, src, log))
    host.data.fill_(-1.0)  # what a slot holds before its copy lands
    return host, log


def test_host_tier_reads_wait_for_their_copy():
    """Every host-side read of a slot (get, the spill of an evicted entry, items) sees the
    payload put there, not what the slot held while its copy was in flight."""
    spill = DiskLike()
    host, log = deferred_host(2, spill)
    a, b, c = key(1), key(2), key(3)
    host.put(a, payload(a))
    host.put(b, payload(b))
    assert log == []  # nothing waited yet: both copies in flight
    assert torch.equal(host.get(b), payload(b))
    host.put(c, payload(c))  # evicts a: its spill reads the slot
    assert torch.equal(spill.payloads[a], payload(a))
    assert {k: torch.equal(p, payload(k)) for k, p in host.items()} == {b: True, c: True}
    assert log == ["landed"] * 3


def test_host_tier_store_round_trip_in_one_pass_waits():
    """TieredKVStore.execute saving a pool block to a host tier whose copies are deferred,
    and a later pass loading it back: the pool gets the saved K/V, not the slot's old bytes."""
    kv_caches = [torch.zeros(2, 1, 4 * BS, 3) for _ in range(LAYERS)]
    host, log = deferred_host(2)
    store = TieredKVStore(kv_caches, BS, [host])
    a = key(1)
    store.write_blocks([0], payload(a).unsqueeze(0))
    assert not store.execute([(0, a)], [])
    assert not store.execute([], [(2, a)])
    assert torch.equal(store.read_blocks([2])[0], payload(a)) and log == ["landed"]


class DiskLike(KVTier):
    """A lower tier that keeps what it is given (by value, as the disk does)."""

    name = "disk-like"

    def __init__(self) -> None:
        self.payloads: dict[BlockKey, torch.Tensor] = {}

    def contains(self, key):
        return key in self.payloads

    def get(self, key):
        return self.payloads.get(key)

    def put(self, key, p):
        self.payloads[key] = p.clone()

    def __len__(self):
        return len(self.payloads)


# ------------------------------------------------------------------------------ disk tier


def test_disk_round_trip_and_restart(tmp_path):
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        disk = DiskTier(tmp_path, f"fp-{dtype}", SHAPE, dtype, 1 << 20)
        keys = [key(i) for i in range(3)]
        for k in keys:
            disk.put(k, payload(k, dtype))
        assert not list(disk.dir.glob("*.tmp*"))
        again = DiskTier(tmp_path, f"fp-{dtype}", SHAPE, dtype, 1 << 20)  # a restart
        assert len(again) == 3
        for k in keys:
            assert torch.equal(again.get(k), payload(k, dtype))


def test_other_model_or_layout_is_never_used(tmp_path):
    a = key(1)
    DiskTier(tmp_path, "model-a", SHAPE, torch.float32, 1 << 20).put(a, payload(a))
    assert not DiskTier(tmp_path, "model-b", SHAPE, torch.float32, 1 << 20).contains(a)
    # Same directory name but another block layout: the entry is not trusted.
    other = DiskTier(tmp_path, "model-a", (LAYERS, 2, 1, BS, 5), torch.float32, 1 << 20)
    assert len(other) == 0


def _only_file(disk: DiskTier) -> Path:
    (path,) = list(disk.dir.glob("*.kvb"))
    return path


def test_corrupt_entry_is_dropped_not_served(tmp_path):
    disk = DiskTier(tmp_path, "fp", SHAPE, torch.float32, 1 << 20)
    a = key(1)
    disk.put(a, payload(a))
    path = _only_file(disk)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # flip a payload byte
    path.write_bytes(bytes(raw))
    assert disk.get(a) is None
    assert disk.stats.corrupt_dropped == 1 and not path.exists() and not disk.contains(a)


def test_truncated_and_garbage_files(tmp_path):
    disk = DiskTier(tmp_path, "fp", SHAPE, torch.float32, 1 << 20)
    a = key(1)
    disk.put(a, payload(a))
    path = _only_file(disk)
    path.write_bytes(path.read_bytes()[:-10])  # truncated: header intact, payload short
    (disk.dir / "junk.kvb").write_bytes(b"not a block")
    (disk.dir / "x.tmp123").write_bytes(b"half written")
    again = DiskTier(tmp_path, "fp", SHAPE, torch.float32, 1 << 20)
    assert not (disk.dir / "junk.kvb").exists() and not (disk.dir / "x.tmp123").exists()
    assert again.get(a) is None and not path.exists()


def test_disk_budget_evicts_least_recently_used(tmp_path):
    probe = DiskTier(tmp_path / "probe", "fp", SHAPE, torch.float32, 1 << 20)
    probe.put(key(0), payload(key(0)))
    block_bytes = probe.num_bytes
    disk = DiskTier(tmp_path, "fp", SHAPE, torch.float32, int(block_bytes * 2.5))
    a, b, c = key(1), key(2), key(3)
    disk.put(a, payload(a))
    disk.put(b, payload(b))
    disk.get(a)  # a is now more recent than b
    disk.put(c, payload(c))
    assert disk.contains(a) and disk.contains(c) and not disk.contains(b)
    assert disk.num_bytes <= disk.max_bytes and len(list(disk.dir.glob("*.kvb"))) == 2
    tiny = DiskTier(tmp_path / "tiny", "fp", SHAPE, torch.float32, block_bytes // 2)
    tiny.put(a, payload(a))  # larger than the whole budget: not stored
    assert len(tiny) == 0


def test_disk_write_failure_is_survived(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path, "fp", SHAPE, torch.float32, 1 << 20)

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    a = key(1)
    disk.put(a, payload(a))
    assert disk.stats.write_errors == 1 and not disk.contains(a)
    assert not list(disk.dir.iterdir())


# ------------------------------------------------------------- manager with a tiered store

_ids = itertools.count()


def make_req(tokens: list[int], salt: str | None = None) -> Request:
    return Request(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=4), frozenset(), 4,
                   cache_salt=salt)


class Harness:
    """A KV manager over fake per-layer caches, where 'computing' a block writes the
    deterministic payload of its key, so any block served later can be checked."""

    def __init__(self, num_blocks: int, host_blocks: int, disk_dir: Path | None,
                 policy: str = "write-back") -> None:
        self.kv_caches = [torch.zeros(2, 1, num_blocks * BS, 3) for _ in range(LAYERS)]
        tiers: list[KVTier] = []
        disk = DiskTier(disk_dir, "fp", SHAPE, torch.float32, 1 << 20) if disk_dir else None
        if host_blocks:
            tiers.append(HostTier(host_blocks, SHAPE, torch.float32, spill=disk))
        if disk is not None:
            tiers.append(disk)
        self.store = TieredKVStore(self.kv_caches, BS, tiers, policy) if tiers else None
        self.kv = KVCacheManager(num_blocks, BS, True, self.store)

    def admit(self, req: Request) -> bool:
        hit = self.kv.get_computed_blocks(req)
        n = req.num_tokens - hit.num_blocks * BS
        if not self.kv.allocate_slots(req, n, hit):
            return False
        req.num_computed_tokens = hit.num_blocks * BS
        self.transfer()
        self.check_served(req, hit.num_blocks)
        self.compute(req, hit.num_blocks)
        return True

    def transfer(self) -> None:
        """Carry out the tier copies decided so far, as the engine core does before a step."""
        t = self.kv.take_transfers()
        if self.store is not None:
            assert not self.store.execute(t.saves, t.loads)
        else:
            assert not t

    def compute(self, req: Request, start_block: int) -> None:
        self.transfer()
        for i in range(start_block, req.num_tokens // BS):
            self.write(req.block_ids[i], self.kv._key(req, i))
        req.num_computed_tokens = req.num_tokens
        self.kv.after_step()

    def write(self, block_id: int, k: BlockKey) -> None:
        if self.store is not None:
            self.store.write_blocks([block_id], payload(k).unsqueeze(0))

    def check_served(self, req: Request, num_blocks: int) -> None:
        if self.store is None or not num_blocks:
            return
        got = self.store.read_blocks(req.block_ids[:num_blocks])
        for i in range(num_blocks):
            assert torch.equal(got[i], payload(self.kv._key(req, i))), f"block {i} is wrong"


def test_evicted_blocks_come_back_from_host_identical(tmp_path):
    h = Harness(num_blocks=4, host_blocks=8, disk_dir=None)
    a = make_req(list(range(100, 109)))  # 2 full blocks + 1 token
    assert h.admit(a)
    h.kv.free(a)
    b = make_req(list(range(200, 216)))  # needs all 4 blocks: evicts a's cached blocks
    assert h.admit(b)
    assert h.store.stats.saves["host"] == 2
    h.kv.free(b)
    a2 = make_req(list(range(100, 109)))
    hit = h.kv.get_computed_blocks(a2)
    assert [type(e) for e in hit.entries] == [Stored, Stored]
    assert {e.tier for e in hit.entries} == {"host"}
    assert h.admit(a2)
    assert a2.num_cached_tokens == 8 and h.kv.stats.hits["host"] == 8
    h.kv.check_integrity()


def test_blocks_survive_through_disk_and_restart(tmp_path):
    h = Harness(num_blocks=4, host_blocks=1, disk_dir=tmp_path)
    a = make_req(list(range(100, 109)))
    assert h.admit(a)
    h.kv.free(a)
    assert h.admit(make_req(list(range(200, 216))))  # a's 2 blocks: host (1) spills to disk
    assert h.store.tiers[1].name == "disk" and len(h.store.tiers[1]) >= 1
    h.kv.flush_to_disk()
    restarted = Harness(num_blocks=4, host_blocks=0, disk_dir=tmp_path)
    a2 = make_req(list(range(100, 109)))
    assert restarted.admit(a2)
    assert a2.num_cached_tokens == 8 and restarted.kv.stats.hits["disk"] == 8


def test_write_through_copies_computed_blocks_at_once(tmp_path):
    h = Harness(num_blocks=8, host_blocks=0, disk_dir=tmp_path, policy="write-through")
    a = make_req(list(range(100, 113)))  # 3 full blocks
    assert h.admit(a)
    assert len(h.store.tiers[0]) == 3  # on disk without any eviction
    restarted = Harness(num_blocks=8, host_blocks=0, disk_dir=tmp_path)
    a2 = make_req(list(range(100, 113)))
    assert restarted.admit(a2) and a2.num_cached_tokens == 12


def test_salts_isolate_tenants():
    h = Harness(num_blocks=16, host_blocks=0, disk_dir=None)
    prompt = list(range(100, 117))
    assert h.admit(make_req(prompt, salt="tenant-a"))
    other = make_req(prompt, salt="tenant-b")
    assert h.kv.get_computed_blocks(other).entries == []
    unsalted = make_req(prompt)
    assert h.kv.get_computed_blocks(unsalted).entries == []
    same = make_req(prompt, salt="tenant-a")
    assert len(h.kv.get_computed_blocks(same).entries) == 4


def test_refcounts_of_shared_blocks_and_eviction_order():
    h = Harness(num_blocks=6, host_blocks=0, disk_dir=None)
    prompt = list(range(100, 109))
    a, b = make_req(prompt), make_req(prompt)
    assert h.admit(a) and h.admit(b)
    shared = a.block_ids[:2]
    assert b.block_ids[:2] == shared
    assert [h.kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    h.kv.free(a)
    assert [h.kv.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    b_ids = list(b.block_ids)
    h.kv.free(b)
    # Freed tail first, so the head of a prompt (most likely to be shared) is evicted last.
    order = [blk.block_id for blk in h.kv.pool.free_queue]
    assert order[-3:] == list(reversed(b_ids))
    h.kv.check_integrity()


@pytest.mark.parametrize("host_blocks, use_disk", [(3, False), (0, True), (1, True)])
@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "grow", "free", "preempt"]),
                              st.integers(0, 5), st.integers(1, 13)), min_size=10,
                    max_size=60),
       policy=st.sampled_from(["write-back", "write-through"]))
def test_any_mix_serves_only_correct_blocks(tmp_path_factory, host_blocks, use_disk, ops,
                                            policy):
    disk_dir = tmp_path_factory.mktemp("disk") if use_disk else None
    h = Harness(num_blocks=6, host_blocks=host_blocks, disk_dir=disk_dir, policy=policy)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(13)] for _ in range(4)]
    live: dict[int, Request] = {}
    for op, slot, n in ops:
        if op == "add" and slot not in live:
            req = make_req(prompts[slot % 4][:n + 1], salt=None if slot < 4 else "s")
            if h.admit(req):
                live[slot] = req
        elif op == "grow" and slot in live:
            req = live[slot]
            before = req.num_tokens // BS
            for t in range(n % 5 + 1):
                req.append_token(500 + t)
            if h.kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens):
                h.compute(req, before)
            else:
                h.kv.free(live.pop(slot))
        elif op in ("free", "preempt") and slot in live:
            req = live.pop(slot)
            h.kv.free(req)
            if op == "free":
                h.kv.forget(req)
        h.kv.check_integrity()
    for req in live.values():
        h.kv.free(req)
    h.kv.check_integrity()
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_payload_shapes_of_the_store():
    h = Harness(num_blocks=3, host_blocks=2, disk_dir=None)
    k = key(7)
    h.write(1, k)
    got = h.store.read_blocks([1])
    assert got.shape == (1, *SHAPE) and torch.equal(got[0], payload(k))
    with pytest.raises(ValueError):
        TieredKVStore(h.kv_caches, BS, h.store.tiers, "write-sideways")


def test_a_window_block_loaded_while_the_whole_context_group_needs_new_ones():
    """Two KV groups (whole-context layers, and layers with a 4-token window): a prompt's
    window block was evicted to the host tier while its whole-context block stayed in the
    pool. A request hitting both must get the loaded copy in its window table and only
    empty blocks for its new tokens. (Found by the determinism test on tiny Gemma 3: the
    load's target went to the whole-context table, whose new tokens then overwrote it.)"""
    layout = KVLayout.for_model(SimpleNamespace(num_layers=4, window=lambda i: (0, 4)[i % 2]))
    assert layout.group_windows == (0, 4) and layout.group_size == LAYERS
    kv_caches = [torch.zeros(2, 1, 7 * BS, 3) for _ in range(LAYERS)]
    store = TieredKVStore(kv_caches, BS, [HostTier(4, SHAPE, torch.float32)])
    kv = KVCacheManager(7, BS, True, store, layout)

    def run(req: Request, n: int, hit=None) -> None:
        assert kv.allocate_slots(req, n, hit)
        t = kv.take_transfers()
        assert not store.execute(t.saves, t.loads)

    def compute(req: Request, upto: int) -> None:
        for i in range(req.num_computed_tokens // BS, upto // BS):
            for g, held in enumerate(kv._blocks[req.request_id]):
                if held[i] is not None:
                    store.write_blocks([held[i].block_id],
                                       payload(kv._key(req, i, g)).unsqueeze(0))
        req.num_computed_tokens = upto

    a = make_req(list(range(100, 109)))  # 2 full blocks and a token
    run(a, 9)
    compute(a, 8)
    a.num_computed_tokens = 9
    run(a, 1)  # its window moved past block 0, which goes back to the pool, cached
    filler = make_req([1, 2, 3])
    run(filler, 3)  # takes the last free block and evicts that one: saved to the host tier
    assert store.top.contains(kv._key(a, 0, 1))
    for held in kv._blocks[filler.request_id]:  # the filler's own K/V replace what was there
        store.write_blocks([held[0].block_id], torch.full((1, *SHAPE), -1.0))
    kv.free(filler)
    kv.free(a)
    b = make_req(list(range(100, 104)) + [7, 7, 7])
    hit = kv.get_computed_blocks(b)
    assert hit.num_blocks == 1 and isinstance(hit.groups[1][0], Stored)
    run(b, 3, hit)
    window_block = b.group_tables[0][0]
    assert window_block not in b.block_ids
    got = store.read_blocks([window_block])[0]
    assert torch.equal(got, payload(kv._key(b, 0, 1)))
    assert torch.equal(store.read_blocks([b.block_ids[0]])[0], payload(kv._key(b, 0, 0)))
