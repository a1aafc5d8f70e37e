"""Read a model's config, build the module and fill its weights (kvserve.models.paths finds
the model: a `.gguf` file or a Hugging Face style directory)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.config import ModelConfig, RopeScaling
from kvserve.distributed.parallel import SINGLE, TensorParallel, head_shard
from kvserve.gguf_reader import open_gguf
from kvserve.layers import quant
from kvserve.layers.quant import (
    INT4_SOURCES,
    INT8_SOURCES,
    GGUFTensor,
    gguf_native,
    interleaved_at_load,
)
from kvserve.models.gguf_quants import decode_groups
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.paths import ModelNotFoundError

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
# Hugging Face model types and the architecture that serves them.
HF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma3_text": "gemma3", "phi3": "phi3"}
GEMMA3_GLOBAL_EVERY = 6  # Gemma 3: every 6th layer global, the others sliding-window
GEMMA3_LOCAL_THETA = 10000.0  # ... with this RoPE base (llama.cpp's and transformers' default)


# --------------------------------------------------------------------------------- GGUF


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_model_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model architecture {arch!r} "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    rot = _field(reader, f"{arch}.rope.dimension_count")
    head_size = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    if rot is not None and int(rot) != head_size:
        raise ValueError(f"partial rotary embeddings ({rot} of {head_size} dimensions) are not "
                         "supported")
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ValueError(f"unsupported RoPE scaling type {kind!r} in GGUF (supported: none, "
                         "linear, and per-frequency factors in rope_freqs)")

    def factors(name: str) -> tuple[float, ...] | None:
        t = next((t for t in reader.tensors if t.name == name), None)
        return None if t is None else tuple(
            float(x) for x in np.asarray(t.data, dtype=np.float32).ravel())

    long_factors = factors("rope_factors_long.weight")  # Phi-3's LongRoPE
    scaling = RopeScaling(
        kind="longrope" if long_factors is not None else kind,
        factor=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
        original_max_position=int(
            _field(reader, f"{arch}.rope.scaling.original_context_length", 8192)),
        freq_factors=factors("rope_freqs.weight"),
        attn_factor=float(_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
        short_factors=factors("rope_factors_short.weight"),
        long_factors=long_factors,
    )
    layers = int(get("block_count"))
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    gemma = arch == "gemma3"
    if gemma:
        windows = tuple(0 if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else window
                        for i in range(layers))
    else:
        windows = (window,) * layers if window else ()
    return ModelConfig(
        architecture=arch,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        max_position=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        layer_windows=windows,
        rope_local_theta=GEMMA3_LOCAL_THETA if gemma else 0.0,
        # GGUF's Gemma norm weights already hold 1 + w (llama.cpp adds the 1 on conversion).
        embedding_scale=hidden**0.5 if gemma else 1.0,
        norm_scale_in_float32=gemma,
        sandwich_norms=gemma,
        hidden_act="gelu_tanh" if gemma else "silu",
        name=str(_field(reader, "general.name", "")),
    )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleaving (pairwise RoPE) back to rotate-half order."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o_proj",
    "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down_proj",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "attn_qkv": "qkv",
    "post_attention_norm": "attn_out_norm", "post_ffw_norm": "mlp_out_norm",
}


GgufSource = tuple[str, object]  # (GGUF type name, its QuantGroups or None)


def _row_order(rows: int, n_heads: int) -> torch.Tensor:
    """The file rows of llama.cpp's interleaved q/k weight in rotate-half order (_unpermute)."""
    return _unpermute(torch.arange(rows)[:, None], n_heads)[:, 0].contiguous()


def _in_place(t, kind: str, cfg: ModelConfig, heads: int | None) -> GGUFTensor:
    """A 2-D tensor of a type gguf_linear reads, as a view of the file's memory map; its
    groups (for a layer that cannot read it in place) decoded only when asked for."""
    cols, rows = (int(x) for x in t.shape)  # GGUF lists the inner dimension first
    with warnings.catch_warnings():  # the map is read-only, and nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(t.data)
    order = _row_order(rows, heads) if heads else None

    def groups():
        g = decode_groups(t.data, kind, rows, cols)
        if g is not None and heads:
            g.q, g.d, g.m = (_unpermute(x, heads) for x in (g.q, g.d, g.m))
        return g

    return GGUFTensor(kind, data, cols, order, groups)


def iter_gguf_tensors(reader, cfg: ModelConfig
                      ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor, GgufSource | None]]:
    """(canonical name, tensor, its GGUF source) for every weight. A projection, embedding or
    output matrix of a type gguf_linear reads comes as a GGUFTensor, its blocks in place in
    the file's memory map (the layer dequantizes it only if it cannot serve it so); any
    other tensor comes dequantized to float32 as `gguf` does, a projection's source being
    its type and, where the type has an exact form, its blocks as the VNNI kernel's groups
    (models/gguf_quants.py)."""
    from gguf import quants

    for t in reader.tensors:
        if t.name in ("rope_freqs.weight", "rope_factors_long.weight",
                      "rope_factors_short.weight"):
            continue
        parts = t.name.split(".")
        kind = t.tensor_type.name
        layer = parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER
        name = _GGUF_LAYER[parts[2]] if layer else None
        heads = None
        if cfg.architecture == "llama" and name in ("q", "k"):
            heads = cfg.num_heads if name == "q" else cfg.num_kv_heads
        in_place = len(t.shape) == 2 and gguf_native(kind) and (
            t.name in ("token_embd.weight", "output.weight") or name in _PROJECTIONS
            and not (cfg.architecture == "phi3" and name in ("qkv", "up")))
        if in_place:
            w = _in_place(t, kind, cfg, heads)
            if t.name == "token_embd.weight":
                yield "embed_tokens.weight", w, None
            elif t.name == "output.weight":
                yield "lm_head.weight", w, None
            else:
                yield f"layers.{parts[1]}.{name}.{parts[3]}", w, (kind, None)
            continue
        groups = None
        if kind in _EXACT_FROM_GROUPS and len(t.shape) == 2:
            cols, rows = (int(x) for x in t.shape)
            groups = decode_groups(t.data, kind, rows, cols)
        if groups is not None:  # the same floats as gguf's, from blocks decoded anyway
            w = groups.dequantized()
        else:
            try:
                arr = quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ValueError(f"tensor {t.name}: unsupported GGUF tensor type "
                                 f"{kind}") from e
            w = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
        if t.name == "token_embd.weight":
            yield "embed_tokens.weight", w, None
        elif t.name == "output_norm.weight":
            yield "norm.weight", w, None
        elif t.name == "output.weight":
            yield "lm_head.weight", w, None
        elif layer:
            source = None
            if w.dim() == 2 and name in _PROJECTIONS:
                if groups is None:
                    groups = decode_groups(t.data, kind, *w.shape)
                if groups is not None and heads:
                    groups.q, groups.d, groups.m = (_unpermute(x, heads)
                                                    for x in (groups.q, groups.d, groups.m))
                source = (kind, groups)
            if heads:
                w = _unpermute(w, heads)
            if cfg.architecture == "phi3" and name in ("qkv", "up"):
                kind = "qkv_proj" if name == "qkv" else "gate_up_proj"
                yield from _split_fused(cfg, parts[1], kind, parts[3], w, source)
                continue
            yield f"layers.{parts[1]}.{name}.{parts[3]}", w, source
        else:
            log.warning("ignoring unknown GGUF tensor %s", t.name)


_PROJECTIONS = {"q", "k", "v", "qkv", "o_proj", "gate", "up", "down_proj"}
# Types whose kernel groups give back gguf's dequantized floats bit for bit (q * d + m in
# float32, as gguf computes them: tests/test_gguf.py). Their 2-D tensors' floats come from
# the groups (decoded anyway for projections) instead of from gguf's slower numpy pass, a
# third of the default model's load when it was measured.
_EXACT_FROM_GROUPS = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}


# ------------------------------------------------------------------ Hugging Face directory


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
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    layers = cfg["num_hidden_layers"]
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
                    yield from _split_fused(cfg, parts[1], parts[2], parts[3], w, None)
                    continue
                yield name, w, None


def _split_fused(cfg: ModelConfig, layer: str, kind: str, what: str, w: torch.Tensor,
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


@dataclass(frozen=True)
class WeightBytes:
    """A GGUF model's weights as a --quantization serves them: `resident`, the bytes held,
    and `per_token`, the bytes a decode step reads (every layer matrix and the LM head, not
    the embedding, whose lookups read one row per token); `in_place`, of resident, the
    file's own pages (a read-only map: shared, evictable)."""

    resident: int
    per_token: int
    in_place: int


def gguf_weight_bytes(path: Path, dtype: torch.dtype, in_place: bool) -> WeightBytes | None:
    """WeightBytes of a GGUF file from its tensor table (no weights read), served in place
    (`--quantization gguf`) or as `auto` serves it; None for a model that is not a GGUF file.
    A matrix gguf_linear serves (in place: every type it reads; auto: gguf_auto_types()) counts
    its bytes in the file, in the file's pages (`in_place`) unless auto interleaves it at
    load (Q4_K, Q6_K); the embedding is looked up in place when the head is served so. Any other
    quantized matrix counts the int4 or int8 tiles it is packed into (0.625 or 1.125 bytes a
    weight), the embedding `dtype`'s floats and a tied head an int8 copy; float tensors
    count `dtype`'s size."""
    if path.suffix != ".gguf":
        return None
    reader = open_gguf(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    tied = "output.weight" not in kinds

    auto_types = quant.gguf_auto_types()

    def served(kind: str) -> bool:  # by gguf_linear
        return gguf_native(kind) and (in_place or kind in auto_types)

    head_served = served(kinds.get("output.weight", kinds.get("token_embd.weight", "")))
    resident = per_token = mapped = 0
    item = torch.empty(0, dtype=dtype).element_size()
    for t in reader.tensors:
        kind, count = t.tensor_type.name, int(np.prod([int(x) for x in t.shape]))
        quantized = len(t.shape) == 2 and (gguf_native(kind) or kind in INT4_SOURCES |
                                           INT8_SOURCES)
        embedding = t.name == "token_embd.weight"
        head = 0
        if len(t.shape) == 2 and (served(kind) and not embedding or
                                  embedding and head_served and gguf_native(kind)):
            size = int(t.n_bytes)
            if in_place or not interleaved_at_load(kind) or embedding and not tied:
                mapped += size
        elif embedding:
            size = count * item
            head = int(count * 1.125) if tied else 0  # the tied head's int8 copy
        elif quantized:
            size = int(count * (0.625 if kind in INT4_SOURCES else 1.125))
        else:
            size = count * item
        resident += size + head
        if t.name.startswith("blk.") or t.name == "output.weight":
            per_token += size
        elif embedding and tied:
            per_token += size if head_served else head
    return WeightBytes(resident, per_token, mapped)


# ------------------------------------------------------------------------------- loading


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
            _, idx, kind, what = name.split(".")
            layer = model.layers[int(idx)]
            attn, mlp = layer.self_attn, layer.mlp
            if kind in ("q", "k", "v"):
                attn.qkv_proj.load_qkv(kind, w, what, source)
            elif kind in ("gate", "up"):
                mlp.gate_up_proj.load_part(0 if kind == "gate" else 1, w, what, source)
            elif kind == "o_proj":
                attn.o_proj.load(w, gguf=source)
            elif kind == "down_proj":
                mlp.down_proj.load(w, gguf=source)
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
                     ("q", "k", "v", "o_proj", "gate", "up", "down_proj",
                      "input_layernorm", "post_attention_layernorm")}
        if cfg.qk_norm:
            required |= {f"layers.{i}.q_norm.weight", f"layers.{i}.k_norm.weight"}
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
        kinds = Counter(t.tensor_type.name for t in reader.tensors
                        if t.name.startswith("blk.") and len(t.shape) == 2)
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
