"""The C++ decode-attention kernel against the torch path it replaces for small batches."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvserve.attention import cpu_ops
from kvserve.attention.backend import AttentionBatch
from kvserve.attention.torch_paged import TorchPagedAttention

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def test_kernel_builds():
    assert cpu_ops.ops() is not None


def _torch_path(monkeypatch, compute):
    """compute() with the C++ kernels switched off (KVSERVE_NO_CPP), as on a machine
    without them: the reference the kernels are checked against."""
    monkeypatch.setenv("KVSERVE_NO_CPP", "1")
    cpu_ops.ops.cache_clear()
    try:
        return compute()
    finally:
        cpu_ops.ops.cache_clear()


def _decode_case(dtype, lens, block_size=4, heads=6, kv_heads=2, head_dim=32, seed=0,
                 shared=0):
    """Random paged decode inputs; the first `shared` blocks of every sequence are the same
    blocks (a cached prefix), each sequence writing its new token past them."""
    g = torch.Generator().manual_seed(seed)
    backend = TorchPagedAttention(heads, kv_heads, head_dim)
    num_blocks = 64
    cache = torch.randn(backend.kv_cache_shape(num_blocks * block_size), generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], shared
    for n in lens:
        nb = -(-n // block_size) - shared
        tables.append(perm[:shared] + perm[used:used + nb])
        used += nb
    # One new decode token per sequence, at position len - 1.
    slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                          for t, n in zip(tables, lens, strict=True)])
    meta = backend.build_metadata(AttentionBatch([1] * len(lens), list(lens), tables, slots,
                                                 block_size))
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    k = torch.randn(len(lens), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(len(lens), kv_heads, head_dim, generator=g).to(dtype)
    return backend, q, k, v, cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "shared"), [
    ([1], 0), ([5], 0), ([17, 3], 0), ([4, 8, 12, 30], 0),
    ([30, 9, 21, 13, 40], 2), ([13, 14, 15, 16, 17, 18, 19, 20, 21], 3)])
def test_kernel_matches_torch_path(monkeypatch, dtype, lens, shared):
    backend, q, k, v, cache, meta = _decode_case(dtype, lens, shared=shared)
    fast = backend.forward(q, k, v, cache.clone(), meta)
    slow = _torch_path(monkeypatch, lambda: backend.forward(q, k, v, cache.clone(), meta))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast.float(), slow.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("lens", "shared"), [
    ([1], 0), ([100], 0), ([47, 16, 33], 0), ([40, 17, 64, 49, 90, 33, 20, 65, 81], 1)])
def test_kernel_matches_torch_path_at_model_shapes(monkeypatch, dtype, head_dim, lens, shared):
    """Blocks of 16 and head dims 64/128, where the kernel's vectorized paths (16 scores at a
    time, P.V in registers) run, with whole and partial blocks."""
    backend, q, k, v, cache, meta = _decode_case(dtype, lens, block_size=16, heads=9,
                                                 kv_heads=3, head_dim=head_dim, shared=shared)
    fast = backend.forward(q, k, v, cache.clone(), meta)
    slow = _torch_path(monkeypatch, lambda: backend.forward(q, k, v, cache.clone(), meta))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast.float(), slow.float(), atol=tol, rtol=tol)


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


def _paged_model(path, dtype: torch.dtype, quantization: str):
    """A tiny model from `path` on the torch paged backend, its weights quantized as asked."""
    from kvserve.models.loader import load_model

    model = load_model(path, dtype, torch.device("cpu"),
                       lambda c: TorchPagedAttention(c.num_heads, c.num_kv_heads,
                                                     c.head_dim)).model
    if quantization != "none":
        model.quantize_(quantization)
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: qkv bias, tied embeddings
@pytest.mark.parametrize("dtype,quantization", [(torch.float32, "none"),
                                                (torch.bfloat16, "none"),
                                                (torch.bfloat16, "int8"),
                                                (torch.bfloat16, "int4")])
@pytest.mark.parametrize("batch", [1, 3, 12])  # 12 rows: past SMALL_BATCH, the plain weights
def test_fused_decode_layers_equal_the_modules(tmp_path, arch, dtype, quantization, batch):
    """A decode-only step through the C++ run_layers gives exactly the hidden states (and
    K/V) of the Python modules: the same ATen calls in the same order."""
    from kvserve.worker.model_runner import ForwardItem, allocate_kv_caches, run_forward
    from tests.conftest import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch, tie=arch == "qwen2")
    model = _paged_model(path, dtype, quantization)
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


def _has_prefill_kernel() -> bool:
    kernels = cpu_ops.ops()
    return kernels is not None and kernels.has_prefill_attention()


@pytest.mark.skipif(not _has_prefill_kernel(), reason="prefill_attention needs AVX512-BF16")
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_fused_layers_with_prompt_work_equal_the_modules(tmp_path, quantization):
    """A step with prompt work through the C++ run_layers gives exactly the hidden states and
    K/V of the Python modules. The step holds a decode row, a chunk after cached context, a
    fresh prompt and a verification of drafts (several rows attended as decode rows)."""
    from kvserve.worker.model_runner import ForwardItem, allocate_kv_caches, run_forward
    from tests.conftest import build_tiny_model

    # head_dim 32: the prefill kernel's smallest
    path = build_tiny_model(tmp_path, "llama", hidden_size=128, num_heads=4, num_kv_heads=2)
    model = _paged_model(path, torch.bfloat16, quantization)
    bs, g = 4, torch.Generator().manual_seed(2)
    caches = allocate_kv_caches(model, 64 * bs, torch.bfloat16, torch.device("cpu"))
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
    assert len(meta.prefills) == 2 and backend.fused_inputs(meta, torch.bfloat16) is not None
    _assert_fused_equals_modules(model, caches, bs, step)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(32, 6, 2), (64, 9, 3), (64, 4, 4)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_attention_kernel_matches_sdpa(monkeypatch, head_dim, heads, kv_heads,
                                               block_size):
    """A batch of prompt chunks (with and without cached context, lengths not multiples of
    16) next to decode rows: the bf16 C++ prefill attention agrees with the SDPA path."""
    if not _has_prefill_kernel():
        pytest.skip("prefill_attention needs AVX512-BF16")
    g = torch.Generator().manual_seed(head_dim + block_size)
    backend = TorchPagedAttention(heads, kv_heads, head_dim)
    num_blocks = 256
    cache = torch.randn(backend.kv_cache_shape(num_blocks * block_size),
                        generator=g).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # (new tokens, context length): a whole prompt, a chunk after context, a decode row, a
    # one-token prompt (a decode row too), a long chunk after a short context.
    spans = [(37, 37), (21, 150), (1, 40), (1, 1), (70, 83)]
    tables, slots, used = [], [], 0
    for q, ctx in spans:
        nb = -(-ctx // block_size)
        table = perm[used:used + nb]
        used += nb
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx - q, ctx)]
    meta = backend.build_metadata(AttentionBatch([q for q, _ in spans], [c for _, c in spans],
                                                 tables, torch.tensor(slots), block_size))
    assert len(meta.prefills) == 3
    n = sum(q for q, _ in spans)
    q, k, v = (torch.randn(n, h, head_dim, generator=g).to(torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    assert backend._prefill_kernels(q.dtype, cache.device) is not None
    fast = backend.forward(q, k, v, cache.clone(), meta)
    slow = _torch_path(monkeypatch, lambda: backend.forward(q, k, v, cache.clone(), meta))
    torch.testing.assert_close(fast.float(), slow.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_index_copy_writes(dtype):
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 3, 64, 32, generator=g).to(dtype)
    qkv = torch.randn(7, 12, 32, generator=g).to(dtype)  # k and v are views, as in a layer
    k, v = qkv.narrow(1, 6, 3), qkv.narrow(1, 9, 3)
    slots = torch.randperm(64, generator=g)[:7]
    want = cache.clone()
    want.index_copy_(2, slots, torch.stack((k, v)).transpose(1, 2))
    cpu_ops.ops().store_kv(cache, slots, k, v)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ops.ops().store_kv(cache, torch.tensor([64] * 7), k, v)


def test_kernels_release_the_gil():
    """A long kernel call must leave the interpreter free: the server's event loop streams
    tokens and takes requests while the engine thread is inside a step. The main thread
    spins while a worker makes one long call; with the GIL held through the call, the
    main thread's longest pause would be the whole call."""
    import itertools
    import sys
    import threading
    import time

    ops = cpu_ops.ops()
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, ctx, block = 32, 128, 2, 64, 2048, 16
    cache = torch.randn(2, kv_heads, batch * ctx, dim, generator=g)
    q = torch.randn(batch, heads, dim, generator=g)
    tables = torch.arange(batch * ctx // block).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.long)
    span: list[float] = []

    def call():
        span.append(time.perf_counter())
        ops.decode_attention(q, cache, tables, lens, block, dim ** -0.5)
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
