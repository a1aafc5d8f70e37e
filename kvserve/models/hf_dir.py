"""A Hugging Face style model directory as kvserve reads it: config.json as a ModelConfig and
its safetensors tensors, fused projections split the way the layers hold them."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from kvserve.config import ModelConfig, RopeScaling
from kvserve.models.arch import (
    GEMMA3_GLOBAL_EVERY,
    GEMMA3_LOCAL_THETA,
    GgufSource,
    split_fused,
)
from kvserve.models.paths import ModelNotFoundError

log = logging.getLogger(__name__)


# Hugging Face model types and the architecture that serves them.
HF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma3_text": "gemma3", "phi3": "phi3"}


def _rope_scaling(cfg: dict, params: dict) -> RopeScaling:
    """config.json's RoPE scaling (rope_scaling, or transformers 5's rope_parameters)."""
    rs = cfg.get("rope_scaling") or params
    kind = rs.get("rope_type", rs.get("type", "default"))
    kind = {"default": "none", "su": "longrope"}.get(kind, kind)
    original = int(rs.get("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings", 8192)))
    attn_factor = 1.0
    if kind == "longrope":
        attn_factor = rs.get("attention_factor")
        if attn_factor is None:  # transformers' default for Phi-3
            stretch = cfg.get("max_position_embeddings", original) / original
            attn_factor = 1.0 if stretch <= 1.0 else math.sqrt(
                1 + math.log(stretch) / math.log(original))
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor "
                         f"{cfg['partial_rotary_factor']}) are not supported")
    scaling = RopeScaling(
        kind=kind,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position=original,
        attn_factor=float(attn_factor),
        short_factors=tuple(rs["short_factor"]) if "short_factor" in rs else None,
        long_factors=tuple(rs["long_factor"]) if "long_factor" in rs else None,
    )
    return scaling


def _layer_windows(cfg: dict, model_type: str, layers: int, gemma: bool) -> tuple[int, ...]:
    """Each layer's sliding window (0: whole context), or () when no layer has one."""
    window = int(cfg.get("sliding_window") or 0)
    if model_type == "qwen3" and not cfg.get("use_sliding_window"):
        window = 0
    types = cfg.get("layer_types")
    if types:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif gemma:
        every = cfg.get("sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
        windows = tuple(0 if (i + 1) % every == 0 else window for i in range(layers))
    else:
        windows = (window,) * layers if window else ()
    if not any(windows):
        windows = ()
    return windows


def hf_model_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    model_type = cfg.get("model_type")
    arch = HF_ARCHS.get(model_type)
    if arch is None:
        raise ValueError(f"unsupported model architecture {model_type!r} "
                         f"(supported: {', '.join(HF_ARCHS)})")
    heads = cfg["num_attention_heads"]
    params = cfg.get("rope_parameters") or {}
    gemma = arch == "gemma3"
    if gemma and "full_attention" in params:  # transformers 5: bases per layer type
        local_theta = params.get("sliding_attention", {}).get("rope_theta", GEMMA3_LOCAL_THETA)
        params = params["full_attention"]
    else:
        local_theta = cfg.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)
    scaling = _rope_scaling(cfg, params)
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    layers = cfg["num_hidden_layers"]
    windows = _layer_windows(cfg, model_type, layers, gemma)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    scalar = cfg.get("query_pre_attn_scalar") if gemma else None
    return ModelConfig(
        architecture=arch,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position=cfg.get("max_position_embeddings", 4096),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "gemma3"),
        layer_windows=windows,
        rope_local_theta=float(local_theta) if gemma else 0.0,
        attention_scale=float(scalar) ** -0.5 if scalar else 0.0,
        embedding_scale=hidden**0.5 if gemma else 1.0,
        norm_scale_in_float32=gemma,
        sandwich_norms=gemma,
        hidden_act="gelu_tanh" if gemma else "silu",
        name=path.name,
    )


def iter_hf_tensors(path: Path, cfg: ModelConfig
                    ) -> Iterator[tuple[str, torch.Tensor, GgufSource | None]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors files")
    proj = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": "gate", "up_proj": "up"}
    # Gemma names its MLP input norm pre_feedforward_layernorm and its attention output norm
    # post_attention_layernorm; stores w where the norm scales by 1 + w.
    gemma = {"post_attention_layernorm": "attn_out_norm",
             "pre_feedforward_layernorm": "post_attention_layernorm",
             "post_feedforward_layernorm": "mlp_out_norm"} if cfg.sandwich_norms else {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                name = key.removeprefix("model.")
                for old, new in proj.items():
                    name = name.replace(f".{old}.", f".{new}.")
                name = name.replace("self_attn.", "").replace("mlp.", "")
                if "rotary_emb" in name:
                    continue
                parts = name.split(".")
                if len(parts) == 4 and parts[2] in gemma:
                    name = f"{parts[0]}.{parts[1]}.{gemma[parts[2]]}.{parts[3]}"
                w = f.get_tensor(key).float()
                if cfg.norm_scale_in_float32 and name.endswith("norm.weight"):
                    w = w + 1.0
                if len(parts) == 4 and parts[2] in ("qkv_proj", "gate_up_proj"):
                    yield from split_fused(cfg, parts[1], parts[2], parts[3], w, None)
                    continue
                yield name, w, None
