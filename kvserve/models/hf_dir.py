"""A Hugging Face style model directory as kvserve reads it: config.json as a ModelConfig and
its safetensors tensors, fused projections split the way the layers hold them."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from kvserve.config import ModelConfig, RopeScaling
from kvserve.models.arch import (
    GEMMA3_GLOBAL_EVERY,
    GEMMA3_LOCAL_THETA,
    GgufSource,
    split_fused,
    yarn_attn_factor,
)
from kvserve.models.paths import ModelNotFoundError

log = logging.getLogger(__name__)


# Hugging Face model types and the architecture that serves them.
HF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma3_text": "gemma3", "phi3": "phi3", "qwen2_moe": "qwen2moe",
            "qwen3_moe": "qwen3moe", "mixtral": "llama", "gpt_oss": "gpt-oss"}


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
    elif kind == "yarn":
        attn_factor = rs.get("attention_factor")
        if attn_factor is None:
            attn_factor = yarn_attn_factor(float(rs.get("factor", 1.0)), rs.get("mscale"),
                                           rs.get("mscale_all_dim"))
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
        beta_fast=float(rs.get("beta_fast") or 32.0),
        beta_slow=float(rs.get("beta_slow") or 1.0),
        truncate=bool(rs.get("truncate", True)),
    )
    return scaling


def _layer_windows(cfg: dict, model_type: str, layers: int, gemma: bool) -> tuple[int, ...]:
    """Each layer's sliding window (0: whole context), or () when no layer has one."""
    window = int(cfg.get("sliding_window") or 0)
    if model_type in ("qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window"):
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


def _moe_fields(cfg: dict, model_type: str, arch: str, layers: int) -> dict[str, object]:
    """ModelConfig's expert fields from config.json (none for a dense model). Qwen's
    mlp_only_layers and decoder_sparse_step name the dense layers as transformers reads them:
    a layer is sparse unless listed, and only every decoder_sparse_step-th one."""
    if model_type == "gpt_oss":
        return {"num_experts": int(cfg["num_local_experts"]),
                "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
                "moe_intermediate_size": int(cfg["intermediate_size"]),
                "norm_topk_prob": True, "moe_gating": "topk_softmax", "moe_bias": True}
    if model_type not in ("qwen2_moe", "qwen3_moe", "mixtral"):
        return {}
    # Qwen's own checkpoints say num_experts; transformers 5 writes num_local_experts for
    # Qwen3-MoE too (its attribute map), as Mixtral's always did.
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts <= 0:
        raise ValueError(f"{model_type} config.json names no experts (num_experts or "
                         "num_local_experts)")
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    mixtral = model_type == "mixtral"
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["intermediate_size" if mixtral else
                                         "moe_intermediate_size"]),
        # transformers' default, where config.json leaves it out: False for Qwen's MoEs
        "norm_topk_prob": mixtral or bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size")
                                               or 0) if arch == "qwen2moe" else 0,
        "dense_layers": () if mixtral else tuple(
            i for i in range(layers) if i in only or (i + 1) % step),
    }


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
    oss = model_type == "gpt_oss"
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
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)) or
        bool(cfg.get("qkv_bias", False)),
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
        layer_windows=windows,
        rope_local_theta=float(local_theta) if gemma else 0.0,
        attention_scale=float(scalar) ** -0.5 if scalar else 0.0,
        embedding_scale=hidden**0.5 if gemma else 1.0,
        norm_scale_in_float32=gemma,
        sandwich_norms=gemma,
        hidden_act="gelu_tanh" if gemma else "swiglu_oai" if oss else "silu",
        **{k: float(cfg[k]) for k in ("swiglu_alpha", "swiglu_limit") if k in cfg},
        # Llama's attention_bias puts a bias on o_proj too; Qwen2's q/k/v biases leave it out.
        o_bias=bool(cfg.get("attention_bias", False)),
        attention_sinks=oss,
        name=path.name,
        **_moe_fields(cfg, model_type, arch, layers),
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
                if cfg.num_experts and (moe := _moe_tensors(cfg, name, f, key)) is not None:
                    yield from moe
                    continue
                if name.endswith(".self_attn.sinks"):  # gpt-oss
                    yield name.replace(".self_attn.sinks", ".sinks.weight"), \
                        f.get_tensor(key).float(), None
                    continue
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


# Expert tensors as checkpoints name them: per expert (Qwen's gate_proj/up_proj/down_proj,
# Mixtral's w1/w3/w2) or, as transformers 5 holds them (save_original_format=False), one
# stack per layer: gate_up_proj [E, 2 x I, H] (gate rows, then up) and down_proj [E, H, I].
# gpt-oss stacks them transposed, gate and up interleaved: gate_up_proj [E, H, 2 x I] (gate
# in the even columns, up in the odd), down_proj [E, I, H], with biases gate_up_proj_bias
# [E, 2 x I] (interleaved too) and down_proj_bias [E, H]; its router has a bias.
_MOE_BLOCK = r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
_HF_EXPERT = re.compile(_MOE_BLOCK + r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                        r"\.weight$")
_HF_STACK = re.compile(_MOE_BLOCK + r"experts\.(gate_up_proj|down_proj)(_bias)?$")
_HF_MOE = re.compile(_MOE_BLOCK + r"(gate|router|shared_expert_gate|shared_expert\.(?:gate_proj|"
                     r"up_proj|down_proj))\.(weight|bias)$")
_HF_MXFP4 = re.compile(_MOE_BLOCK + r"experts\.\w+_(blocks|scales)$")
_EXPERT_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down_proj", "w2": "down_proj"}


def _moe_tensors(cfg: ModelConfig, name: str, f, key: str
                 ) -> list[tuple[str, torch.Tensor, GgufSource | None]] | None:
    """The canonical tensors (kvserve.models.moe.SparseMoE.load) of an MoE checkpoint tensor,
    or None for a tensor that is not an expert's, a router's or a shared expert's."""
    if _HF_MXFP4.match(name):
        raise ValueError(f"{key}: experts in MXFP4 blocks in a Hugging Face checkpoint are not "
                         "read; serve the model's GGUF (its MXFP4 experts run in place), or "
                         "a checkpoint with float experts")
    if m := _HF_EXPERT.match(name):
        layer, e, proj = m.groups()
        return [(f"layers.{layer}.experts.{e}.{_EXPERT_PROJ[proj]}.weight",
                 f.get_tensor(key).float(), None)]
    if m := _HF_STACK.match(name):
        layer, kind, bias = m.groups()
        stack = f.get_tensor(key)
        oss = cfg.architecture == "gpt-oss"  # its transposed, interleaved stacks
        what = "bias" if bias else "weight"
        out = []
        for e in range(stack.shape[0]):
            w = stack[e].float()
            if oss and not bias:
                w = w.t()  # [out, in]
            if kind == "down_proj":
                out.append((f"layers.{layer}.experts.{e}.down_proj.{what}", w.contiguous(), None))
                continue
            gate, up = (w[0::2], w[1::2]) if oss else w.chunk(2, dim=0)
            out += [(f"layers.{layer}.experts.{e}.gate.{what}", gate.contiguous(), None),
                    (f"layers.{layer}.experts.{e}.up.{what}", up.contiguous(), None)]
        return out
    if m := _HF_MOE.match(name):
        layer, part, what = m.groups()
        canonical = {"gate": "router", "router": "router",
                     "shared_expert_gate": "shared_gate"}.get(
            part, "shared." + _EXPERT_PROJ.get(part.removeprefix("shared_expert."), ""))
        return [(f"layers.{layer}.{canonical}.{what}", f.get_tensor(key).float(), None)]
    return None
