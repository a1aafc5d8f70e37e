"""What the two model readers (gguf_file, hf_dir) share: the architectures kvserve serves and
their constants, a weight's GGUF source, and fused projections split into the layers' parts."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kvserve.config import ModelConfig

# GGUF architecture names (Mixtral's files are "llama" with an expert count).
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen2moe", "qwen3moe",
                   "gpt-oss")
# Whether an MoE architecture renormalizes the chosen experts' weights, where a GGUF does not
# say (expert_weights_norm): what llama.cpp and transformers do for each.
MOE_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "gpt-oss": True}
# gpt-oss: every other layer (the even ones) attends through a sliding window.
GPT_OSS_SLIDING_EVERY = 2


def yarn_attn_factor(factor: float, mscale: float | None = None,
                     mscale_all_dim: float | None = None) -> float:
    """YaRN's scale of cos/sin where a checkpoint does not state it: 1 + 0.1 ln(factor) (the
    ratio of two such terms where DeepSeek-style mscale and mscale_all_dim are both given);
    1 for factor <= 1."""
    def term(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if mscale and mscale_all_dim:
        return term(float(mscale)) / term(float(mscale_all_dim))
    return term(1.0)
GEMMA3_GLOBAL_EVERY = 6  # Gemma 3: every 6th layer global, the others sliding-window
GEMMA3_LOCAL_THETA = 10000.0  # ... with this RoPE base (llama.cpp's and transformers' default)

GgufSource = tuple[str, object]  # (GGUF type name, its QuantGroups or None)


def split_fused(cfg: ModelConfig, layer: str, kind: str, what: str, w: torch.Tensor,
                 source: GgufSource | None
                 ) -> Iterator[tuple[str, torch.Tensor, GgufSource | None]]:
    """A checkpoint's fused projection (Phi-3: qkv_proj, gate_up_proj) as its parts, row
    blocks of the weight (and of its GGUF groups)."""
    if kind == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        names, sizes = ("q", "k", "v"), (q, kv, kv)
    else:
        names, sizes = ("gate", "up"), (cfg.intermediate_size,) * 2
    if w.shape[0] != sum(sizes):
        raise ValueError(f"layers.{layer}.{kind}: {w.shape[0]} rows, expected {sum(sizes)}")
    start = 0
    for name, size in zip(names, sizes, strict=True):
        part = None
        if source is not None:
            g = source[1]
            part = (source[0], None if g is None else type(g)(
                g.q[start:start + size], g.d[start:start + size], g.m[start:start + size],
                g.bits, g.group))
        yield f"layers.{layer}.{name}.{what}", w[start:start + size], part
        start += size
