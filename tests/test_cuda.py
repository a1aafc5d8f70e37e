"""The CUDA suite: the engine, seeded sampling, speculative decoding, the prefix cache with its
pinned host tier, chunking/batching independence and the server, on a GPU.

Every test here runs on the device `--device` names when it is a GPU (cuda:0 otherwise) and
is skipped, with that reason, on a machine without CUDA; `pytest --device cuda` on such a
machine is a usage error (conftest), not a run of skips. The tests that take the `device`
fixture elsewhere (model correctness against transformers, the int8 KV cache) also run on the
GPU under `--device cuda`. scripts/gpu_check.sh runs both.

On a GPU torch's kernels are not batch-invariant (the engine says so at start), so these tests
compare tokens on tiny models whose next-token distributions are peaked (conftest), not bits.

KVSERVE_CUDA_SUITE_DEVICE=cpu runs the same tests on the CPU: a dry run of their logic for a
machine without a GPU, not a GPU result.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.sample.sampling_params import SamplingParams

DRY_RUN = os.environ.get("KVSERVE_CUDA_SUITE_DEVICE")
pytestmark = pytest.mark.skipif(
    DRY_RUN is None and not torch.cuda.is_available(),
    reason="no CUDA device here (torch.cuda.is_available() is False): the CUDA suite runs on "
           "a GPU, `pytest --device cuda` (scripts/gpu_check.sh)")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu(request) -> str:
    if DRY_RUN is not None:
        return DRY_RUN
    named = request.config.getoption("--device")
    return named if named.startswith("cuda") else "cuda"


def prompts(n: int = 5) -> list[list[int]]:
    shared = [(7 * i) % 300 + 2 for i in range(40)]
    return [shared[: 40 - 8 * (i % 2)] + [(31 * i + j) % 300 + 2 for j in range(5)]
            for i in range(n)]


def generate(model, device: str, params=GREEDY, batch: bool = True, **kw) -> list[list[int]]:
    # A fixed budget: the default (--gpu-memory-utilization 0.9) would take most of the GPU
    # for each of the suite's engines in turn.
    kw.setdefault("kv_cache_memory", "1GiB")
    llm = LLM(str(model), dtype="float32", device=device, block_size=4, **kw)
    try:
        if batch:
            outs = llm.generate(prompts(), params)
        else:
            outs = [llm.generate([p], params)[0] for p in prompts()]
        return [list(c.token_ids) for o in outs for c in o.outputs]
    finally:
        llm.close()


def test_engine_runs_on_the_named_device(tiny_llama_dir, gpu):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device=gpu, block_size=4)
    try:
        core = llm.engine
        assert core.config.device.type == torch.device(gpu).type
        if torch.device(gpu).type == "cuda":  # the default budget: 0.9 of the GPU, less use
            free, total = torch.cuda.mem_get_info(torch.device(gpu))
            assert 0.5 * total < core.config.cache.kv_cache_memory < 0.9 * total
        assert all(kv.device.type == torch.device(gpu).type for kv in core.runner.kv_caches)
        if torch.device(gpu).type == "cuda":
            index = torch.device(gpu).index or 0
            assert all(kv.device.index == index for kv in core.runner.kv_caches)
        out = llm.generate([prompts()[0]], GREEDY)[0].outputs[0].token_ids
        assert len(out) == GREEDY.max_tokens
    finally:
        llm.close()


def test_greedy_matches_transformers_on_the_device(tiny_llama_dir, gpu):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).to(gpu)
    expected = []
    for p in prompts():
        ids = torch.tensor([p], device=gpu)
        out = hf.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          min_new_tokens=GREEDY.max_tokens)
        expected.append(out[0, len(p):].tolist())
    assert generate(tiny_llama_dir, gpu) == expected


def test_chunked_and_batched_prompts_give_the_same_tokens(tiny_llama_dir, gpu):
    alone = generate(tiny_llama_dir, gpu, batch=False, enable_prefix_caching=False)
    assert generate(tiny_llama_dir, gpu, max_num_batched_tokens=8,
                    enable_prefix_caching=False) == alone
    assert generate(tiny_llama_dir, gpu, max_num_batched_tokens=512,
                    enable_prefix_caching=False) == alone


def test_seeded_sampling_repeats_and_ignores_the_batch(tiny_llama_dir, gpu):
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)
    batched = generate(tiny_llama_dir, gpu, params)
    assert generate(tiny_llama_dir, gpu, params) == batched
    assert generate(tiny_llama_dir, gpu, params, batch=False) == batched


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    # quantization auto: none on a GPU; every step drafts (not only where it pays)
    {"method": "draft_model", "num_speculative_tokens": 3, "adaptive_depth": False,
     "max_batch_size": 64},
])
def test_speculative_decoding_keeps_greedy_tokens(tiny_llama_dir, gpu, spec):
    import json

    plain = generate(tiny_llama_dir, gpu)
    assert generate(tiny_llama_dir, gpu, speculative_config=json.dumps(spec)) == plain


def test_prefix_hits_from_the_pinned_host_tier_keep_tokens(tiny_llama_dir, gpu):
    """20 pool blocks cannot hold five ~45-token prompts: blocks go to the host tier (pinned,
    filled by asynchronous copies) and come back; the tokens are those without caching."""
    reference = generate(tiny_llama_dir, gpu, batch=False, enable_prefix_caching=False)
    block_bytes = 2 * 2 * 2 * 4 * 16 * 4  # layers x K/V x KV heads x tokens x head dim x fp32
    llm = LLM(str(tiny_llama_dir), dtype="float32", device=gpu, block_size=4,
              num_kv_blocks=20, host_kv_cache_memory=8 * block_bytes)
    try:
        for _ in range(2):
            outs = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts()]
            assert [list(o) for o in outs] == reference
        assert llm.engine.local_core.kv.stats.hits["host"] > 0
        llm.engine.check_integrity()
    finally:
        llm.close()


def test_server_completes_with_the_openai_client(tiny_llama_dir, gpu):
    from tests.server_utils import assert_completion_envelope, openai_client, run_server

    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", device=gpu, block_size=4,
                      kv_cache_memory="1GiB")
    with run_server(args) as (url, _):
        client = openai_client(f"{url}/v1")
        out = client.completions.create(model=client.models.list().data[0].id, prompt="hello",
                                        max_tokens=8, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
        assert out.usage.completion_tokens >= 1
        loose = openai_client(f"{url}/v1", strict=False)  # LOOSE_BECAUSE: completion chunks
        chunks = list(loose.completions.create(model=out.model, prompt="hello", max_tokens=8,
                                               temperature=0, stream=True))
        for c in chunks:
            assert_completion_envelope(c, out.model)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


def test_decode_steps_replay_cuda_graphs(tiny_llama_dir, gpu):
    """On a GPU decode steps replay CUDA graphs by default (worker.cuda_graphs); the tokens
    are those of eager steps (--enforce-eager)."""
    if torch.device(gpu).type != "cuda":
        pytest.skip("CUDA graphs need a GPU (test_cuda_graphs checks their buffers on a CPU)")
    llm = LLM(str(tiny_llama_dir), dtype="float32", device=gpu, block_size=4, max_num_seqs=8,
              kv_cache_memory="1GiB")
    try:
        graphs = llm.engine.local_core.runner.graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
        outs = llm.generate(prompts(), GREEDY)
        assert graphs.replays >= GREEDY.max_tokens - 1
        replayed = [list(c.token_ids) for o in outs for c in o.outputs]
    finally:
        llm.close()
    assert replayed == generate(tiny_llama_dir, gpu, enforce_eager=True)
