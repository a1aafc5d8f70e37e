"""Read a model's config, build the module and fill its weights (kvserve.models.paths finds
the model: a `.gguf` file or a Hugging Face style directory)."""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.config import ModelConfig
from kvserve.distributed.parallel import SINGLE, TensorParallel, head_shard
from kvserve.gguf_reader import open_gguf
from kvserve.layers.quant import (
    INT4_SOURCES,
    INT8_SOURCES,
    GGUFTensor,
)
from kvserve.models.arch import GgufSource
from kvserve.models.gguf_file import gguf_model_config, iter_gguf_tensors
from kvserve.models.hf_dir import hf_model_config, iter_hf_tensors
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.moe import SparseMoE, moe_tensor_names

log = logging.getLogger(__name__)

def read_model_config(path: Path) -> ModelConfig:
    """The config of a resolved model path, from GGUF metadata or config.json only: tensor
    data is not read (the GGUF is memory-mapped), so this is cheap even for large models."""
    if path.suffix != ".gguf":
        return hf_model_config(path)

    try:
        reader = open_gguf(path)
    except Exception as e:  # a truncated or foreign file: say so plainly
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    return gguf_model_config(reader)


class DeferredReader:
    """A GGUF file's reader, opened on first use: what a model restored from the weight cache
    hands on for its tokenizer, which has a cache of its own and so usually never parses the
    file's metadata."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._reader = None

    def __getattr__(self, name: str):
        if self._reader is None:
            self._reader = open_gguf(self._path)
        return getattr(self._reader, name)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    path: Path
    gguf_reader: object | None  # kept so the tokenizer can be built from the same file
    weight_format: str  # storage type of most layer matrices: "Q4_1", "F16", "bf16", ...
    # The config as the checkpoint states it, before `max_model_len` chose LongRoPE's factors
    # (what the weight cache keeps: its entries serve any --max-model-len).
    checkpoint_config: ModelConfig | None = None


def auto_quantization(weight_format: str) -> str:
    """A whole checkpoint's precision class (int4 for 4-bit and smaller GGUF types, int8 for 5-
    to 8-bit ones, none for float checkpoints); per layer, LinearBase.pack_("auto") keeps
    each layer's own."""
    if weight_format in INT4_SOURCES:
        return "int4"
    if weight_format in INT8_SOURCES:
        return "int8"
    return "none"


def load_weights(model: LlamaForCausalLM,
                 tensors: Iterator[tuple[str, torch.Tensor | GGUFTensor, GgufSource | None]]
                 ) -> None:
    """Place canonical-named tensors into the fused, shard-aware layers."""
    seen: set[str] = set()
    for name, w, source in tensors:
        seen.add(name)
        if name == "embed_tokens.weight":
            model.embed_tokens.load(w)
        elif name == "norm.weight":
            _copy(model.norm.weight, w, name)
        elif name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                model.lm_head.load(w)
        else:
            parts = name.split(".")
            layer = model.layers[int(parts[1])]
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(mlp, SparseMoE) and parts[2] in ("router", "experts", "shared",
                                                          "shared_gate"):
                mlp.load(parts[2:], w, source)
                continue
            if len(parts) != 4:
                raise ValueError(f"unexpected tensor {name}")
            _, _, kind, what = parts
            if kind in ("q", "k", "v"):
                attn.qkv_proj.load_qkv(kind, w, what, source)
            elif kind in ("gate", "up", "down_proj") and not isinstance(mlp, SparseMoE):
                mlp.load(kind, w, what, source)
            elif kind == "o_proj" and what == "bias":
                attn.o_proj.load_bias(w)
            elif kind == "o_proj":
                attn.o_proj.load(w, gguf=source)
            elif kind == "sinks":
                attn.load_sinks(w)
            elif kind in ("input_layernorm", "post_attention_layernorm", "attn_out_norm",
                          "mlp_out_norm") and getattr(layer, kind) is not None:
                _copy(getattr(layer, kind).weight, w, name)
            elif kind in ("q_norm", "k_norm") and getattr(attn, kind) is not None:
                _copy(getattr(attn, kind).weight, w, name)
            else:
                raise ValueError(f"unexpected tensor {name}")
    cfg = model.config
    required = {"embed_tokens.weight", "norm.weight"}
    for i in range(cfg.num_layers):
        required |= {f"layers.{i}.{k}.weight" for k in
                     ("q", "k", "v", "o_proj", "input_layernorm", "post_attention_layernorm")}
        required |= (moe_tensor_names(cfg, i) if cfg.sparse(i) else
                     {f"layers.{i}.{k}.weight" for k in ("gate", "up", "down_proj")})
        if cfg.qk_norm:
            required |= {f"layers.{i}.q_norm.weight", f"layers.{i}.k_norm.weight"}
        if cfg.o_bias:
            required.add(f"layers.{i}.o_proj.bias")
        if cfg.attention_sinks:
            required.add(f"layers.{i}.sinks.weight")
        if cfg.sandwich_norms:
            required |= {f"layers.{i}.attn_out_norm.weight", f"layers.{i}.mlp_out_norm.weight"}
    if not cfg.tie_word_embeddings:
        required.add("lm_head.weight")
    model.tie_gguf_head()
    missing = sorted(required - seen)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def shard_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config as one rank sees its attention: its own query and KV heads (what its
    attention backend and its share of the KV cache are sized by)."""
    if tp.size == 1:
        return cfg
    s = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size)
    return dataclasses.replace(cfg, num_heads=s.q_count, num_kv_heads=s.kv_count)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def load_model(path: Path, dtype: torch.dtype, device: torch.device,
               backend_factory: Callable[[ModelConfig], AttentionBackend],
               tp: TensorParallel = SINGLE, max_model_len: int | None = None) -> LoadedModel:
    """Build the model for this rank's shard and fill it from the checkpoint. The attention
    backend is made for the rank's own heads (`shard_config`). `max_model_len` (default the
    model's context) chooses LongRoPE's factors (RopeScaling.for_context)."""
    reader = None
    if path.suffix == ".gguf":

        try:
            reader = open_gguf(path)
        except Exception as e:  # a truncated or foreign file: say so plainly
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
        cfg = gguf_model_config(reader)
        tensors = iter_gguf_tensors(reader, cfg)
        # the layers' most common matrix type (an MoE's expert stack counts as one matrix)
        kinds = Counter(t.tensor_type.name for t in reader.tensors
                        if t.name.startswith("blk.") and len(t.shape) >= 2)
        weight_format = kinds.most_common(1)[0][0] if kinds else "F32"
    else:
        cfg = hf_model_config(path)
        tensors = iter_hf_tensors(path, cfg)
        weight_format = "safetensors"
    read = cfg
    cfg = for_context(cfg, max_model_len)
    # Parameters are created in the compute dtype and filled one checkpoint tensor at a
    # time, so loading never holds a float32 copy of the whole model (peak RSS).
    model = build_model(cfg, dtype, backend_factory, tp)
    load_weights(model, tensors)
    model.to(device)
    model.eval()
    return LoadedModel(model, cfg, path, reader, weight_format, read)


def for_context(cfg: ModelConfig, max_model_len: int | None) -> ModelConfig:
    """The config with LongRoPE's factors chosen for `max_model_len` (default the model's
    context; RopeScaling.for_context)."""
    return dataclasses.replace(cfg, rope_scaling=cfg.rope_scaling.for_context(
        max_model_len or cfg.max_position))


def build_model(cfg: ModelConfig, dtype: torch.dtype,
                backend_factory: Callable[[ModelConfig], AttentionBackend],
                tp: TensorParallel = SINGLE) -> LlamaForCausalLM:
    """The module for this rank's shard, its parameters created in `dtype` and not yet filled
    (torch.empty; norms at 1): the caller fills every one."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return LlamaForCausalLM(cfg, backend_factory(shard_config(cfg, tp)), tp)
    finally:
        torch.set_default_dtype(previous)
