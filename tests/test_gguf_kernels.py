"""gguf_linear and gguf_rows: the kernels that read a GGUF file's own blocks.

Each type is checked on random blocks against gguf's own dequantization (gguf_rows bit for
bit; gguf_linear against the float matmul of those weights with the activations quantized
as the kernel quantizes them, exactly up to float rounding), every path built for this CPU
(VNNI, AVX2) against the portable one bit for bit (on every machine: the test names the paths
it compared), and rows across batch sizes bit for bit (batch invariance).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from kvserve import kernels

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason="C++ kernels unavailable")

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
         "MXFP4"]
# Byte offsets of the float16 scale fields in each type's block (kept finite and small).
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0],
              "MXFP4": []}
# MXFP4's scale is byte 0, an E8M0 exponent e (2^(e - 128) with its doubled levels): random
# in a range around real weights' (2^-18 .. 2^12), and on one block of each row one of the
# edges where the scale is a float32 subnormal (e = 0, 1) or the smallest normal (e = 2).
MXFP4_EXPONENTS = (110, 141)
MXFP4_EDGES = (0, 1, 2)


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, row bytes] uint8: random codes and scales, every scale a finite float16."""
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[kind]:
        scale = rng.uniform(1e-4, 2e-2, size=raw.shape[:2]).astype(np.float16)
        if off == 2 and kind in ("Q4_1", "Q5_1"):
            scale = -scale * 8  # a minimum: negative, as a real block's usually is
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    if kind == "MXFP4":
        raw[:, :, 0] = rng.integers(*MXFP4_EXPONENTS, size=raw.shape[:2], dtype=np.uint8)
        edge_block = rng.integers(0, raw.shape[1], size=rows)
        raw[np.arange(rows), edge_block, 0] = np.resize(MXFP4_EDGES, rows)
    return raw.reshape(rows, -1)


def gguf_weight(kind: str, raw: np.ndarray, cols: int) -> torch.Tensor:
    w = quants.dequantize(raw, GGMLQuantizationType[kind])
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(raw.shape[0], cols))


def type_id(kind: str) -> int:
    return int(GGMLQuantizationType[kind])


def repack(module, raw: torch.Tensor, tid: int, cols: int,
           order: torch.Tensor | None = None) -> torch.Tensor:
    """`module.gguf_repack` of `raw`'s rows (`order`, or all) into a fresh tensor."""
    order = torch.empty(0, dtype=torch.long) if order is None else order
    rows = order.numel() or raw.shape[0]
    out = torch.empty(rows // 8, 8 * raw.shape[1], dtype=torch.uint8)
    return module.gguf_repack(raw, tid, cols, order, out)


def quantized_x(x: torch.Tensor, block: int) -> torch.Tensor:
    """The activations as the kernel sees them: int8 per `block` inputs, times its scale."""
    m, k = x.shape
    g = x.float().view(m, k // block, block)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv).clamp(-127, 127)
    return (q * (amax / 127)).view(m, k)


@pytest.mark.parametrize("kind", TYPES)
def test_rows_are_gguf_dequantization(kind):
    cols = 512
    raw = random_blocks(kind, 24, cols, seed=1)
    ids = torch.tensor([0, 5, 23, 5, 11])
    got = kernels.ops().gguf_rows(torch.from_numpy(raw), type_id(kind), cols, ids,
                                  torch.float32)
    assert torch.equal(got, gguf_weight(kind, raw, cols)[ids])


def test_mxfp4_every_exponent_and_code_byte_is_gguf_dequantization():
    """MXFP4's scale from each of the 256 exponents (subnormal at 0 and 1, overflowing to inf
    with the largest levels from 253 on) against every code byte, bit for bit as gguf gives
    them: row e has exponent e in all its blocks, and its 16 blocks' 256 code bytes are
    0..255."""
    cols = 16 * 32
    raw = np.zeros((256, 16, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    raw[:, :, 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    raw = raw.reshape(256, -1)
    with np.errstate(over="ignore"):  # 12 x 2^(e - 128) from e = 253 on: inf, as wanted
        want = gguf_weight("MXFP4", raw, cols)
    got = kernels.ops().gguf_rows(torch.from_numpy(raw), type_id("MXFP4"), cols,
                                  torch.arange(256), torch.float32)
    assert torch.equal(got, want)
    # the scales themselves: element 1 is code 1, level 1, so 2^(e - 128) in row e
    scales = np.ldexp(np.float32(1), np.arange(256) - 128).astype(np.float32)
    assert torch.equal(got[:, 1], torch.from_numpy(scales))
    assert got[1, 1].item() == 2.0 ** -127 and got[253:].isinf().any()


@pytest.mark.parametrize("kind", TYPES)
def test_linear_matches_reference_and_portable(kind):
    k = kernels.ops()
    cols, rows = 512, 48
    raw = torch.from_numpy(random_blocks(kind, rows, cols, seed=2))
    w = gguf_weight(kind, raw.numpy(), cols).double()
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(3))
    block = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    ref = quantized_x(x, block).double() @ w.T
    none = [torch.empty(0, dtype=torch.long)]
    native = k.gguf_linear(x, [raw], [type_id(kind)], none)
    print(f"{kind}: paths {k.gguf_paths()} (best {k.gguf_path()}) against portable")
    for path in k.gguf_paths():
        assert torch.equal(k.gguf_linear(x, [raw], [type_id(kind)], none, path=path), native)
    # one activation row against an odd number of weight rows (the VNNI path's two-row
    # kernel for the table types, and its last row alone)
    one = k.gguf_linear(x[:1], [raw[:47]], [type_id(kind)], none)
    assert torch.equal(one, native[:1, :47])
    for path in k.gguf_paths():
        assert torch.equal(k.gguf_linear(x[:1], [raw[:47]], [type_id(kind)], none, path=path),
                           one)
    scale = ref.abs().max().item()
    assert (native.double() - ref).abs().max().item() <= 1e-5 * scale + 1e-6


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS", "MXFP4"])
def test_rows_do_not_depend_on_the_batch(kind):
    k = kernels.ops()
    cols = 256
    raw = torch.from_numpy(random_blocks(kind, 32, cols, seed=4))
    x = torch.randn(300, cols, generator=torch.Generator().manual_seed(5))
    none = [torch.empty(0, dtype=torch.long)]
    whole = k.gguf_linear(x, [raw], [type_id(kind)], none)
    for m in (1, 2, 3, 5, 17, 64, 299):
        assert torch.equal(k.gguf_linear(x[:m], [raw], [type_id(kind)], none), whole[:m])
    assert torch.equal(k.gguf_linear(x[150:151], [raw], [type_id(kind)], none), whole[150:151])


def test_parts_row_orders_and_bf16():
    k = kernels.ops()
    cols = 256
    a = torch.from_numpy(random_blocks("Q4_K", 32, cols, seed=6))
    b = torch.from_numpy(random_blocks("Q6_K", 16, cols, seed=7))
    c = torch.from_numpy(random_blocks("Q8_0", 16, cols, seed=8))
    order = torch.randperm(32, generator=torch.Generator().manual_seed(9))
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(10))
    types = [type_id("Q4_K"), type_id("Q6_K"), type_id("Q8_0")]
    none = torch.empty(0, dtype=torch.long)
    y = k.gguf_linear(x, [a, b, c], types, [order, none, none])
    alone = [k.gguf_linear(x, [p], [t], [none]) for p, t in zip((a, b, c), types, strict=True)]
    assert torch.equal(y, torch.cat([alone[0][:, order], alone[1], alone[2]], 1))
    yb = k.gguf_linear(x.bfloat16(), [a, b, c], types, [order, none, none])
    assert yb.dtype == torch.bfloat16
    xb = x.bfloat16().float()
    assert torch.equal(yb, k.gguf_linear(xb, [a, b, c], types, [order, none, none]).bfloat16())


def test_bad_input_is_refused():
    k = kernels.ops()
    raw = torch.from_numpy(random_blocks("Q4_K", 16, 256, seed=11))
    x = torch.randn(2, 256)
    none = [torch.empty(0, dtype=torch.long)]
    with pytest.raises(RuntimeError, match="no kernel"):
        k.gguf_linear(x, [raw], [10], none)  # Q2_K
    with pytest.raises(RuntimeError, match="is not"):
        k.gguf_linear(torch.randn(2, 512), [raw], [type_id("Q4_K")], none)
    with pytest.raises(RuntimeError, match="out of range"):
        k.gguf_linear(x, [raw], [type_id("Q4_K")], [torch.tensor([0, 16])])
    with pytest.raises(RuntimeError, match="out of range"):
        k.gguf_rows(raw, type_id("Q4_K"), 256, torch.tensor([16]), torch.float32)
    with pytest.raises(RuntimeError, match="unknown path"):
        k.gguf_linear(x, [raw], [type_id("Q4_K")], none, path="SSE2")
    assert k.gguf_paths()[0] == k.gguf_path() and k.gguf_paths()[-1] == "portable"


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "IQ4_NL", "MXFP4"])
def test_interleaved_gives_the_files_bits(kind):
    """gguf_repack's x8 layout (8 rows side by side, the same bytes) computes every row as the
    file's layout does, bit for bit, on both paths, in any row order and at any batch size."""
    k = kernels.ops()
    tid = type_id(kind)
    x8 = k.gguf_repacked_type(tid)
    assert x8 == 1000 + tid and k.gguf_repacked_type(type_id("Q5_K")) == 0
    cols, rows = 768, 40
    raw = torch.from_numpy(random_blocks(kind, rows, cols, seed=12))
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(13))
    packed = repack(k, raw, tid, cols, order)
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    assert packed.shape == (rows // 8, cols // block * 8 * block_bytes)
    assert packed.dtype == torch.uint8
    assert sorted(packed.flatten().tolist()) == sorted(raw.flatten().tolist())  # same bytes
    x = torch.randn(300, cols, generator=torch.Generator().manual_seed(14))
    none = [torch.empty(0, dtype=torch.long)]
    ref = k.gguf_linear(x, [raw], [tid], [order])
    print(f"{kind}x8: paths {k.gguf_paths()} against the file's layout")
    for m in (1, 2, 3, 4, 5, 17, 300):
        got = k.gguf_linear(x[:m], [packed], [x8], none)
        assert torch.equal(got, ref[:m])
        for path in k.gguf_paths():
            assert torch.equal(got, k.gguf_linear(x[:m], [packed], [x8], none, path=path))
    # beside parts in the file's layouts and the other interleaved type
    b = torch.from_numpy(random_blocks("Q5_K", 8, cols, seed=15))
    other = "Q6_K" if kind == "Q4_K" else "Q4_K"
    c = torch.from_numpy(random_blocks(other, 16, cols, seed=16))
    c8 = repack(k, c, type_id(other), cols)
    mixed = k.gguf_linear(x[:7], [b, packed, c8], [type_id("Q5_K"), x8,
                                                  k.gguf_repacked_type(type_id(other))], none * 3)
    assert torch.equal(mixed, torch.cat([
        k.gguf_linear(x[:7], [b], [type_id("Q5_K")], none), ref[:7],
        k.gguf_linear(x[:7], [c], [type_id(other)], none)], 1))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_activation_edges_and_bf16_on_every_path(kind):
    """The activations' quantization (plain C++ on the portable path, AVX2 vectors on the
    others) and the bf16 results, on rows that reach its edge cases: zeros, a subnormal
    block (127 / amax overflows to inf), huge values, a NaN (skipped by the amax, coded -127),
    float and bf16 inputs. Every path gives the portable path's bits, and bf16 results are
    the float results rounded as torch rounds them."""
    k = kernels.ops()
    tid = type_id(kind)
    cols, rows = 512, 48
    raw = torch.from_numpy(random_blocks(kind, rows, cols, seed=30))
    parts, types = [raw], [tid]
    if k.gguf_repacked_type(tid):
        parts, types = [repack(k, raw, tid, cols)], [k.gguf_repacked_type(tid)]
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(31))
    x[1] = 0
    x[2] *= 1e-40  # subnormal
    x[3, :256] *= 1e-41
    x[4] *= 1e30
    x[5, 7] = float("nan")
    x[6, 300:] = 0
    none = [torch.empty(0, dtype=torch.long)]
    for xs in (x, x.bfloat16()):
        want = k.gguf_linear(xs, parts, types, none, path="portable")
        assert not want.isnan().any()
        for path in k.gguf_paths():
            got = k.gguf_linear(xs, parts, types, none, path=path)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        if xs.dtype == torch.bfloat16:
            as_float = k.gguf_linear(xs.float(), parts, types, none)
            torch.testing.assert_close(k.gguf_linear(xs, parts, types, none),
                                       as_float.bfloat16(), rtol=0, atol=0)


def test_interleaved_q6k_extremes_stay_exact():
    """Q6_Kx8 sums 2 chunks of vpmaddubsw in int16 (at most 2 * 2 * 63 * 127 = 32004): codes
    all 63 against activations all of one sign must not overflow (nor all 0, codes of -32)."""
    k = kernels.ops()
    tid = type_id("Q6_K")
    cols = 512
    for fill in (0xFF, 0x00):
        raw = random_blocks("Q6_K", 8, cols, seed=20)
        raw.reshape(8, 2, 210)[:, :, :192] = fill
        raw.reshape(8, 2, 210)[:, :, 192:208] = 127  # scales at their largest
        raw = torch.from_numpy(raw)
        packed = repack(k, raw, tid, cols)
        none = [torch.empty(0, dtype=torch.long)]
        for x in (torch.ones(2, cols), -torch.ones(2, cols)):
            got = k.gguf_linear(x, [packed], [k.gguf_repacked_type(tid)], none)
            assert torch.equal(got, k.gguf_linear(x, [raw], [tid], none, path="portable"))
            for path in k.gguf_paths():
                assert torch.equal(got, k.gguf_linear(x, [packed], [k.gguf_repacked_type(tid)],
                                                      none, path=path))
            ref = quantized_x(x, 256) @ gguf_weight("Q6_K", raw.numpy(), cols).T
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("kind,fills", [("MXFP4", (0x77, 0xFF)), ("IQ4_NL", (0x00, 0xFF))])
def test_interleaved_table_extremes_stay_exact(kind, fills):
    """MXFP4x8's AVX2 form sums 4 chunks of vpmaddubsw in int16 (at most 4 * 2 * 24 * 127 =
    24384, its levels made unsigned by adding 12); IQ4_NLx8's takes the levels' magnitudes
    (pairs at most 2 * 127 * 127) and VNNI its levels plus 127 (at most 240). Every code the
    largest level or the most negative (MXFP4: 12 and -12, codes 7 and 15; IQ4_NL: -127 and
    113, codes 0 and 15), against activations all of one sign, stays exact."""
    k = kernels.ops()
    tid = type_id(kind)
    cols = 512
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    for fill in fills:
        raw = random_blocks(kind, 16, cols, seed=21)
        raw.reshape(16, -1, block_bytes)[:, :, block_bytes - 16:] = fill
        raw = torch.from_numpy(raw)
        packed = repack(k, raw, tid, cols)
        none = [torch.empty(0, dtype=torch.long)]
        for x in (torch.ones(5, cols), -torch.ones(5, cols)):
            want = k.gguf_linear(x, [raw], [tid], none, path="portable")
            for m in (1, 5):
                for path in k.gguf_paths():
                    got = k.gguf_linear(x[:m], [packed], [k.gguf_repacked_type(tid)], none,
                                        path=path)
                    assert torch.equal(got, want[:m])
            ref = quantized_x(x, 32).double() @ gguf_weight(kind, raw.numpy(), cols).double().T
            torch.testing.assert_close(want.double(), ref, rtol=1e-6, atol=0)


def test_interleaving_bad_input_is_refused():
    k = kernels.ops()
    q4k = type_id("Q4_K")
    raw = torch.from_numpy(random_blocks("Q4_K", 12, 256, seed=16))
    none = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="not a multiple of 8"):
        repack(k, raw, q4k, 256)
    with pytest.raises(RuntimeError, match="no interleaved layout"):
        repack(k, torch.from_numpy(random_blocks("Q5_K", 8, 256, seed=17)), type_id("Q5_K"), 256)
    with pytest.raises(RuntimeError, match="out of range"):
        repack(k, raw, q4k, 256, torch.arange(8) + 5)
    for out in (torch.empty(1, 8 * 144 - 1, dtype=torch.uint8),
                torch.empty(1, 8 * 144, dtype=torch.int8),
                torch.empty(2, 8 * 144, dtype=torch.uint8)[:, :8 * 143]):
        with pytest.raises(RuntimeError, match="out must be contiguous uint8"):
            k.gguf_repack(raw[:8], q4k, 256, none, out)
    packed = repack(k, raw[:8], q4k, 256)
    x8 = k.gguf_repacked_type(q4k)
    with pytest.raises(RuntimeError, match="takes no row order"):
        k.gguf_linear(torch.randn(1, 256), [packed], [x8], [torch.arange(8)])
    with pytest.raises(RuntimeError, match="not an interleaved one"):
        k.gguf_rows(packed, x8, 256, torch.tensor([0]), torch.float32)


@pytest.mark.parametrize("interleave", [False, True])
def test_an_lm_heads_rows_are_dequantized_alone(interleave):
    """weight_rows of a layer served from its GGUF blocks gives the rows of full_weight (the
    MTP drafter's draft vocabulary reads a head this way, not the whole of it)."""
    from kvserve.layers.linear import ParallelLMHead
    from kvserve.layers.quant import GGUFTensor

    cols, rows = 256, 64
    raw = torch.from_numpy(random_blocks("Q6_K", rows, cols, seed=4))
    head = ParallelLMHead(cols, rows).to(torch.bfloat16)
    head.load(GGUFTensor("Q6_K", raw, cols))
    head.pack_("gguf" if not interleave else "auto")
    assert head.packed is not None and type(head.packed).__name__ == "GGUFWeight"
    ids = torch.tensor([3, 0, 63, 17, 17])
    got = head.weight_rows(ids)
    assert got.dtype == torch.bfloat16 and got.shape == (5, cols)
    assert torch.equal(got, head.full_weight()[ids])
    want = gguf_weight("Q6_K", raw.numpy(), cols)[ids].to(torch.bfloat16)
    assert torch.equal(got, want)
