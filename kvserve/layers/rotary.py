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
    elif scaling.kind != "none":
        raise ValueError(f"unsupported RoPE scaling type {scaling.kind!r} "
                         "(supported: none, linear, llama3)")
    return inv


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: RopeScaling) -> None:
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D], positions [T] -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
