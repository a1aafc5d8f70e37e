"""GGUF weight blocks decoded straight into the VNNI kernel's groups: per output row and group of
32 inputs, unsigned codes q with a scale d and a minimum m (w = q * d + m, d and m float16 in
the kernel's tiles), so a quantized GGUF is served with its own codes instead of being
dequantized and quantized again onto another grid.

    Q4_0  w = (q - 8) d          -> 4 bits: q, d, -8 d                      exact
    Q4_1  w = q d + m            -> 4 bits: q, d, m                         exact
    Q5_0  w = (q - 16) d         -> 8 bits: q (0..31), d, -16 d             exact
    Q5_1  w = q d + m            -> 8 bits: q (0..31), d, m                 exact
    Q8_0  w = q d (q signed)     -> 8 bits: q + 128, d, -128 d              exact
    Q4_K  w = d sc_j q - dmin m_j per 32 of a 256 block
                                 -> 4 bits: q, d sc_j, -dmin m_j            up to float16
    Q5_K  as Q4_K with 5-bit q   -> 8 bits: q (0..31), d sc_j, -dmin m_j    up to float16
    Q6_K  w = d sc_j (q - 32) per 16 of a 256 block
                                 -> 8 bits per 16: q + 96, d sc_j, -128 d sc_j  up to float16

"exact": the kernel's weights equal gguf's dequantization bit for bit (the scales are float16
in the file). The K-quants multiply a float16 super-block scale by a sub-block scale (6-bit;
Q6_K's 8-bit signed); the product is rounded to float16 for the tile (relative error below
2^-11). Q6_K's groups have a scale per 16 inputs, a form only the AVX2 kernel reads (see
QuantGroups); elsewhere, and in a fused layer whose other parts have scales per 32, those
weights are quantized again from their dequantized values, as are the types with no such form
(Q2_K, Q3_K, the IQ types).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.layers.quant import QuantGroups


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields [..., 2] uint8 -> float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs [..., 16] -> [..., 32]: low nibbles are inputs 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """qh [..., 4] (a little-endian uint32) -> [..., 32]: bit j is input j's fifth bit."""
    bits = np.ascontiguousarray(qh).view(np.uint32)[..., 0]
    return ((bits[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of a Q4_K/Q5_K block -> 6-bit (sc, m) of its 8 sub-blocks."""
    s = scales.astype(np.uint8)
    sc, mn = np.empty(s.shape[:-1] + (8,), np.uint8), np.empty(s.shape[:-1] + (8,), np.uint8)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _decode(kind: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Blocks [rows, nb, bytes] -> (q [rows, nb * inputs per block], d, m [rows, nb * g],
    bits), g the groups per block (of 32 inputs; of 16 for Q6_K)."""
    if kind == "Q4_0":
        d = _f16(b[..., 0:2])
        return _nibbles(b[..., 2:18]), d, -8 * d, 4
    if kind == "Q4_1":
        return _nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4
    if kind == "Q5_0":
        d = _f16(b[..., 0:2])
        return _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4), d, -16 * d, 8
    if kind == "Q5_1":
        q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
        return q, _f16(b[..., 0:2]), _f16(b[..., 2:4]), 8
    if kind == "Q8_0":
        d = _f16(b[..., 0:2])
        q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, -128 * d, 8
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        ql = b[..., 16:144] if kind == "Q4_K" else b[..., 48:176]
        # Each 32 bytes of codes hold two sub-blocks: low nibbles, then high nibbles.
        q = np.concatenate([np.concatenate([ql[..., 32 * i:32 * i + 32] & 0x0F,
                                            ql[..., 32 * i:32 * i + 32] >> 4], -1)
                            for i in range(4)], -1)
        if kind == "Q5_K":
            qh = b[..., 16:48]  # bit i of qh[l] is the fifth bit of input l of sub-block i
            q = q | (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1)
                     .reshape(qh.shape[:-1] + (256,)) << 4)
        scale = (d[..., None] * sc).astype(np.float16).astype(np.float32)
        low = (-(dmin[..., None] * mn)).astype(np.float16).astype(np.float32)
        return q, scale, low, 4 if kind == "Q4_K" else 8
    if kind == "Q6_K":
        # ql: low 4 bits, qh: high 2 bits, then 16 int8 scales and d. Each 128 inputs take
        # 64 bytes of ql and 32 of qh: inputs l, l + 32, l + 64, l + 96 (l < 32) from ql[l]'s
        # and ql[l + 32]'s nibbles and qh[l]'s bit pairs 0, 1, 2, 3.
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])
        halves = []
        for n in range(2):
            low, high = ql[..., 64 * n:64 * n + 64], qh[..., 32 * n:32 * n + 32]
            nib = [low[..., :32] & 0x0F, low[..., 32:] & 0x0F, low[..., :32] >> 4,
                   low[..., 32:] >> 4]
            halves += [nib[i] | (((high >> (2 * i)) & 3) << 4) for i in range(4)]
        q = np.concatenate(halves, -1).astype(np.uint8) + 96  # q - 32 + 128
        scale = (d[..., None] * sc).astype(np.float16).astype(np.float32)
        return q, scale, -128 * scale, 8
    raise KeyError(kind)


BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def decode_groups(data: np.ndarray, kind: str, rows: int, cols: int) -> QuantGroups | None:
    """A GGUF tensor's raw blocks (row-major, `rows` rows of `cols` inputs) as kernel groups;
    None for a type without an exact form (see the module docstring)."""
    if kind not in BLOCKS:
        return None
    per, size = BLOCKS[kind]
    if cols % per:
        return None
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // per, size)
    q, d, m, bits = _decode(kind, blocks)
    return QuantGroups(torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols))),
                       torch.from_numpy(np.ascontiguousarray(d.reshape(rows, -1))),
                       torch.from_numpy(np.ascontiguousarray(m.reshape(rows, -1))), bits,
                       16 if kind == "Q6_K" else 32)
