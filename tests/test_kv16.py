"""A 16-bit KV cache under float32 activations (K/V stored as float16 or bf16): rounded on the
way in as torch's .to() rounds, widened exactly on the way out, so each row the kernel
computes is bit for bit the float32 kernel's on the rounded values. `--kv-cache-dtype auto`
picks float16 where that kernel runs (AVX2), which halves a token's K/V bytes.

The torch path on the same caches, and batch invariance with every storage the kernel reads,
are checked with the other storages in test_kernels (ATTENTION_CASES); requests independent
of their batch in test_determinism."""

from __future__ import annotations

import pytest
import torch

from kvserve import kernels
from kvserve.attention.kv_quant import kv_storage_dtype
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.config import resolve_dtype, resolve_kv_cache_dtype
from kvserve.engine.llm import LLM
from kvserve.entrypoints import cli
from kvserve.kv_cache.planner import capacity_gain, kv_bytes_per_token, kv_token_bytes, plan_kv
from kvserve.models.hf_dir import hf_model_config
from tests.test_kernels import _paged_case
from tests.test_kv_int8 import SMOLLM2

KV16 = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CPU = torch.device("cpu")
SPANS = [(37, 37), (21, 150), (1, 40), (1, 1), (70, 83), (3, 20)]  # chunks, decodes, drafts


def _kernel_or_skip(kernel_build, kv: str) -> None:
    """Run on a kernel build that reads a `kv` cache under float32 activations (AVX2's)."""
    kernel_build(lambda: TorchPagedAttention(4, 2, 64, kv).ops_for(torch.float32, CPU)
                 is not None, f"paged_attention for a {kv} cache under float32 (AVX2)")


def _special_values(narrow: torch.dtype) -> torch.Tensor:
    """Float32 values where rounding to `narrow` is delicate: ties either way, overflow to
    infinity, the subnormals, signed zeros and infinities."""
    info = torch.finfo(narrow)
    ulp1 = info.eps  # spacing of `narrow` at 1
    one = [1 + ulp1 / 2, 1 + 3 * ulp1 / 2, 1 + ulp1 / 2 * (1 + 2**-10), 1 - ulp1 / 4]
    tiny = [info.tiny, info.tiny / 2, info.tiny * 0.75, info.tiny * 2**-9, 1e-30, 1e-45]
    top = [info.max, info.max * (1 + ulp1 / 4), info.max * (1 + ulp1 / 2), 3e38]
    vals = [0.0, -0.0, float("inf"), float("-inf"), *one, *tiny, *top]
    return torch.tensor(vals + [-v for v in vals])


@pytest.mark.parametrize("kv", KV16)
def test_store_kv_rounds_as_torch_does(kernel_build, kv):
    """store_kv's rounding to a 16-bit cache is torch's .to() bit for bit (nearest even),
    over random values of every magnitude and the special cases, in the 8-wide vectors and
    the scalar tail alike; a NaN stays a NaN."""
    _kernel_or_skip(kernel_build, kv)
    narrow = KV16[kv]
    g = torch.Generator().manual_seed(3)
    t, hkv, d = 64, 2, 40  # 40 = 5 vectors of 8 values; 20-value rows below leave a tail
    mags = 10.0 ** torch.randint(-12, 12, (t, 2 * hkv, d), generator=g).float()
    qkv = torch.randn(t, 2 * hkv, d, generator=g) * mags
    special = _special_values(narrow)
    qkv.view(-1)[:special.numel()] = special
    qkv.view(-1)[-3:] = float("nan")
    k, v = qkv.narrow(1, 0, hkv), qkv.narrow(1, hkv, hkv)  # views, as in a layer
    for width in (d, 20):
        kk, vv = k[..., :width], v[..., :width]
        cache = torch.zeros(2, hkv, t + 5, width, dtype=narrow)
        slots = torch.randperm(t + 5, generator=g)[:t]
        kernels.ops().store_kv(cache, slots, kk, vv)
        want = torch.zeros_like(cache)
        want.index_copy_(2, slots, torch.stack((kk, vv)).to(narrow).transpose(1, 2))
        nan = want.isnan()
        assert torch.equal(cache.isnan(), nan)
        assert torch.equal(cache.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("kv", KV16)
@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [
    (16, 4, 2, 4), (64, 9, 3, 16), (128, 8, 2, 16), (80, 4, 4, 16)])
@pytest.mark.parametrize("window", [0, 23])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_is_the_float32_kernel_on_the_rounded_values(kernel_build, kv, head_dim, heads,
                                                            kv_heads, block_size, window,
                                                            threads):
    """Every row (packed chunks, decodes read straight from the cache) equals the float32
    kernel's on a float32 cache holding the same values: the widening is exact and the
    arithmetic after it is the same."""
    _kernel_or_skip(kernel_build, kv)
    backend, q, _, _, cache, meta, _ = _paged_case(torch.float32, SPANS, block_size, heads,
                                                   kv_heads, head_dim, kv)
    assert cache.dtype == KV16[kv]
    ops = kernels.ops()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        narrow = ops.paged_attention(q, cache, meta.seqs, meta.tables, block_size,
                                     backend.scale, window)
        wide = ops.paged_attention(q, cache.float(), meta.seqs, meta.tables, block_size,
                                   backend.scale, window)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(narrow, wide)


def _reference(q: torch.Tensor, cache: torch.Tensor, spans, tables, block_size: int,
               scale: float, window: int) -> torch.Tensor:
    """Attention in float64 on the values the cache holds: row by row, each query at its
    position seeing its keys through the block table."""
    heads, kv_heads = q.shape[1], cache.shape[1]
    out, row = [], 0
    for (n, ctx), table in zip(spans, tables, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(ctx)])
        k, v = (cache[i][:, slots].double() for i in (0, 1))  # [Hkv, ctx, D]
        k = k.repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        for i in range(n):
            pos = ctx - n + i
            lo = max(0, pos - window + 1) if window else 0
            s = torch.einsum("hd,hkd->hk", q[row].double(), k[:, lo:pos + 1]) * scale
            out.append(torch.einsum("hk,hkd->hd", s.softmax(-1), v[:, lo:pos + 1]))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("kv", KV16)
@pytest.mark.parametrize("window", [0, 23])
def test_kernel_matches_a_float64_reference_on_the_rounded_values(kernel_build, kv, window):
    _kernel_or_skip(kernel_build, kv)
    backend, q, _, _, cache, meta, tables = _paged_case(torch.float32, SPANS, 16, 9, 3, 64, kv)
    got = kernels.ops().paged_attention(q, cache, meta.seqs, meta.tables, 16, backend.scale,
                                        window)
    want = _reference(q, cache, SPANS, tables, 16, backend.scale, window)
    # float32 sums over <= 150 keys and exp within ~2 ulp: measured <= 1.1e-6 here
    torch.testing.assert_close(got.double(), want, atol=4e-6, rtol=1e-5)


def test_auto_is_16_bit_where_the_kernel_reads_it():
    """--kv-cache-dtype auto: float16 under float32 activations where the CPU kernel reads a
    float16 cache (the AVX2 build), the compute dtype everywhere else, and float32 when
    float32 is asked for by name."""
    fast = kernels.attention_kernels(torch.float32, CPU, 64, torch.float16) is not None
    assert kernels.kv_cache_dtype_for("auto", torch.float32, CPU, 64) == \
        ("float16" if fast else "auto")
    assert fast == (kernels.isa() == "AVX2")  # which of the two this machine ran
    for dtype, device, head_dim in ((torch.bfloat16, CPU, 64), (torch.float32, "meta", 64),
                                    (torch.float32, CPU, 24)):
        assert kernels.kv_cache_dtype_for("auto", dtype, device, head_dim) == "auto"
    for name in ("float32", "bfloat16", "float16", "int8"):
        assert kernels.kv_cache_dtype_for(name, torch.float32, CPU, 64) == name
    assert resolve_kv_cache_dtype("auto", "float32") == "float32"
    assert resolve_kv_cache_dtype("auto", torch.float32) == "float32"
    assert resolve_kv_cache_dtype("auto", "auto") == "auto"
    assert resolve_kv_cache_dtype("int8", "float32") == "int8"


def test_a_16_bit_cache_needs_float32_or_its_own_activations(tiny_llama_dir):
    assert kv_storage_dtype("float16", torch.float32) == torch.float16
    assert kv_storage_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("float32", torch.float32) == torch.float32
    with pytest.raises(ValueError, match="a float16 KV cache needs float32 or float16 "
                                         "activations, not bfloat16"):
        kv_storage_dtype("float16", torch.bfloat16)
    with pytest.raises(ValueError, match="a float32 KV cache needs float32 activations"):
        kv_storage_dtype("float32", torch.bfloat16)
    with pytest.raises(ValueError, match="a float16 KV cache needs"):
        LLM(str(tiny_llama_dir), dtype="bfloat16", kv_cache_dtype="float16")


def test_a_16_bit_token_takes_half_the_bytes_of_float32():
    """SmolLM2-135M: 46080 B of float32 K/V per token, 23040 B in float16 or bf16."""
    for kv in KV16:
        assert kv_bytes_per_token(SMOLLM2, kv, torch.float32) == 23040
        assert kv_bytes_per_token(SMOLLM2, "auto", torch.float32) == 2 * 23040
        assert capacity_gain(SMOLLM2, kv, torch.float32) == 2.0
    assert kv_token_bytes(SMOLLM2, "float16", torch.float32).breakdown() == (
        "30 layers x 2 (K,V) x 3 KV heads x 64 x 2 B = 23040 B")


def test_engine_default_cache(tiny_llama_dir):
    """The engine with every default (--dtype auto) stores float16 K/V where the kernel
    reads them, with the blocks its budget then holds; --dtype float32 keeps float32."""
    cfg = hf_model_config(tiny_llama_dir)
    compute = resolve_dtype("auto", CPU)
    picked = kernels.kv_cache_dtype_for("auto", compute, CPU, cfg.head_dim)
    engine = LLM(str(tiny_llama_dir), kv_cache_memory="1MiB").engine
    assert engine.config.cache.kv_cache_dtype == picked
    want = kv_storage_dtype(picked, compute)
    assert all(c.dtype == want for c in engine.local_core.runner.kv_caches)
    planned = plan_kv(cfg, 1 << 20, 16, picked, compute, 64).num_blocks
    assert engine.local_core.runner.num_blocks == planned
    exact = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="1MiB").engine
    assert exact.config.cache.kv_cache_dtype == "float32"
    assert all(c.dtype == torch.float32 for c in exact.local_core.runner.kv_caches)
    if picked == "float16":
        assert engine.local_core.runner.num_blocks == 2 * exact.runner.num_blocks


def test_a_16_bit_cache_serves_requests_like_float32(tiny_llama_dir):
    """Greedy runs on a float16 cache follow the float32 cache's (float16 keeps 11 bits of
    each value: measured, all 12 runs the same 24 tokens, first logprobs within 0.0011); bf16
    keeps 8, about int8's error (measured 21.4 of 24 tokens before the first difference on
    average, against int8's 19.7; first logprobs within 0.018). On the kernel where it runs,
    on torch's path elsewhere."""
    from kvserve.sample.sampling_params import SamplingParams
    from tests.test_engine import random_prompts

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = random_prompts(12)
    runs = {kv: [o.outputs[0] for o in LLM(
        str(tiny_llama_dir), dtype="float32", block_size=4, num_kv_blocks=256,
        kv_cache_dtype=kv).generate(prompts, greedy)] for kv in ("float32", *KV16)}
    for kv, mean_prefix, logprob_tol in (("float16", 24, 0.005), ("bfloat16", 18, 0.05)):
        pairs = list(zip(runs[kv], runs["float32"], strict=True))
        prefix = [next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids,
                                                         strict=True)) if a != b), 24)
                  for x, y in pairs]
        assert sum(prefix) / len(prefix) >= mean_prefix, (kv, prefix)
        first = [abs(x.logprobs[0].logprob - y.logprobs[0].logprob) for x, y in pairs]
        assert max(first) < logprob_tol, (kv, first)


def test_plan_cli_reports_the_16_bit_cache(tiny_llama_dir, capsys):
    """`kvserve plan` lists float16 beside float32 and int8 under float32 activations, and
    says what auto stores here."""
    assert cli.main(["plan", "--model", str(tiny_llama_dir), "--kv-cache-memory", "1MiB",
                     "--dtype", "auto", "--prompt-len", "40", "--output-len", "8"]) == 0
    out = capsys.readouterr().out
    compute = resolve_dtype("auto", CPU)
    if compute != torch.float32:
        pytest.skip("--dtype auto is not float32 on this CPU")
    # 2 layers x 2 x 2 KV heads x 16 x 2 B = 256 B against float32's 512 B
    assert "2 layers x 2 (K,V) x 2 KV heads x 16 x 2 B = 256 B per token" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("float32 ", "float16 ")) and line.split()[1].isdigit()}
    assert rows["float32"][1:4] == ["512", "128", "2048"]
    assert rows["float16"][1:4] == ["256", "256", "4096"]
    assert "float16 holds 2.00x the tokens of float32" in out
    picked = kernels.kv_cache_dtype_for("auto", torch.float32, CPU, 16)
    assert f"--kv-cache-dtype auto: {'float16' if picked == 'float16' else 'float32'} here" \
        in out
    assert cli.main(["plan", "--model", str(tiny_llama_dir), "--dtype", "float32",
                     "--prompt-len", "40", "--output-len", "8"]) == 0
    assert "--kv-cache-dtype auto: float32 here (float32 asked for by name" in \
        capsys.readouterr().out


@pytest.mark.real_model
def test_plan_cli_on_the_default_model_halves_the_bytes(real_model_path, capsys):
    assert cli.main(["plan", "--dtype", "auto"]) == 0
    out = capsys.readouterr().out
    if resolve_dtype("auto", CPU) != torch.float32:
        pytest.skip("--dtype auto is not float32 on this CPU")
    assert "= 46080 B per token" in out and "x 64 x 2 B = 23040 B per token" in out
    assert "float16 holds 2.00x the tokens of float32" in out
