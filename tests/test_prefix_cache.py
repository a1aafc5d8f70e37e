"""Prefix caching end to end on a tiny model: greedy outputs are the same with and without
it, after blocks went to the host tier, to disk and back, and across a restart."""

from __future__ import annotations

import random

import pytest

from kvserve.engine.llm import LLM
from kvserve.sample.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts(n: int = 6, prefix_len: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 300) for _ in range(prefix_len)]
    return [shared[: prefix_len - 8 * (i % 2)] + [rng.randrange(2, 300) for _ in range(5)]
            for i in range(n)]


def llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    plain = llm(tiny_llama_dir, num_kv_blocks=400, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in plain.generate(prompts(), GREEDY)]


def run_one_by_one(engine: LLM) -> tuple[list[list[int]], list[int]]:
    outs = [engine.generate([p], GREEDY)[0] for p in prompts()]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_device_prefix_hits_keep_outputs(tiny_llama_dir, reference):
    engine = llm(tiny_llama_dir, num_kv_blocks=400)
    tokens, cached = run_one_by_one(engine)
    assert tokens == reference
    assert cached[0] == 0 and all(c >= 28 for c in cached[1:])
    assert engine.engine.local_core.kv.stats.hits["device"] > 0
    # all at once too (hits on blocks registered earlier in the same step)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts(), GREEDY)] == reference


def test_host_and_disk_tiers_keep_outputs_across_restart(tiny_llama_dir, reference, tmp_path):
    # 20 blocks of 4 tokens cannot keep six ~45-token prompts: blocks are evicted to a host
    # tier of 8 blocks, which spills to disk.
    block_bytes = 2 * 2 * 2 * 4 * 16 * 4  # layers x K/V x KV heads x tokens x head dim x fp32
    engine = llm(tiny_llama_dir, num_kv_blocks=20, host_kv_cache_memory=8 * block_bytes,
                 kv_cache_dir=str(tmp_path))
    for _ in range(2):
        tokens, _ = run_one_by_one(engine)
        assert tokens == reference
    hits = engine.engine.local_core.kv.stats.hits
    assert hits["host"] > 0 and hits["disk"] > 0, hits
    engine.engine.check_integrity()
    engine.close()  # flushes to disk

    restarted = llm(tiny_llama_dir, num_kv_blocks=20, kv_cache_dir=str(tmp_path))
    tokens, cached = run_one_by_one(restarted)
    assert tokens == reference
    assert cached[0] >= 28 and restarted.engine.local_core.kv.stats.hits["disk"] > 0


def test_bad_copies_on_disk_are_recomputed(tiny_llama_dir, reference, tmp_path):
    """Blocks whose disk copies were damaged after the engine indexed them are found by the
    scheduler (it reads only the index), fail to load before the step, and are computed
    again: the outputs stay the same and nothing leaks."""
    first = llm(tiny_llama_dir, num_kv_blocks=400, kv_cache_dir=str(tmp_path),
                kv_cache_write_policy="write-through")
    first.generate(prompts(), GREEDY)
    first.close()
    engine = llm(tiny_llama_dir, num_kv_blocks=400, kv_cache_dir=str(tmp_path))
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert files
    for f in files:  # flip a byte of every payload, keeping each file's length
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    outs = [engine.generate([p], GREEDY)[0] for p in prompts()]
    assert [o.outputs[0].token_ids for o in outs] == reference
    events = [e["event"] for o in outs
              for e in engine.engine.request_timeline(o.request_id)["samples"][0]["events"]]
    assert "kv_load_failed" in events
    assert engine.engine.local_core.kv.store.stats.loads.get("disk", 0) == 0
    engine.engine.check_integrity()
    assert engine.engine.local_core.kv.num_free_blocks == engine.engine.local_core.kv.num_blocks


def test_cache_from_another_model_is_not_used(tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    first = llm(tiny_llama_dir, num_kv_blocks=400, kv_cache_dir=str(tmp_path),
                kv_cache_write_policy="write-through")
    first.generate(prompts(), GREEDY)
    other = llm(tiny_qwen2_dir, num_kv_blocks=400, kv_cache_dir=str(tmp_path))
    out = other.generate([prompts()[0]], GREEDY)[0]
    assert out.num_cached_tokens == 0 and not other.engine.local_core.kv.stats.hits
    assert len(list(tmp_path.iterdir())) == 2  # one directory per model fingerprint


def test_salted_requests_do_not_share(tiny_llama_dir):
    engine = llm(tiny_llama_dir, num_kv_blocks=400).engine
    p = prompts()[0]

    def cached(rid: str, salt: str | None) -> int:
        engine.add_request(rid, p, GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            outs = engine.step()
        return outs[-1].num_cached_tokens

    assert cached("a", "alice") == 0
    assert cached("b", "bob") == 0
    assert cached("c", None) == 0
    assert cached("d", "alice") > 0


def test_tiers_need_prefix_caching(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="prefix caching"):
        llm(tiny_llama_dir, num_kv_blocks=64, kv_cache_dir=str(tmp_path),
            enable_prefix_caching=False)
