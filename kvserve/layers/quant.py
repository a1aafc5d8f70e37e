"""The weight a linear layer computes with, in the form its kernel reads (`PackedWeight`).

Every form serves every batch size: a row's result must not depend on how many rows share
the step (batch invariance), so there is no separate small-batch path.

- `DenseWeight`: the float32 or bf16 weight repacked for kvserve's `dense_linear`.
- `QuantizedWeight`, int4 or int8 copies. On a CPU with AVX512-VNNI (or AVX2, on
  vpmaddubsw with the same integer sums) they run kvserve's
  `quant_linear`, which quantizes the activations (float32 or bf16) to int8 per group of 32
  and multiplies in integers, as llama.cpp does for these formats (Q4_1 weights x Q8_1
  activations): summed over one layer's four shapes x 30 layers it took 1.3 ms at 1 row
  (torch's int4 kernel 2.5, bf16 9.6), 8.2 ms at 32 (bf16 17.4) and tied bf16 at 512
  (120 ms). Elsewhere torch's int4/int8 kernels run (much slower at prompt sizes, and in
  float32 at every size, which is why `--quantization auto` only quantizes where kvserve's
  kernel runs). The int8 activations cost some accuracy (docs/results-history.md,
  weight_quant_accuracy.py).

int8: symmetric, one scale per group of 32 on kvserve's kernel (GGML's Q8_0), per output row
on torch's. int4: asymmetric groups of 32 along the input dimension, w = q * scale + min, the
layout of GGML's Q4_1 (scale and minimum per 32 weights), so a Q4_1 GGUF's weights come back
nearly exactly (torch's kernel stores it as (q - 8) * scale + zero).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvserve import kernels, weight_arena

QUANTIZATIONS = ("none", "int8", "int4")
# --quantization gguf: a GGUF's matrices read in place in the file's own blocks (GGUFWeight);
# a layer whose types gguf_linear does not read falls back to auto's form.
IN_PLACE = "gguf"
INT4_GROUP = 32
# GGUF tensor types by the weight-only format that keeps their precision class.
INT4_SOURCES = {"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "MXFP4", "IQ3_S",
                "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"}
INT8_SOURCES = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}


def quantization_class(gguf_types) -> str:
    """The quantization that keeps the precision class of a layer's GGUF types: int4 for 4-bit
    and smaller types, int8 when any part is 5- to 8-bit, none for float types (or none)."""
    types = set(gguf_types)
    if not types or types - INT4_SOURCES - INT8_SOURCES:
        return "none"
    return "int8" if types & INT8_SOURCES else "int4"


@dataclass
class QuantGroups:
    """A weight [N, K] as the VNNI kernel's groups: codes q [N, K] uint8, scale d and minimum m
    [N, K / group] float32 (w = q * d + m; float16 values in the kernel's tiles), bits 4 or 8.
    `group` is 32, or 16 for symmetric 8-bit codes (m = -128 d) with a scale per 16 inputs,
    as GGML's Q6_K keeps them (the AVX2 kernel's form; see `kernels.quant_kernels`)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int
    group: int = INT4_GROUP

    def dequantized(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().view(n, k // self.group, self.group) * self.d[..., None] + \
            self.m[..., None]
        return w.view(n, k)


# GGML's type numbers (as GGUF stores them) of the types gguf_linear reads in place.
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
              "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "MXFP4": 39}
# The GGUF types `--quantization auto` serves on gguf_linear, at the file's bytes, rather than
# on the int4/int8 tiles: each interleaved 8 rows at a time at load (gguf_repack). On a
# Zen 3, 2 threads (benchmarks/gguf_kernels.py, one layer of a 1.5B model): Q4_Kx8 as fast as
# the int4 tiles at one row and 1.10-1.13x at 512, at 0.5625 bytes a weight against 0.625;
# Q6_Kx8 1.09x the int8 tiles at 512 rows (1.5x the file's layout), at 0.82 bytes a weight
# against 1.125. Fewer bytes win decode and memory (benchmarks/RESULTS.md). The other types'
# kernels are slower than the tiles they would be repacked into. On a Zen 4 (AVX-512 VNNI, 2
# threads) the x8 kernels on vpdpbusd, 16 rows a 512-bit register, ran at 0.98x the tiles'
# speed (Q4_K) and 0.79x (Q6_K) at 512 rows; served, the 1.5B Q4_K_M prefilled at 1.59x
# llama-server and decoded at 0.87x (the tiles, in an earlier run: 1.67x and 0.93x) and held
# 1.62 GiB at its peak against the tiles' 6.95: memory decided it. IQ4_XS is read in place
# (`gguf`: its 16 levels exactly, which the int4 tiles only approximate) by a kernel of the
# file's layout that ran at 0.24-0.31x the tiles' speed at 1 and 512 rows on that Zen 4
# (`benchmarks/gguf_kernels.py --as-type IQ4_XS`): `auto` keeps the tiles for it until it has
# an interleaved layout. IQ4_NL has one (IQ4_NLx8, MXFP4x8's form with a float16 scale): on
# that Zen 4 one layer of the 1.5B's shape (`--as-type IQ4_NL`) ran at 1.17x the tiles at 512
# rows, and in the avx2 build at 0.74x (its levels' magnitudes on vpmaddubsw, against the
# tiles' values that move its levels); `auto` serves it so, at its own values and the file's
# bytes. MXFP4 (gpt-oss's experts) has one too (MXFP4x8): on that
# Zen 4 (`--shape gpt-oss-20b`) an expert's gate/up ran at 224 G multiply-adds a second at 512
# rows (1.11x the int4 tiles; 3.7x the file's layout) and 0.172 ms at one row (the tiles
# 0.116). `auto` reads it so rather than on the tiles: gpt-oss was trained for its MXFP4
# values, and the tiles' 16 even steps a group move them by 8.3% (relative L2 error against
# the MXFP4 values, random N(0, 0.02) blocks), as much as MXFP4's own rounding of the float
# weights (11.4%); the tiles also hold 1.18x the file's bytes. `--quantization int4` serves
# them on the tiles.
GGUF_AUTO_TYPES = frozenset({"Q4_K", "Q6_K", "IQ4_NL", "MXFP4"})


def gguf_auto_types() -> frozenset[str]:
    """GGUF_AUTO_TYPES where gguf_linear has a vector path (AVX2, or VNNI where the tiles run
    on AVX-512); none where it has only the portable one."""
    ops = kernels.ops()
    return GGUF_AUTO_TYPES if ops is not None and ops.gguf_path() != "portable" else frozenset()


@dataclass
class GGUFTensor:
    """A 2-D GGUF weight [rows, cols] in the file's own blocks: `data` is uint8 [rows in the
    file, bytes a row], a view of the file's read-only memory map (never copied). Row i of the
    weight is data[order[i]] (llama.cpp stores Llama's q/k rows interleaved for its RoPE), or
    data[i] without an order. `groups` decodes the blocks into the int4/int8 kernel's groups
    (in the weight's row order) for a layer that cannot read them in place; None where the
    type has no such form."""

    kind: str
    data: torch.Tensor
    cols: int
    order: torch.Tensor | None = None
    groups: Callable[[], QuantGroups | None] | None = None

    @property
    def type_id(self) -> int:
        return GGML_TYPES[self.kind]

    @property
    def rows(self) -> int:
        return self.data.shape[0] if self.order is None else self.order.numel()

    def dequantized(self, ids: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's rows (all, or `ids`) as gguf dequantizes them to float32, in `dtype`
        (float32, or bf16 rounded from gguf's float32)."""
        ids = torch.arange(self.rows) if ids is None else ids
        if self.order is not None:
            ids = self.order[ids]
        ops = kernels.ops()
        if ops is not None:
            return ops.gguf_rows(self.data, self.type_id, self.cols, ids, dtype)
        from gguf import GGMLQuantizationType, quants  # only without the C++ kernels

        rows = self.data[ids].numpy()
        w = quants.dequantize(rows, GGMLQuantizationType[self.kind])
        return torch.from_numpy(w.reshape(len(rows), self.cols).astype("float32")).to(dtype)


def gguf_native(kind: str) -> bool:
    """Whether gguf_linear reads GGML type `kind` in place."""
    return kind in GGML_TYPES


def interleaved_at_load(kind: str) -> bool:
    """Whether `auto` repacks GGML type `kind` into an interleaved layout (gguf_repack has one
    for it here)."""
    ops = kernels.ops()
    return ops is not None and gguf_native(kind) and ops.gguf_repacked_type(GGML_TYPES[kind]) != 0


def check_quantization(name: str) -> str:
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {name!r}")
    return name


def quantize_int8(w: torch.Tensor, dtype: torch.dtype,
                  row_absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K], scales [N] in `dtype`); w ~= q * scale[:, None]. `row_absmax`
    overrides the rows' largest magnitudes (a shard of a row scaled as the whole row)."""
    wf = w.float()
    absmax = wf.abs().amax(dim=1) if row_absmax is None else row_absmax.float()
    scale = (absmax / 127).clamp_min_(1e-12).to(dtype)
    q = (wf / scale.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


# Elements of a weight that _int8_groups and _int4_groups quantize at a time: their float
# temporaries stay in the caches instead of streaming through memory (a 262k-token LM head,
# Zen 4: int8 1.0 -> 0.23 s, int4 0.7 -> 0.3 s).
QUANT_CHUNK = 1 << 20


def _row_chunks(n: int, k: int) -> Iterator[slice]:
    """The rows of an [n, k] weight, QUANT_CHUNK elements (at least a row) at a time."""
    rows = max(1, QUANT_CHUNK // k)
    for i in range(0, n, rows):
        yield slice(i, i + rows)


def _int4_range(w: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> the weight in groups [N, K / group, group] (float32), and each group's scale
    and min [N, K / group] as stored in `dtype`, so that 16 steps span its range."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs the input dimension ({k}) to be a multiple of {group}")
    wg = w.float().view(n, k // group, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min_(1e-12).to(dtype).float()
    return wg, scale, lo.to(dtype).float()


def _int4_groups(w: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> q [N, K] (0..15 as float), scale and min [N, K / group] as stored in `dtype`:
    w ~= q * scale + min, each group spanning its own range. Rows are quantized a chunk at
    a time (QUANT_CHUNK); each row's result is its own."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float32)
    scale = torch.empty(n, k // group, dtype=torch.float32)
    lo = torch.empty(n, k // group, dtype=torch.float32)
    for r in _row_chunks(n, k):
        wg, s, m = _int4_range(w[r], dtype, group)
        # Round against the stored (rounded) scale and min, so dequantization is as close as
        # it can be to the original weight.
        q[r] = ((wg - m[..., None]) / s[..., None]).round_().clamp_(0, 15).view(-1, k)
        scale[r], lo[r] = s, m
    return q, scale, lo


def quantize_int4(w: torch.Tensor, dtype: torch.dtype,
                  group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (packed int4 weight, scales and zeros [K / group, N, 2] in `dtype`) for
    torch's kernel, which computes (q - 8) * scale + zero."""
    wg, scale, lo = _int4_range(w, dtype, group)
    zero = (lo + 8 * scale).to(dtype)
    # torch's zero point sits at q = 8: round against the zero as stored.
    q = ((wg - zero.float()[..., None]) / scale[..., None] + 8).round_().clamp_(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q.view(w.shape).to(torch.int32), 1)
    scales_zeros = torch.stack((scale.to(dtype), zero), dim=-1).transpose(0, 1).contiguous()
    return packed, scales_zeros


def _int8_groups(w: torch.Tensor, group: int = INT4_GROUP
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> quant_pack's 8-bit form: q [N, K] uint8 = round(w / scale) + 128, scale
    [N, K / group] in float16 (symmetric per group of 32, as GGML's Q8_0) and min = -128 scale.
    Rows are quantized a chunk at a time (QUANT_CHUNK); each row's result is its own."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, k // group, dtype=torch.float32)
    for r in _row_chunks(n, k):
        wg = w[r].float().view(-1, k // group, group)
        s = (wg.abs().amax(dim=-1) / 127).clamp_min_(1e-7).half().float()
        q[r] = (wg / s[..., None]).round_().clamp_(-127, 127).add_(128).view(-1, k)
        scale[r] = s
    return q, scale, -128 * scale


def dequantize_int4(packed_q: torch.Tensor, scales_zeros: torch.Tensor, n: int, k: int,
                    group: int = INT4_GROUP) -> torch.Tensor:
    """The float weight an int4 copy stands for (tests and accuracy reports)."""
    eye = torch.eye(k, dtype=scales_zeros.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed_q, group, scales_zeros).t()


class PackedWeight(ABC):
    """A layer's weight [N, K] in the form one kernel reads, and the matmul with it."""

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w.T in x's dtype; row i depends on x[i] only."""

    @abstractmethod
    def fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scales) as the C++ `run_layers` reads them (see its `linear`)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes read per use of the whole weight."""


def lossless_half(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 weight in 16 bits (bf16, else float16) when every value survives the trip
    exactly (a bf16 or float16 checkpoint served in float32), else None."""
    if weight.dtype != torch.float32:
        return None
    for narrow in (torch.bfloat16, torch.float16):
        half = weight.to(narrow)
        if torch.equal(half.float(), weight):
            return half
    return None


class DenseWeight(PackedWeight):
    """A float32 or bf16 weight repacked for `dense_linear` (see `kernels.dense_kernels`):
    tiles of 16 outputs whose sums over the input run down register lanes in one order.

    A float32 weight whose values are all bf16 (or float16) values is kept in 16 bits where
    the kernel reads them with float32 activations (`kernels.dense_half_kernels`): the same
    results from half the bytes, which is what a decode step's time follows."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        ops = kernels.dense_kernels(weight.dtype, weight.device, n, k)
        if ops is None:
            raise ValueError(f"no dense kernel for a {weight.dtype} [{n}, {k}] weight on "
                             f"{weight.device}")
        self.kernels = ops
        half = (lossless_half(weight) if kernels.dense_half_kernels(weight.device, n, k)
                is not None else None)
        self.packed = ops.dense_pack_half(half) if half is not None else ops.dense_pack(weight)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.dense_linear(x, self.packed)

    def fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.packed, self.packed.new_empty(0)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class GGUFWeight(PackedWeight):
    """A weight served in its GGUF file's own blocks (`kernels.gguf_kernels`): one or more
    parts (q, k and v; gate and up) read in place from the file's memory map, their outputs
    side by side. The activations are quantized to int8 per block of the part's type (32, or
    256 for the K-quants) and each block's integer sum is exact, so the portable and the AVX2
    paths give the same bits and a row's result does not depend on the batch.

    With `interleave`, a part whose type has an interleaved layout (gguf_repacked_type; see
    paths.INTERLEAVED_TYPES) and whose rows are a multiple of 8 is repacked into it at load
    (`gguf_repack`: the same bytes, 8 rows side by side, one per vector lane), in the
    process's memory (kvserve.weight_arena), and the file's pages it was read from are handed
    back; the results are the same bits as the file's layout gives."""

    def __init__(self, parts: list[GGUFTensor], dtype: torch.dtype,
                 device: torch.device, interleave: bool = False) -> None:
        self.parts = parts
        self.kernels = kernels.gguf_kernels(dtype, device, [p.type_id for p in parts])
        if self.kernels is None:
            raise ValueError(f"no GGUF kernel for {[p.kind for p in parts]} in {dtype} on "
                             f"{device}")
        none = torch.empty(0, dtype=torch.long)
        self.data, self.types, self.orders = [], [], []
        for p in parts:
            order = none if p.order is None else p.order
            x8 = self.kernels.gguf_repacked_type(p.type_id) if interleave else 0
            if x8 and p.rows % 8 == 0:
                # the same bytes: 8 of the file's rows side by side in each row
                out = weight_arena.take(p.rows // 8, 8 * p.data.shape[1])
                self.data.append(self.kernels.gguf_repack(p.data, p.type_id, p.cols, order,
                                                          out))
                self.types.append(x8)
                self.orders.append(none)
                release_pages(p.data)
            else:
                self.data.append(p.data)
                self.types.append(p.type_id)
                self.orders.append(order)
        self.n, self.k = sum(p.rows for p in parts), parts[0].cols

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.gguf_linear(x.contiguous(), self.data, self.types, self.orders)

    def fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a GGUF weight goes to run_layers as its parts (gguf_parts)")

    def gguf_parts(self) -> dict[str, list]:
        """run_layers' LinearWeights fields for this weight."""
        return {"parts": self.data, "types": self.types, "rows": self.orders}

    @property
    def kinds(self) -> list[str]:
        return [p.kind for p in self.parts]

    @property
    def interleaved(self) -> list[bool]:
        """Per part, whether it was repacked into its interleaved layout."""
        return [t != p.type_id for t, p in zip(self.types, self.parts, strict=True)]

    @property
    def nbytes(self) -> int:
        return sum(p.rows * p.data.shape[1] for p in self.parts)


def release_pages(t: torch.Tensor) -> None:
    """Hand back to the kernel the pages of a file mapping that `t` views (madvise
    MADV_DONTNEED on the whole pages inside it): they leave the process's resident set and
    are read from the page cache again if touched. Anywhere else, nothing."""
    import ctypes
    import mmap
    import sys

    if not sys.platform.startswith("linux") or t.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                     mmap.MADV_DONTNEED)


class QuantizedWeight(PackedWeight):
    """A quantized copy of one [N, K] weight: kvserve's `quant_linear` tiles where that
    kernel runs (int8 then per group of 32), else torch's int4/int8 packing."""

    def __init__(self, weight: torch.Tensor, method: str,
                 row_absmax: torch.Tensor | None = None) -> None:
        self.method = check_quantization(method)
        self.n, self.k = weight.shape
        dtype = weight.dtype
        if method == "none":
            raise ValueError("nothing to quantize with method 'none'")
        if weight.device.type != "cpu":  # both kvserve's kernel and torch's fallbacks are CPU's
            raise ValueError(f"{method} weights run on CPU kernels only; this weight is on "
                             f"{weight.device} (use quantization none there)")
        self.exact = False  # quantized here (from_groups: a checkpoint's own codes)
        # A row-parallel int8 shard that must scale by whole rows (row_absmax): torch's kernel.
        self.kernels = (kernels.quant_kernels(dtype, weight.device, self.n, self.k)
                        if method == "int4" or row_absmax is None else None)
        if self.kernels is not None:
            q, d, m = (_int8_groups(weight) if method == "int8"
                       else _int4_groups(weight, torch.float16))
            self.q = self.kernels.quant_pack(q.to(torch.uint8), d, m, 8 if method == "int8" else 4)
            self.scales = torch.empty(0, dtype=dtype)  # inside the packed tiles
        elif method == "int8":
            self.q, self.scales = quantize_int8(weight, dtype, row_absmax)
        else:
            self.q, self.scales = quantize_int4(weight, dtype)

    @classmethod
    def from_groups(cls, groups: QuantGroups, dtype: torch.dtype,
                    device: torch.device) -> QuantizedWeight | None:
        """The VNNI kernel's copy of codes that already are its groups (a GGUF's own); None
        where that kernel does not serve the shape or activations in `dtype`."""
        n, k = groups.q.shape
        kernels_ = kernels.quant_kernels(dtype, device, n, k)
        if kernels_ is None or groups.group != INT4_GROUP and not kernels_.has_quant_halves():
            return None
        self = cls.__new__(cls)
        self.method, self.n, self.k, self.kernels = f"int{groups.bits}", n, k, kernels_
        self.q = kernels_.quant_pack(groups.q, groups.d, groups.m, groups.bits)
        self.scales = torch.empty(0, dtype=dtype)
        self.exact = True
        return self

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.quant_linear(x.contiguous(), self.q)
        if self.method == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q, INT4_GROUP, self.scales)

    def fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, self.scales

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * \
            self.scales.element_size()
