"""How a K or V row (one token of one KV head) is stored in the paged cache.

`auto` stores rows as they are, in the compute dtype: width head_dim. (The engine resolves
the user's `auto` first: kernels.kv_cache_dtype_for.)

`float32`, `bfloat16` and `float16` store rows in that dtype, width head_dim: the compute
dtype itself, or a 16-bit dtype under float32 activations, the rows rounded to nearest even
on the way in and widened (exactly) as they are read: half the bytes of float32.

`int8` stores each row quantized symmetrically with its own scale (absmax / 127 over the
head_dim values; K and V rows are quantized separately), followed by the scale as a float16
in the row's last two bytes: width head_dim + 2, dtype int8, so a layer keeps one tensor
whose token slots can be copied whole (`kv[:, :, slots, :]`) like the unquantized ones.

These functions are the single description of that layout: the attention backend sizes and
reads its cache with them, and the memory planner counts bytes with them.
"""

from __future__ import annotations

import torch

from kvserve.config import check_kv_cache_dtype

INT8_SCALE_BYTES = 2  # one float16 per row
_FP16 = torch.finfo(torch.float16)


_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_storage_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the cache tensor. Raises ValueError for a float dtype that is neither the
    compute dtype nor a 16-bit one under float32 activations (a wider cache than the
    activations, or one 16-bit format read as another, would only cost)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "auto":
        return compute_dtype
    storage = _FLOATS[kv_cache_dtype]
    if compute_dtype not in (storage, torch.float32):
        need = "float32" if storage == torch.float32 else f"float32 or {kv_cache_dtype}"
        raise ValueError(f"a {kv_cache_dtype} KV cache needs {need} activations, not "
                         f"{str(compute_dtype).removeprefix('torch.')}")
    return storage


def kv_row_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements (of the cache tensor's dtype) one stored row takes."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype != "int8":
        return head_dim
    if head_dim % 2:
        # the float16 scale is read in place with .view(), which needs 2-byte alignment
        raise ValueError(f"int8 KV cache needs an even head_dim, got {head_dim}")
    return head_dim + INT8_SCALE_BYTES


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats -> [..., D + 2] int8 rows (values, then the float16 scale's bytes).

    Every element comes back from `dequantize_int8` within scale / 2 of its value. The scale
    is clamped into float16's normal range: a row of zeros (or of values below ~0.008) gets
    the smallest normal scale rather than a zero or imprecise subnormal one, and rows with
    values beyond 127 * 65504 would saturate (K/V of real models stay far below that).
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127).clamp_(_FP16.tiny, _FP16.max)
    scale = scale.to(torch.float16)
    # divide by the rounded scale, the one dequantization will multiply by
    q = (xf / scale.float()).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def split_int8(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D + 2] int8 rows -> (the int8 values as `dtype` [..., D], float32 scales [...]);
    a row's values are values * scale. The conversion is exact in float16/bfloat16/float32,
    so attention can apply the scales to its much smaller score and probability tensors."""
    d = rows.shape[-1] - INT8_SCALE_BYTES
    return rows[..., :d].to(dtype), rows[..., d:].view(torch.float16).squeeze(-1).float()


def dequantize_int8(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 2] int8 rows -> [..., D] values in `dtype`."""
    values, scale = split_int8(rows, torch.float32)
    # multiply in float32: a bfloat16 scale alone would add up to 0.2% error to every value
    return (values * scale[..., None]).to(dtype)
