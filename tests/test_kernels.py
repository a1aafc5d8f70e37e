"""The C++ kernels: each agrees with the torch path it replaces, and each is batch-invariant
(a row's result, bit for bit, is the same alone, in a batch of any size, in a prompt chunk or
as a decode row, packed or read straight from the cache)."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import kernels
from kvserve.attention.backend import AttentionBatch
from kvserve.attention.kv_quant import quantize_int8
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.kernels import build_spec
from kvserve.layers.quant import DenseWeight, QuantizedWeight

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def test_kernel_builds():
    assert kernels.ops() is not None


def _torch_path(monkeypatch, compute):
    """compute() with the C++ kernels switched off (KVSERVE_NO_CPP), as on a machine
    without them: the reference the kernels are checked against."""
    monkeypatch.setenv("KVSERVE_NO_CPP", "1")
    kernels.ops.cache_clear()
    try:
        return compute()
    finally:
        monkeypatch.delenv("KVSERVE_NO_CPP")
        kernels.ops.cache_clear()


def _attention_or_skip(kernel_build, dtype: torch.dtype, kv: str = "auto") -> None:
    """Run on a kernel build with paged_attention for `dtype` activations and a `kv` cache
    (conftest's kernel_build)."""
    backend = TorchPagedAttention(4, 2, 64, kv)
    kernel_build(lambda: backend.ops_for(dtype, torch.device("cpu")) is not None,
                 f"paged_attention for {dtype} activations and a {kv} cache")


# (activations, KV storage) pairs the kernels serve somewhere: the compute dtype, int8, and
# 16-bit K/V under float32 activations (AVX2).
ATTENTION_CASES = [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.bfloat16, "int8"),
                   (torch.float32, "int8"), (torch.float32, "float16"),
                   (torch.float32, "bfloat16")]


def _attention_cases_here() -> list[tuple[str, torch.dtype, str]]:
    """Every (kernel build, activations, K/V storage) of ATTENTION_CASES that a build this
    CPU runs has a paged_attention kernel for: the served build's, and the AVX2-only ones
    (16-bit K/V under float32) through the avx2 build on an AVX-512 CPU."""
    if kernels.ops() is None:
        return []
    return [(v.name, d, kv) for v in build_spec.runnable() for d, kv in ATTENTION_CASES
            if (m := kernels.build(v)) is not None and m.has_paged_attention(
                d, TorchPagedAttention(4, 2, 64, kv).kv_cache_tensor_dtype(d))]


def _paged_case(dtype, spans, block_size=16, heads=9, kv_heads=3, head_dim=64, kv="auto",
                seed=0, shared=0):
    """Random paged inputs for one step: spans of (new tokens, context length) per sequence,
    their blocks scattered over the pool, the first `shared` blocks the same for every
    sequence (a cached prefix)."""
    g = torch.Generator().manual_seed(seed)
    backend = TorchPagedAttention(heads, kv_heads, head_dim, kv)
    num_blocks = 256
    values = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=g)
    cache = quantize_int8(values) if kv == "int8" else \
        values.to(backend.kv_cache_tensor_dtype(dtype))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, used = [], [], shared
    for q, ctx in spans:
        nb = -(-ctx // block_size) - shared
        table = perm[:shared] + perm[used:used + nb]
        used += nb
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx - q, ctx)]
    meta = backend.build_metadata(AttentionBatch([q for q, _ in spans], [c for _, c in spans],
                                                 tables, torch.tensor(slots), block_size))
    n = sum(q for q, _ in spans)
    q, k, v = (torch.randn(n, h, head_dim, generator=g).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    return backend, q, k, v, cache, meta, tables


@pytest.mark.parametrize("dtype,kv", ATTENTION_CASES)
@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [
    (16, 4, 2, 4), (64, 9, 3, 16), (128, 8, 2, 16), (80, 4, 4, 16)])
@pytest.mark.parametrize("window", [0, 23])
def test_paged_attention_matches_torch_path(monkeypatch, kernel_build, dtype, kv, head_dim,
                                            heads, kv_heads, block_size, window):
    """A step of prompt chunks (with and without cached context, lengths not multiples of
    16), decode rows and a verification, against the torch path (SDPA and the batched
    decode; a 16-bit cache widened on read), with and without a sliding window."""
    _attention_or_skip(kernel_build, dtype, kv)
    spans = [(37, 37), (21, 150), (1, 40), (1, 1), (70, 83), (3, 20)]
    backend, q, k, v, cache, meta, _ = _paged_case(dtype, spans, block_size, heads, kv_heads,
                                                   head_dim, kv)
    fast = backend.forward(q, k, v, cache.clone(), meta, window)
    slow = _torch_path(monkeypatch,
                       lambda: backend.forward(q, k, v, cache.clone(), meta, window))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast.float(), slow.float(), atol=tol, rtol=tol)


def _rows_alone(ops, q, cache, tables, spans, block_size, scale, window=0):
    """Every query row attended on its own, as a one-row sequence (a decode) at its
    position."""
    out, row = [], 0
    for (n, ctx), table in zip(spans, tables, strict=True):
        t = torch.tensor([table])
        for i in range(n):
            seqs = torch.tensor([[0, 1, ctx - n + i + 1]])
            out.append(ops.paged_attention(q[row:row + 1].contiguous(), cache, seqs, t,
                                           block_size, scale, window))
            row += 1
    return torch.cat(out)


# 60 examples: 30 per build on an AVX-512 CPU, where both builds' cases are drawn
@settings(max_examples=60, deadline=None)
@given(data=st.data(), head_dim=st.sampled_from([16, 32, 64]),
       kv_heads=st.sampled_from([1, 2]), block_size=st.sampled_from([4, 16]),
       threads=st.sampled_from([1, 2]), window=st.sampled_from([0, 0, 5, 17, 40]))
def test_paged_attention_rows_are_batch_invariant(data, head_dim, kv_heads, block_size,
                                                  threads, window):
    """Random steps (prompt chunks, decodes, verifications, shared prefixes): each row of
    the step is bit for bit the row attended alone as a decode, and a chunk split anywhere
    gives the same rows. This covers both ways the kernel reads K/V (packed per step for
    long chunks, or straight from the cache for short sequences), every K/V storage the
    kernel serves here, and sliding windows."""
    cases = _attention_cases_here()
    if not cases:
        pytest.skip("paged_attention has no kernel on this CPU")
    build, dtype, kv = data.draw(st.sampled_from(cases))
    spans = data.draw(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)).map(
        lambda t: (t[0], t[0] + t[1])), min_size=1, max_size=5))
    shared = data.draw(st.integers(0, min(c for _, c in spans) // block_size))
    backend, q, _, _, cache, meta, tables = _paged_case(
        dtype, spans, block_size, 4, kv_heads, head_dim, kv,
        seed=data.draw(st.integers(0, 99)), shared=shared)
    ops = kernels.build(next(v for v in build_spec.runnable() if v.name == build))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = ops.paged_attention(q, cache, meta.seqs, meta.tables, block_size, backend.scale,
                                   window)
        alone = _rows_alone(ops, q, cache, tables, spans, block_size, backend.scale, window)
        assert torch.equal(step, alone)
        # The first span's chunk in two pieces, as two steps would compute it.
        n, ctx = spans[0]
        if n > 1:
            cut = data.draw(st.integers(1, n - 1))
            t = meta.tables[:1]
            head = ops.paged_attention(q[:cut].contiguous(), cache,
                                       torch.tensor([[0, cut, ctx - n + cut]]), t,
                                       block_size, backend.scale, window)
            rest = ops.paged_attention(q[cut:n].contiguous(), cache,
                                       torch.tensor([[0, n - cut, ctx]]), t, block_size,
                                       backend.scale, window)
            assert torch.equal(torch.cat([head, rest]), step[:n])
    finally:
        torch.set_num_threads(before)


def test_paged_attention_refuses_bad_tables(kernel_build):
    _attention_or_skip(kernel_build, torch.float32)
    ops = kernels.ops()
    cache = torch.zeros(2, 1, 64, 16)
    q = torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_attention(q, cache, torch.tensor([[0, 2, 5]]), torch.tensor([[0, 99]]), 4, 1.0)
    with pytest.raises(RuntimeError, match="cover the context"):
        ops.paged_attention(q, cache, torch.tensor([[0, 2, 9]]), torch.tensor([[0, 1]]), 4, 1.0)
    with pytest.raises(RuntimeError, match="rows out of range"):
        ops.paged_attention(q, cache, torch.tensor([[1, 2, 5]]), torch.tensor([[0, 1]]), 4, 1.0)


def _linear_forms():
    """(name, dtype, constructor of the packed form) for every form served on this CPU."""
    forms = []
    for dtype in (torch.float32, torch.bfloat16):
        if kernels.dense_kernels(dtype, "cpu", 16, 32) is not None:
            forms.append((f"dense-{dtype}", dtype, DenseWeight))
        for method in ("int4", "int8"):
            forms.append((f"{method}-{dtype}", dtype,
                          lambda w, m=method: QuantizedWeight(w, m)))
    return forms


@pytest.mark.parametrize("name,dtype,make", _linear_forms(), ids=lambda v: v
                         if isinstance(v, str) else "")
@pytest.mark.parametrize("n,k", [(48, 64), (576, 576), (1536, 576), (576, 1536)])
def test_every_weight_form_is_batch_invariant(monkeypatch, name, dtype, make, n, k):
    """Each row of x @ W.T is bit for bit the same at every batch size 1..64 (and 300), on
    kvserve's dense and VNNI kernels and on torch's int4/int8 kernels, and close to the
    float64 product of the weight the form stands for."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    packed = make(w)
    x = torch.randn(300, k, generator=g).to(dtype)
    full = packed.matmul(x)
    alone = torch.cat([packed.matmul(x[i:i + 1]) for i in range(64)])
    assert torch.equal(alone, full[:64])
    for m in (2, 3, 7, 8, 9, 16, 17, 33, 64):
        assert torch.equal(packed.matmul(x[:m]), full[:m])
    ref = x.double() @ w.double().t()
    err = (full.double() - ref).norm() / ref.norm()
    bound = {"dense-torch.float32": 1e-6, "dense-torch.bfloat16": 1e-2}.get(name) or (
        0.2 if name.startswith("int4") else 0.03)
    assert err < bound


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_16_bit_weights_give_the_float32_kernels_results(kernel_build, narrow):
    """A float32 weight whose values are all bf16 (float16) values is stored in 16 bits where
    the kernel reads those with float32 activations, and every row equals the float32 tiles'
    result bit for bit, at every batch size; a weight that is not exact in 16 bits stays
    float32."""
    n, k = 96, 160
    kernel_build(lambda: kernels.dense_half_kernels("cpu", n, k) is not None,
                 "the 16-bit weight kernel (AVX2)")
    g = torch.Generator().manual_seed(5)
    # Random float16 values have 10-bit mantissas: not bf16 ones, so float16 is chosen.
    w = (torch.randn(n, k, generator=g) * 0.05).to(narrow).float()
    half = DenseWeight(w)
    assert half.packed.dtype == narrow
    assert half.nbytes == n * k * 2
    reference = kernels.ops().dense_pack(w)
    x = torch.randn(40, k, generator=g)
    out = half.matmul(x)
    assert torch.equal(out, kernels.ops().dense_linear(x, reference))
    for m in (1, 2, 5, 6, 7, 13, 40):
        assert torch.equal(half.matmul(x[:m]), out[:m])
    w[2, 2] = 1.0 + 2.0**-12  # in neither 16-bit format
    assert DenseWeight(w).packed.dtype == torch.float32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_sums_what_it_quantized(bits, dtype):
    """quant_linear is its formula, y = sum_g d dx sum(q xq) + m dx sum(xq), with x quantized
    per row and group of 32 (dx = absmax / 127, xq = round(x * 127 / absmax)): every code of
    the range (0 and 2^bits - 1 included, where AVX2's saturating byte products would
    overflow if taken naively), every tile half and group, an all-zero group."""
    if kernels.quant_kernels(dtype, "cpu", 16, 32) is None:
        pytest.skip("no int4/int8 kernel on this CPU")
    g = torch.Generator().manual_seed(bits)
    n, k = 48, 128
    q = torch.randint(0, 2**bits, (n, k), generator=g).to(torch.uint8)
    q[0], q[1] = 0, 2**bits - 1
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    x = (torch.randn(5, k, generator=g) * 3).to(dtype)
    x[2, 32:64] = 0
    x[3] = torch.where(torch.arange(k) % 2 == 0, 100.0, -100.0)
    y = kernels.ops().quant_linear(x, kernels.ops().quant_pack(q, d, m, bits))
    xg = x.float().view(5, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    # tensor / tensor: torch computes 127.0 / amax as 127 * (1 / amax), rounded twice
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = (xg * inv).round().double()
    dx = (amax / 127.0).double()
    sums = torch.einsum("rgk,ngk->rng", xq, q.double().view(n, k // 32, 32))
    ref = (sums * d.double() * dx.squeeze(-1)[:, None]
           + m.double() * (dx.squeeze(-1) * xq.sum(-1))[:, None]).sum(-1)
    torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=1e-5 if dtype ==
                               torch.float32 else 1e-2, atol=1e-5)


QUANT_HALVES = "the int8 kernel with scales per 16 inputs (AVX2)"


def has_quant_halves(dtype: torch.dtype) -> bool:
    ops = kernels.quant_kernels(dtype, "cpu", 16, 32)
    return ops is not None and ops.has_quant_halves()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_halves_sum_what_they_hold(kernel_build, dtype):
    """8-bit codes with a scale per 16 inputs (Q6_K's form, AVX2): y = sum_g dx (d_lo sum_lo
    (q - 128) xq + d_hi sum_hi (q - 128) xq), over every code (0 and 255 included), negative
    scales and an all-zero group; quant_pack refuses them asymmetric."""
    kernel_build(lambda: has_quant_halves(dtype), QUANT_HALVES)
    ops = kernels.quant_kernels(dtype, "cpu", 16, 32)
    g = torch.Generator().manual_seed(16)
    n, k = 48, 128
    q = torch.randint(0, 256, (n, k), generator=g).to(torch.uint8)
    q[0], q[1] = 0, 255
    d = ((torch.rand(n, k // 16, generator=g) - 0.3) * 0.02).half().float()
    x = (torch.randn(5, k, generator=g) * 3).to(dtype)
    x[2, 32:64] = 0
    x[3] = torch.where(torch.arange(k) % 2 == 0, 100.0, -100.0)
    packed = ops.quant_pack(q, d, -128 * d, 8)
    assert packed.dtype == torch.int8
    y = ops.quant_linear(x, packed)
    xg = x.float().view(5, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    # tensor / tensor: torch computes 127.0 / amax as 127 * (1 / amax), rounded twice
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = (xg * inv).round().double().view(5, k // 16, 16)
    sums = torch.einsum("rhk,nhk->rnh", xq, (q.double() - 128).view(n, k // 16, 16))
    dx = (amax / 127.0).double().repeat_interleave(2, 1).squeeze(-1)  # [rows, k / 16]
    ref = (sums * d.double() * dx[:, None]).sum(-1)
    torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=1e-5 if dtype ==
                               torch.float32 else 1e-2, atol=1e-5)
    for m in (1, 2, 3, 4, 5):
        assert torch.equal(ops.quant_linear(x[:m], packed), y[:m])
    with pytest.raises(RuntimeError, match="symmetric"):
        ops.quant_pack(q, d, -127 * d, 8)
    with pytest.raises(RuntimeError, match="8-bit codes"):
        ops.quant_pack(q, d, -128 * d, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_quantized_kernels_are_batch_invariant_too(monkeypatch, dtype):
    """Without the VNNI kernel, torch's int4/int8 kernels serve every batch: rows agree too."""
    monkeypatch.setattr(kernels, "quant_kernels", lambda *a: None)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(96, 128, generator=g) * 0.05).to(dtype)
    x = torch.randn(40, 128, generator=g).to(dtype)
    for method in ("int4", "int8"):
        packed = QuantizedWeight(w, method)
        assert packed.kernels is None
        full = packed.matmul(x)
        assert torch.equal(torch.cat([packed.matmul(x[i:i + 1]) for i in range(40)]), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 576), (7, 64), (130, 100)])
def test_rms_norm_kernel_matches_reference(monkeypatch, dtype, rows, cols):
    from kvserve.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(cols, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cols, generator=g))
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    fast = norm(x)
    slow = _torch_path(monkeypatch, lambda: norm(x))
    torch.testing.assert_close(fast, slow)


def _paged_model(path, dtype: torch.dtype, quantization: str, kv: str = "auto"):
    """A tiny model from `path` on the torch paged backend (K/V stored as `kv`), its weights
    quantized as asked."""
    from kvserve.models.loader import load_model

    model = load_model(path, dtype, torch.device("cpu"),
                       lambda c: TorchPagedAttention(c.num_heads, c.num_kv_heads,
                                                     c.head_dim, kv)).model
    model.pack_(quantization)
    return model


def _assert_fused_equals_modules(model, caches: list[torch.Tensor], bs: int, step) -> None:
    """Run `step` through the C++ run_layers and through the modules layer by layer, each on
    its own copy of `caches`: the hidden states and the K/V written must be identical."""
    from kvserve.worker.model_runner import run_forward

    fused_caches = [c.clone() for c in caches]
    fused = run_forward(model, fused_caches, bs, step, torch.device("cpu"))
    model.layers[0].self_attn.backend.fused_inputs = lambda meta, dtype: None  # the modules
    plain = run_forward(model, caches, bs, step, torch.device("cpu"))
    assert torch.equal(fused, plain)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, caches, strict=True))


# qwen2: qkv bias, tied embeddings; qwen3: q/k norms, heads x head_dim wider than hidden;
# mistral: sliding windows; gemma3: windows with their own RoPE, float32 norms around
# attention and MLP, GELU
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"])
# float16: K/V rounded by store_kv, widened by paged_attention, under float32 activations
@pytest.mark.parametrize("dtype,quantization,kv", [(torch.float32, "none", "auto"),
                                                   (torch.float32, "none", "float16"),
                                                   (torch.bfloat16, "none", "auto"),
                                                   (torch.bfloat16, "int8", "auto"),
                                                   (torch.bfloat16, "int4", "auto")])
@pytest.mark.parametrize("batch", [1, 3, 12])
def test_fused_decode_layers_equal_the_modules(tmp_path, kernel_build, arch, dtype, quantization,
                                              kv, batch):
    """A decode-only step through the C++ run_layers gives exactly the hidden states (and
    K/V) of the Python modules: the same ATen calls in the same order."""
    from kvserve.worker.forward import ForwardItem
    from kvserve.worker.model_runner import allocate_kv_caches, run_forward
    from tests.conftest import build_tiny_model

    _attention_or_skip(kernel_build, dtype, kv)
    path = build_tiny_model(tmp_path / arch, arch, tie=arch != "llama")
    model = _paged_model(path, dtype, quantization, kv)
    bs, g = 4, torch.Generator().manual_seed(1)
    caches = allocate_kv_caches(model, 16 * batch * bs, dtype, torch.device("cpu"))
    prompts = [torch.randint(2, 300, (5 + 3 * i,), generator=g).tolist() for i in range(batch)]
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(batch)]
    run_forward(model, caches, bs, [ForwardItem(p, 0, t, 0) for p, t in
                                    zip(prompts, tables, strict=True)], torch.device("cpu"))
    step = [ForwardItem([7 + i], len(p), t, 1)
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    backend = model.layers[0].self_attn.backend
    assert backend.fused_inputs(backend.build_metadata(AttentionBatch(
        [1] * batch, [len(p) + 1 for p in prompts], tables, torch.zeros(batch, dtype=torch.long),
        bs)), dtype) is not None
    _assert_fused_equals_modules(model, caches, bs, step)


# float16: K/V rounded by store_kv, widened by paged_attention, under float32 activations
@pytest.mark.parametrize("dtype,quantization,kv", [(torch.float32, "none", "auto"),
                                                   (torch.float32, "none", "float16"),
                                                   (torch.bfloat16, "none", "auto"),
                                                   (torch.bfloat16, "int8", "auto"),
                                                   (torch.bfloat16, "int4", "auto")])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fused_layers_with_prompt_work_equal_the_modules(tmp_path, kernel_build, dtype,
                                                         quantization, kv, arch):
    """A step with prompt work through the C++ run_layers gives exactly the hidden states and
    K/V of the Python modules. The step holds a decode row, a chunk after cached context, a
    fresh prompt and a verification of drafts."""
    from kvserve.worker.forward import ForwardItem
    from kvserve.worker.model_runner import allocate_kv_caches, run_forward
    from tests.conftest import build_tiny_model

    _attention_or_skip(kernel_build, dtype, kv)
    path = build_tiny_model(tmp_path, arch, hidden_size=128, num_heads=4, num_kv_heads=2,
                            tie=arch == "gemma3")
    model = _paged_model(path, dtype, quantization, kv)
    bs, g = 4, torch.Generator().manual_seed(2)
    caches = allocate_kv_caches(model, 64 * bs, dtype, torch.device("cpu"))
    tokens = lambda n: torch.randint(2, 300, (n,), generator=g).tolist()  # noqa: E731
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(4)]
    context = {0: tokens(9), 1: tokens(21), 3: tokens(14)}
    run_forward(model, caches, bs, [ForwardItem(p, 0, tables[i], 0) for i, p in context.items()],
                torch.device("cpu"))
    step = [ForwardItem(tokens(1), 9, tables[0], 1),  # a decode
            ForwardItem(tokens(13), 21, tables[1], 1),  # a chunk after its cached context
            ForwardItem(tokens(17), 0, tables[2], 1),  # a fresh prompt
            ForwardItem(tokens(3), 14, tables[3], 3)]  # a decode verifying two drafts
    backend = model.layers[0].self_attn.backend
    meta = backend.build_metadata(AttentionBatch(
        [1, 13, 17, 3], [10, 34, 17, 17], tables, torch.zeros(34, dtype=torch.long), bs))
    assert backend.fused_inputs(meta, dtype) is not None
    _assert_fused_equals_modules(model, caches, bs, step)


@pytest.mark.parametrize("dtype,kv_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16), (torch.float32, torch.bfloat16)])
def test_store_kv_writes_what_index_copy_writes(dtype, kv_dtype):
    """Float32 rows into a 16-bit cache: what index_copy_ writes from rows converted with
    .to() (rounded to nearest even); head_dim 36 leaves a tail after the 8-wide vectors."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 3, 64, 36, generator=g).to(kv_dtype)
    qkv = torch.randn(7, 12, 36, generator=g).to(dtype)  # k and v are views, as in a layer
    k, v = qkv.narrow(1, 6, 3), qkv.narrow(1, 9, 3)
    slots = torch.randperm(64, generator=g)[:7]
    want = cache.clone()
    want.index_copy_(2, slots, torch.stack((k, v)).to(kv_dtype).transpose(1, 2))
    kernels.ops().store_kv(cache, slots, k, v)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.ops().store_kv(cache, torch.tensor([64] * 7), k, v)


def test_kernels_release_the_gil():
    """A long kernel call must leave the interpreter free: the server's event loop streams
    tokens and takes requests while the engine thread is inside a step. The main thread
    spins while a worker makes one long call; with the GIL held through the call, the
    main thread's longest pause would be the whole call."""
    import itertools
    import sys
    import threading
    import time

    ops = kernels.ops()
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, ctx, block = 32, 128, 2, 64, 2048, 16
    cache = torch.randn(2, kv_heads, batch * ctx, dim, generator=g)
    q = torch.randn(batch, heads, dim, generator=g)
    tables = torch.arange(batch * ctx // block).view(batch, -1)
    seqs = torch.tensor([[b, 1, ctx] for b in range(batch)])
    span: list[float] = []

    def call():
        span.append(time.perf_counter())
        ops.paged_attention(q, cache, seqs, tables, block, dim ** -0.5)
        span.append(time.perf_counter())

    worker = threading.Thread(target=call)
    turns = [time.perf_counter()]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # hand the GIL back and forth quickly around the call
    try:
        worker.start()
        while worker.is_alive():
            turns.append(time.perf_counter())
        worker.join()
    finally:
        sys.setswitchinterval(switch)
    call_s = span[1] - span[0]
    longest = max(b - a for a, b in itertools.pairwise(turns))
    assert call_s > 0.01
    assert longest < call_s / 2, f"main thread paused {longest:.3f} s in a {call_s:.3f} s call"


# ------------------------------------------------------------------- tensors off the CPU


def test_kernel_choice_and_quantized_copies_refuse_tensors_off_the_cpu():
    """The meta device stands in for a GPU: no kernel is chosen for it, and a quantized copy
    (kvserve's or torch's: both CPU-only) is refused by name rather than attempted."""
    meta = torch.device("meta")
    assert kernels.quant_kernels(torch.float32, meta, 16, 32) is None
    assert kernels.dense_kernels(torch.float32, meta, 16, 32) is None
    assert kernels.attention_kernels(torch.float32, meta, 64) is None
    assert kernels.norm_kernels(torch.float32, meta) is None
    for method in ("int4", "int8"):
        with pytest.raises(ValueError, match="CPU kernels only; this weight is on meta"):
            QuantizedWeight(torch.empty(16, 32, device=meta), method)
    with pytest.raises(ValueError, match="no dense kernel"):
        DenseWeight(torch.empty(16, 32, device=meta))


def test_every_entry_point_refuses_tensors_off_the_cpu():
    """A tensor on another device reaching the C++ kernels is an error naming the entry
    point, never a host read of memory that is not the host's."""
    ops = kernels.ops()
    if ops is None:
        pytest.skip("the C++ kernels did not build here")

    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    long = torch.int64
    calls = {
        "quant_pack": lambda: ops.quant_pack(meta(16, 32, dtype=torch.uint8), meta(16, 1),
                                             meta(16, 1), 4),
        "quant_linear": lambda: ops.quant_linear(meta(1, 32), meta(1, 1, 1, dtype=torch.uint8)),
        "dense_pack": lambda: ops.dense_pack(meta(16, 32)),
        "dense_linear": lambda: ops.dense_linear(meta(1, 32), meta(1, 32, 16)),
        "rms_norm": lambda: ops.rms_norm(meta(1, 32), meta(32), 1e-5),
        "store_kv": lambda: ops.store_kv(meta(2, 1, 4, 16), meta(1, dtype=long),
                                         meta(1, 1, 16), meta(1, 1, 16)),
        "paged_attention": lambda: ops.paged_attention(
            meta(1, 1, 16), meta(2, 1, 4, 16), meta(1, 3, dtype=long), meta(1, 1, dtype=long),
            4, 0.25, 0),
    }
    if ops.has_dense_half():
        calls["dense_pack_half"] = lambda: ops.dense_pack_half(meta(16, 32, dtype=torch.bfloat16))
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name}: CPU tensors only, got one on meta"):
            call()
