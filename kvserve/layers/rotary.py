"""Rotary position embedding in the "rotate half" layout (Hugging Face checkpoints).

GGUF files converted from Llama checkpoints store q/k rows interleaved for llama.cpp's
pairwise RoPE; the loader undoes that permutation, so one layout serves every format.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # float32 throughout, as the reference computes it, so angles match to the bit.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.freq_factors is not None:
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
        if factors.numel() != inv.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} entries, expected {inv.numel()}")
        inv = inv / factors
    elif scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, and the band between
        # is blended smoothly (Llama 3.1's recipe).
        low_wl = scaling.original_max_position / scaling.low_freq_factor
        high_wl = scaling.original_max_position / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * inv / scaling.factor + smooth * inv
        inv = torch.where(wavelen > low_wl, inv / scaling.factor,
                          torch.where(wavelen < high_wl, inv, blended))
    elif scaling.kind == "yarn":
        inv = _yarn(head_dim, theta, scaling)
    elif scaling.kind == "longrope":
        raise ValueError("LongRoPE factors must be chosen for a context first "
                         "(RopeScaling.for_context)")
    elif scaling.kind != "none":
        raise ValueError(f"unsupported RoPE scaling type {scaling.kind!r} "
                         "(supported: none, linear, llama3, longrope, yarn)")
    return inv


def _yarn(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies: frequency i kept as it is where its wavelength fits more than
    beta_fast times into the original context, divided by `factor` where it fits fewer than
    beta_slow times, and blended linearly over the dimensions between (in float32, as the
    reference computes them)."""
    def dim_at(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) \
            / (2 * math.log(theta))

    low, high = dim_at(scaling.beta_fast), dim_at(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width: a step
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency kept unscaled
    # theta^(2i/d), each unscaled frequency's inverse, scaled and inverted as the reference
    # does (so the angles agree to the bit)
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return 1.0 / (scaling.factor * powers) * (1 - keep) + 1.0 / powers * keep


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables. Per step, `tables(positions)` gathers them once for all
    layers; `apply` then rotates any number of heads with three ops."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: RopeScaling) -> None:
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        # Full-width tables for x * cos + rotate_half(x) * sin, with rotate_half's minus sign
        # folded into sin: rotate_half(x) * sin == roll(x, D/2) * cat(-sin, sin). LongRoPE
        # scales both by its attention factor.
        cos, sin = angles.cos() * scaling.attn_factor, angles.sin() * scaling.attn_factor
        self.register_buffer("cos", torch.cat((cos, cos), -1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for the step's positions, in the compute dtype."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] -> rotated copy."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D], positions [T] -> rotated q, k."""
        cos, sin = self.tables(positions, q.dtype)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)
