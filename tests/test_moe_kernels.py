"""The C++ pieces of a mixture-of-experts layer in run_layers: gguf_grouped (every expert's
rows in one call), moe_route and moe_combine, each against what it replaces bit for bit:
gguf_linear of each expert on its own rows (every path built here), kvserve.models.moe's
route, and the module path's weighted sum. The models' layers through them are compared with
the module path in tests/test_moe.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve import kernels
from kvserve.models.moe import route
from tests.test_gguf_kernels import random_blocks, repack, type_id

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason="C++ kernels unavailable")

NONE = torch.empty(0, dtype=torch.long)


def _experts(kinds: tuple[str, str], n: int, rows: int, cols: int, x8: bool, seed: int
             ) -> list[tuple[list[torch.Tensor], list[int], list[torch.Tensor]]]:
    """`n` random experts, each (parts, types, rows) with two parts of `rows` outputs (gate
    and up, of the two kinds), interleaved where `x8` and the kind has a layout."""
    k = kernels.ops()
    out = []
    for e in range(n):
        parts, types = [], []
        for i, kind in enumerate(kinds):
            raw = torch.from_numpy(random_blocks(kind, rows, cols, seed=seed + 2 * e + i))
            tid = type_id(kind)
            if x8 and k.gguf_repacked_type(tid):
                parts.append(repack(k, raw, tid, cols))
                types.append(k.gguf_repacked_type(tid))
            else:
                parts.append(raw)
                types.append(tid)
        out.append((parts, types, [NONE, NONE]))
    return out


@settings(max_examples=25, deadline=None)
@given(kinds=st.sampled_from([("Q4_K", "Q4_K"), ("Q6_K", "Q4_K"), ("Q8_0", "Q8_0"),
                              ("Q5_K", "Q6_K"), ("Q4_0", "Q5_0"), ("MXFP4", "MXFP4"),
                              ("MXFP4", "IQ4_NL")]),
       x8=st.booleans(), counts=st.lists(st.integers(0, 19), min_size=1, max_size=5),
       bf16=st.booleans(), seed=st.integers(0, 10_000))
@example(kinds=("MXFP4", "IQ4_NL"), x8=True, counts=[3, 0, 6], bf16=False, seed=1)
def test_grouped_rows_are_each_experts_own_linear(kinds, x8, counts, bf16, seed):
    """Row m of gguf_grouped is gguf_linear of row m alone against its expert's matrix, bit
    for bit, on every path built here, whatever the other experts' rows (none included)."""
    k = kernels.ops()
    if sum(counts) == 0:
        counts = [*counts, 1]
    cols, rows = 512, 16
    experts = _experts(kinds, len(counts), rows, cols, x8, seed)
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(offsets[-1], cols, generator=g)
    if bf16:
        x = x.bfloat16()
    parts, types, orders = (list(t) for t in zip(*experts, strict=True))
    got = k.gguf_grouped(x, offsets, parts, types, orders)
    assert got.shape == (offsets[-1], 2 * rows) and got.dtype == x.dtype
    for e, (p, t, o) in enumerate(experts):
        rows_e = x[offsets[e]:offsets[e + 1]]
        if len(rows_e) == 0:
            continue
        assert torch.equal(got[offsets[e]:offsets[e + 1]], k.gguf_linear(rows_e, p, t, o))
        for m in range(min(len(rows_e), 3)):  # one row alone: batch invariance
            assert torch.equal(got[offsets[e] + m], k.gguf_linear(rows_e[m:m + 1], p, t, o)[0])
    for path in k.gguf_paths():
        assert torch.equal(got, k.gguf_grouped(x, offsets, parts, types, orders, path=path))


def test_grouped_refuses_bad_input():
    k = kernels.ops()
    experts = _experts(("Q8_0", "Q8_0"), 2, 16, 256, False, 0)
    parts, types, orders = (list(t) for t in zip(*experts, strict=True))
    x = torch.randn(5, 256)
    with pytest.raises(RuntimeError, match="offsets"):
        k.gguf_grouped(x, [0, 2, 4], parts, types, orders)  # do not end at M
    with pytest.raises(RuntimeError, match="offsets"):
        k.gguf_grouped(x, [0, 5], parts, types, orders)  # one offset short
    with pytest.raises(RuntimeError, match="not decrease"):
        k.gguf_grouped(x, [0, 6, 5], parts, types, orders)
    narrow = _experts(("Q8_0",), 1, 16, 256, False, 1)[0]
    with pytest.raises(RuntimeError, match="same outputs"):
        k.gguf_grouped(x, [0, 2, 5], [parts[0], narrow[0]], [types[0], narrow[1]],
                       [orders[0], [NONE]])
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        k.gguf_grouped(x.half(), [0, 2, 5], parts, types, orders)


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 9), e=st.integers(2, 12), data=st.data(), normalize=st.booleans(),
       ties=st.booleans(), bf16=st.booleans())
def test_route_is_the_modules_route(t, e, data, normalize, ties, bf16):
    """moe_route gives kvserve.models.moe.route's weights and ids bit for bit, ties (equal
    logits) included: the lower expert id first."""
    k = data.draw(st.integers(1, e))
    seed = data.draw(st.integers(0, 1000))
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(-2, 3, (t, e), generator=g).float() if ties
              else torch.randn(t, e, generator=g))
    if bf16:
        logits = logits.bfloat16()
    want_w, want_ids = route(logits, k, normalize)
    got_w, got_ids = kernels.ops().moe_route(logits, k, normalize)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w)


def test_route_ties_pick_the_lower_ids():
    w, ids = kernels.ops().moe_route(torch.zeros(2, 6), 3, True)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert torch.equal(w, torch.full((2, 3), 1 / 3))
    with pytest.raises(RuntimeError, match="k <= E"):
        kernels.ops().moe_route(torch.zeros(2, 6), 7, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_is_the_modules_weighted_sum(dtype):
    """out[t] = sum_j float(y[pos[t, j]]) * w[t, j], in j order from the first product,
    rounded once: the module path's float32 slots summed one at a time."""
    g = torch.Generator().manual_seed(5)
    t, k, h = 7, 3, 96
    y = torch.randn(t * k, h, generator=g).to(dtype)
    pos = torch.randperm(t * k, generator=g).view(t, k)
    w = torch.rand(t, k, generator=g)
    slots = y[pos.flatten()].float() * w.flatten()[:, None]
    slots = slots.view(t, k, h)
    want = slots[:, 0]
    for j in range(1, k):
        want = want + slots[:, j]
    got = kernels.ops().moe_combine(y, pos, w)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.ops().moe_combine(y, pos + t * k, w)
