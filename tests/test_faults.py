"""Injected faults (kvserve.faults) on a tiny model: a disk tier that fails writes or returns
bad reads, a request whose processing raises, a model step that raises, slow steps. Each is
confined: the requests it hits get their error, every other request finishes with the tokens
it has alone, and the KV cache returns to idle with its integrity intact. Also: disk-tier
entries never escape their directory."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvserve import faults
from kvserve.engine.llm import LLM
from kvserve.faults import Faults
from kvserve.kv_cache.hashing import BlockKey
from kvserve.kv_cache.tier_media import DiskTier
from kvserve.sample.sampling_params import SamplingParams

PARAMS = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)]


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 300) for _ in range(40)]
    return [shared[: 40 - 8 * (i % 2)] + [rng.randrange(2, 300) for _ in range(5)]
            for i in range(n)]


def llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, **kw)


@pytest.fixture
def inject():
    """inject(**fields) puts those faults in force for the test."""
    yield lambda **kw: faults.install(Faults(**kw))
    faults.install(None)


@pytest.fixture(scope="module")
def alone(tiny_llama_dir):
    """Each (prompt, params) run on its own, no prefix caching: what every request must get."""
    plain = llm(tiny_llama_dir, num_kv_blocks=400, enable_prefix_caching=False)
    return {(i, j): plain.generate([p], q)[0].outputs[0].token_ids
            for i, p in enumerate(prompts()) for j, q in enumerate(PARAMS)}


def run_batch(engine: LLM, ids: list[str]) -> dict[str, object]:
    """Every prompt with both params at once, under the given ids; the final outputs."""
    eng = engine.engine
    for rid, (i, j) in zip(ids, _pairs(), strict=True):
        eng.add_request(rid, prompts()[i], PARAMS[j])
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _pairs() -> list[tuple[int, int]]:
    return [(i, j) for i in range(len(prompts())) for j in range(len(PARAMS))]


def assert_idle(engine: LLM) -> None:
    eng = engine.engine.local_core
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.scheduler.num_suspects == 0


def test_the_switch_parses_and_refuses_what_it_does_not_know():
    f = Faults.parse('{"disk_write": "ENOSPC", "disk_every": 2, "slow_step_s": 0.1}')
    assert f.disk_write == "ENOSPC" and f.disk_every == 2 and f.slow_step_s == 0.1
    for bad in ('{"disk_write": "EPERM"}', '{"nope": 1}', '[1]', "not json",
                '{"disk_every": 0}', '{"disk_read": "zeros"}'):
        with pytest.raises(ValueError, match="KVSERVE_FAULTS"):
            Faults.parse(bad)
    assert faults.active() is None  # off unless the environment or a test turns it on


@pytest.mark.slow
@pytest.mark.parametrize("error", ["ENOSPC", "EIO"])
def test_disk_write_failures_keep_outputs(tiny_llama_dir, tmp_path, alone, inject, error):
    """20 pool blocks cannot hold the prompts: blocks go to a host tier of 8 blocks, which
    spills to a disk that fails every other write."""
    inject(disk_write=error, disk_every=2)
    block_bytes = 2 * 2 * 2 * 4 * 16 * 4
    engine = llm(tiny_llama_dir, num_kv_blocks=40, host_kv_cache_memory=8 * block_bytes,
                 kv_cache_dir=str(tmp_path))
    for _ in range(2):
        for (i, j), want in alone.items():
            assert engine.generate([prompts()[i]], PARAMS[j])[0].outputs[0].token_ids == want
    disk = engine.engine.local_core.kv.store.tiers[-1]
    assert disk.stats.write_errors > 0 and len(disk) > 0  # half failed, half landed
    assert not list(tmp_path.rglob("*.tmp*"))  # no half-written file left behind
    assert_idle(engine)


@pytest.mark.parametrize("how", ["corrupt", "EIO"])
def test_bad_disk_reads_are_recomputed(tiny_llama_dir, tmp_path, alone, inject, how):
    first = llm(tiny_llama_dir, num_kv_blocks=400, kv_cache_dir=str(tmp_path),
                kv_cache_write_policy="write-through")
    first.generate(prompts(), PARAMS[0])
    first.close()
    inject(disk_read=how)
    engine = llm(tiny_llama_dir, num_kv_blocks=400, kv_cache_dir=str(tmp_path))
    assert len(engine.engine.local_core.kv.store.tiers[-1]) > 0  # the index found the blocks
    for (i, j), want in alone.items():
        assert engine.generate([prompts()[i]], PARAMS[j])[0].outputs[0].token_ids == want
    store = engine.engine.local_core.kv.store
    assert store.stats.loads.get("disk", 0) == 0
    if how == "corrupt":
        assert store.tiers[-1].stats.corrupt_dropped > 0
    assert_idle(engine)


def test_one_failing_request_leaves_the_others(tiny_llama_dir, alone, inject):
    inject(request_error="fault-")
    engine = llm(tiny_llama_dir, num_kv_blocks=400)
    ids = [f"fault-{k}" if k in (3, 8) else f"r{k}" for k in range(len(_pairs()))]
    final = run_batch(engine, ids)
    for rid, pair in zip(ids, _pairs(), strict=True):
        if rid.startswith("fault-"):
            assert final[rid].error and "injected failure" in final[rid].error
        else:
            assert final[rid].error is None
            assert final[rid].outputs[0].token_ids == alone[pair]
    assert_idle(engine)


@pytest.mark.parametrize("chunk", [64, 16])
def test_a_failing_step_fails_only_the_request_that_fails_alone(tiny_llama_dir, alone, inject,
                                                              chunk):
    """The step holding the bad request raises whoever is in it; its other requests are
    retried one per step and finish with their own tokens."""
    inject(step_error="fault-")
    engine = llm(tiny_llama_dir, num_kv_blocks=400, max_num_batched_tokens=chunk)
    ids = [f"fault-{k}" if k == 5 else f"r{k}" for k in range(len(_pairs()))]
    final = run_batch(engine, ids)
    assert "injected failure of a model step" in final["fault-5"].error
    for rid, pair in zip(ids, _pairs(), strict=True):
        if rid != "fault-5":
            assert final[rid].error is None, final[rid].error
            assert final[rid].outputs[0].token_ids == alone[pair]
    assert_idle(engine)
    # the engine is whole afterwards: the same batch without the bad id serves everyone
    final = run_batch(engine, [f"again{k}" for k in range(len(_pairs()))])
    assert all(final[f"again{k}"].outputs[0].token_ids == alone[p]
               for k, p in enumerate(_pairs()))


def test_a_step_that_always_fails_fails_every_request_and_stops(tiny_llama_dir, inject):
    inject(step_error="")  # every step raises
    engine = llm(tiny_llama_dir, num_kv_blocks=400)
    final = run_batch(engine, [f"r{k}" for k in range(len(_pairs()))])
    assert len(final) == len(_pairs()) and all(o.error for o in final.values())
    assert_idle(engine)


def test_slow_steps_change_nothing_but_time(tiny_llama_dir, alone, inject):
    inject(slow_step_s=0.01, slow_every=3)
    engine = llm(tiny_llama_dir, num_kv_blocks=400)
    final = run_batch(engine, [f"r{k}" for k in range(len(_pairs()))])
    assert all(final[f"r{k}"].outputs[0].token_ids == alone[p]
               for k, p in enumerate(_pairs()))


# ------------------------------------------------------------- containment of the disk tier

SHAPE = (2, 2, 1, 4, 3)


def _key(i: int) -> BlockKey:
    return BlockKey(1000 + i, 0, (i, i + 1, i + 2, i + 3))


def test_disk_entries_never_escape_their_directory(tmp_path):
    """Links planted in the cache directory, at a block's name or at the name its temporary
    file will get, are neither read nor written through; nothing outside changes."""
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    root = tmp_path / "cache"
    disk = DiskTier(root, "fp", SHAPE, torch.float32, 1 << 20)
    a, b = _key(1), _key(2)
    payload = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).view(SHAPE)
    disk.put(a, payload)
    entry = disk._path(a.block_hash)
    assert entry.parent == disk.dir and entry.is_file()

    # a link at b's temporary name, and one in place of a's entry
    (disk._path(b.block_hash).with_suffix(f".tmp{os.getpid()}")).symlink_to(outside)
    entry.unlink()
    entry.symlink_to(outside)
    assert disk.get(a) is None  # a link is not read as a block (and is dropped)
    disk.put(b, payload)
    assert torch.equal(disk.get(b), payload)
    assert outside.read_text() == "precious"

    # at start-up: links, dangling links and directories named like entries are skipped
    (disk.dir / f"{3:032x}.kvb").symlink_to(outside)
    (disk.dir / f"{4:032x}.kvb").symlink_to(tmp_path / "missing")
    (disk.dir / f"{5:032x}.kvb").mkdir()
    (disk.dir / "junk.tmp123").symlink_to(outside)
    again = DiskTier(root, "fp", SHAPE, torch.float32, 1 << 20)
    assert len(again) == 1 and torch.equal(again.get(b), payload)
    assert outside.read_text() == "precious"
    assert all(p.resolve().is_relative_to(disk.dir.resolve()) for p in disk.dir.iterdir()
               if not p.is_symlink())
