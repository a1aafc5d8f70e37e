"""int8 KV cache: the row format, paged attention over it, capacity, and the engine on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvserve.attention.kv_quant import INT8_SCALE_BYTES, dequantize_int8, quantize_int8
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.config import CacheConfig, ModelConfig
from kvserve.engine.llm import LLM
from kvserve.kv_cache.planner import plan_kv
from kvserve.models.loader import load_model
from kvserve.sample.sampling_params import SamplingParams
from tests.test_engine import GREEDY, random_prompts
from tests.test_model import paged_logits

FP16_TINY = torch.finfo(torch.float16).tiny

# SmolLM2-135M's shape, written out so capacity checks need no download.
SMOLLM2 = ModelConfig("llama", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=49152, max_position=8192,
                      tie_word_embeddings=True)


def _scales(rows: torch.Tensor) -> torch.Tensor:
    return rows[..., -INT8_SCALE_BYTES:].view(torch.float16).float()


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(x=arrays(np.float32, st.tuples(st.integers(1, 6), st.sampled_from([2, 16, 64])),
                elements=st.floats(-1, 1, width=32)),
       magnitude=st.sampled_from([0.0, 1e-9, 1e-4, 1e-2, 1.0, 30.0, 1e4]))
def test_round_trip_error_is_within_half_a_step(x, magnitude):
    t = torch.from_numpy(x) * magnitude
    rows = quantize_int8(t)
    assert rows.dtype == torch.int8 and rows.shape == (*t.shape[:-1], t.shape[-1] + 2)
    scale = _scales(rows)
    amax = t.abs().amax(-1, keepdim=True)
    # the scale is absmax / 127 to float16 precision, never below float16's smallest normal
    want = torch.clamp(amax / 127, min=FP16_TINY)
    torch.testing.assert_close(scale, want, rtol=2**-10, atol=0)
    err = (dequantize_int8(rows, torch.float32) - t).abs()
    assert (err <= scale / 2 * (1 + 1e-6)).all()
    assert (err <= amax / 254 * (1 + 2**-10) + FP16_TINY / 2).all()
    # K/V written again from their dequantized values come back unchanged
    assert torch.equal(quantize_int8(dequantize_int8(rows, torch.float32)), rows)


def test_dequantize_into_bfloat16_and_strided_rows():
    x = torch.randn(5, 3, 64) * 4
    rows = quantize_int8(x.to(torch.bfloat16))
    # a gather returns a view over [Hkv, slots, D + 2]; the scale is read in place
    cache = torch.zeros(3, 10, 66, dtype=torch.int8)
    cache.index_copy_(1, torch.tensor([7, 1, 4, 0, 9]), rows.transpose(0, 1))
    back = dequantize_int8(cache[:, [7, 1, 4, 0, 9]], torch.bfloat16).transpose(0, 1)
    assert back.dtype == torch.bfloat16
    step = x.abs().amax(-1, keepdim=True) / 127
    # half a step (of bf16 inputs' slightly larger absmax) plus bfloat16 rounding
    assert ((back.float() - x).abs() <= step / 2 * 1.01 + x.abs() * 2**-7).all()


def _load(path, kv_cache_dtype: str, dtype: torch.dtype, device: str):
    return load_model(path, dtype, torch.device(device), lambda c: TorchPagedAttention(
        c.num_heads, c.num_kv_heads, c.head_dim, kv_cache_dtype)).model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_logits_close_to_the_unquantized_cache(tiny_llama_dir, device, dtype):
    ids = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    exact = paged_logits(_load(tiny_llama_dir, "auto", dtype, device), ids, [37], device)
    model = _load(tiny_llama_dir, "int8", dtype, device)
    results = []
    for chunks in ([37], [1] * 37, [10, 17, 1, 9]):  # whole, token by token, mixed
        got = paged_logits(model, ids, chunks, device)
        results.append(got)
        # this random model has large weights (init 0.2); measured ~2.6% of the logit range
        assert (got - exact).abs().max() < 0.05 * exact.abs().max()
        assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    if dtype == torch.float32:
        # every query sees the K/V the cache holds, so chunking changes the logits only by
        # float rounding, which now and then moves a K/V value to the next int8 step
        # (measured 0.004, against 0.17 for quantization itself)
        for got in results[1:]:
            assert (got - results[0]).abs().max() < 0.02


def test_cache_layout_is_one_int8_tensor_per_layer(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4, num_kv_blocks=32,
              kv_cache_dtype="int8")
    runner = llm.engine.local_core.runner
    assert len(runner.kv_caches) == 2
    for kv in runner.kv_caches:
        assert kv.dtype == torch.int8 and kv.shape == (2, 2, 32 * 4, 16 + 2)
    for kv in runner.kv_caches:  # the start-up calibration's requests wrote slots too
        kv.zero_()
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    kv = runner.kv_caches[0]
    # 5 prompt + 2 fed-back tokens were written, each K and V row with a positive scale
    written = (_scales(kv) > 0).squeeze(-1).all(0).all(0).nonzero().flatten()
    assert len(written) == 7
    # whole token slots copy between tensors (as a tiered store does) with their scales
    copy = torch.zeros_like(kv)
    copy[:, :, written, :] = kv[:, :, written, :]
    assert torch.equal(dequantize_int8(copy[:, :, written], torch.float32),
                       dequantize_int8(kv[:, :, written], torch.float32))


def test_int8_holds_at_least_1_9x_the_blocks_of_bfloat16():
    budget = 1 << 30
    plans = {kv: plan_kv(SMOLLM2, budget, 16, kv, torch.bfloat16, 1024)
             for kv in ("auto", "int8")}
    auto, int8 = plans["auto"], plans["int8"]
    assert (auto.token_bytes.total, int8.token_bytes.total) == (23040, 11880)
    assert (auto.num_blocks, int8.num_blocks) == (2912, 5648)
    assert int8.num_blocks >= 1.9 * auto.num_blocks
    # concurrent 1024-token sequences (64 blocks each)
    assert (auto.max_seqs, int8.max_seqs) == (45, 88)
    assert int8.max_seqs >= 1.9 * auto.max_seqs


def test_engine_blocks_follow_the_kv_dtype(tiny_llama_dir):
    # the tiny model's head_dim of 16 gains 32 / 18 = 1.78x; head_dim 64 gains 1.94x
    blocks = {kv: LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=16,
                      kv_cache_memory="1MiB", kv_cache_dtype=kv).engine.local_core.runner.num_blocks
              for kv in ("auto", "int8")}
    assert blocks == {"auto": (1 << 20) // (16 * 2 * 2 * 2 * 16 * 2),
                      "int8": (1 << 20) // (16 * 2 * 2 * 2 * 18)}


@pytest.mark.slow
def test_engine_batching_and_preemption_with_int8(tiny_llama_dir):
    prompts = random_prompts(12)
    common = dict(dtype="float32", block_size=4, kv_cache_dtype="int8")
    alone_llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=64, **common)
    alone = [alone_llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=50, max_num_batched_tokens=32, **common)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.local_core.scheduler.num_preemptions > 0
    # quantization is per row, so a token's K/V do not depend on the batch it ran in
    assert [o.outputs[0].token_ids for o in outs] == alone
    llm.engine.check_integrity()
    # greedy runs follow the unquantized cache's for a while (measured: 19.7 of 24 tokens
    # on average, 7 of 12 prompts all 24; this random model is touchier than a real one)
    exact = LLM(str(tiny_llama_dir), num_kv_blocks=256, dtype="float32", block_size=4)
    ref = [o.outputs[0].token_ids for o in exact.generate(prompts, GREEDY)]
    prefix = [next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
              for r, g in zip(ref, alone, strict=True)]
    assert min(prefix) >= 1 and sum(prefix) / len(prefix) >= 12


def test_bad_kv_cache_dtype_is_refused_clearly(tiny_llama_dir):
    names = "auto, float32, bfloat16, float16, int8"
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of {names}; got 'fp8'"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of {names}"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="even head_dim"):
        TorchPagedAttention(4, 2, 15, "int8")


@pytest.mark.slow
@pytest.mark.real_model
def test_default_model_with_int8_kv(real_model_path):
    llm = LLM(str(real_model_path), dtype="bfloat16", kv_cache_memory="64MiB",
              kv_cache_dtype="int8")
    assert llm.engine.local_core.runner.num_blocks == plan_kv(
        SMOLLM2, 64 << 20, 16, "int8", torch.bfloat16, 1).num_blocks == 353
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert out.text.startswith(" Paris")
