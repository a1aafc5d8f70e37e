"""A GGUF file as kvserve reads it: its metadata as a ModelConfig, its tensors (dequantized, or
kept in the file's own blocks for the kernels that read them), and the bytes its weights take."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvserve.config import ModelConfig, RopeScaling
from kvserve.gguf_reader import open_gguf
from kvserve.layers import quant
from kvserve.layers.quant import (
    INT4_SOURCES,
    INT8_SOURCES,
    GGUFTensor,
    gguf_native,
    interleaved_at_load,
)
from kvserve.models.arch import (
    GEMMA3_GLOBAL_EVERY,
    GEMMA3_LOCAL_THETA,
    GPT_OSS_SLIDING_EVERY,
    MOE_NORM_TOPK,
    SUPPORTED_ARCHS,
    GgufSource,
    split_fused,
    yarn_attn_factor,
)
from kvserve.models.gguf_quants import decode_groups
from kvserve.models.moe import experts_read

log = logging.getLogger(__name__)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _moe_fields(reader, arch: str, layers: int) -> dict[str, object]:
    """ModelConfig's expert fields from a GGUF's metadata (none for a dense model). Sizes the
    metadata leaves out (Mixtral's experts are feed_forward_length wide; older Qwen2-MoE
    files) come from the tensors' shapes; a layer without a router is dense."""
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if not experts:
        return {}
    if arch not in MOE_NORM_TOPK:
        raise ValueError(f"{arch} GGUF with {experts} experts: kvserve serves experts in "
                         f"{', '.join(MOE_NORM_TOPK)} files only")
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    first = next((i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in shapes), None)
    if first is None:
        raise ValueError(f"{arch} GGUF with {experts} experts but no blk.N.ffn_gate_exps "
                         "tensors: each expert as a tensor of its own (llama.cpp's layout "
                         "before 2024) is not supported; convert the model again")
    # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*: 1 softmax, 3 softmax over the chosen
    # (gpt-oss's, which its files do not state: llama.cpp's graph hard-codes it)
    gating = _field(reader, f"{arch}.expert_gating_func", 3 if arch == "gpt-oss" else None)
    if gating not in (None, 1, 3):
        raise ValueError(f"unsupported expert gating function {gating} (supported: softmax, "
                         "softmax over the chosen experts)")
    scale = float(_field(reader, f"{arch}.expert_weights_scale", 1.0))
    if scale != 1.0:
        raise ValueError(f"unsupported expert weights scale {scale} (supported: 1)")
    size = _field(reader, f"{arch}.expert_feed_forward_length")
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is None and f"blk.{first}.ffn_gate_shexp.weight" in shapes:
        shared = shapes[f"blk.{first}.ffn_gate_shexp.weight"][1]
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count", 0) or 0),
        "moe_intermediate_size": int(size if size is not None else
                                     shapes[f"blk.{first}.ffn_gate_exps.weight"][1]),
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm",
                                      MOE_NORM_TOPK[arch])),
        "shared_expert_intermediate_size": int(shared or 0),
        "dense_layers": tuple(i for i in range(layers)
                              if f"blk.{i}.ffn_gate_inp.weight" not in shapes),
        "moe_gating": "topk_softmax" if gating == 3 else "softmax",
        "moe_bias": f"blk.{first}.ffn_gate_inp.bias" in shapes,
    }


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
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"unsupported RoPE scaling type {kind!r} in GGUF (supported: none, "
                         "linear, yarn, and per-frequency factors in rope_freqs)")
    oss = arch == "gpt-oss"

    def factors(name: str) -> tuple[float, ...] | None:
        t = next((t for t in reader.tensors if t.name == name), None)
        return None if t is None else tuple(
            float(x) for x in np.asarray(t.data, dtype=np.float32).ravel())

    long_factors = factors("rope_factors_long.weight")  # Phi-3's LongRoPE
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    attn_factor = float(_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0))
    if kind == "yarn":  # llama.cpp multiplies its attn_factor by YaRN's own term
        attn_factor *= yarn_attn_factor(factor)
    scaling = RopeScaling(
        kind="longrope" if long_factors is not None else kind,
        factor=factor,
        original_max_position=int(
            _field(reader, f"{arch}.rope.scaling.original_context_length", 8192)),
        freq_factors=factors("rope_freqs.weight"),
        attn_factor=attn_factor,
        short_factors=factors("rope_factors_short.weight"),
        long_factors=long_factors,
        beta_fast=float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        # gpt-oss's own config keeps the ramp's ends unrounded (truncate: false), as the
        # model was trained; llama.cpp rounds them outward, which moves a few frequencies.
        truncate=not oss,
    )
    layers = int(get("block_count"))
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    gemma = arch == "gemma3"
    if gemma:
        windows = tuple(0 if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else window
                        for i in range(layers))
    elif oss:
        windows = tuple(window if i % GPT_OSS_SLIDING_EVERY == 0 else 0 for i in range(layers))
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
        o_bias="blk.0.attn_output.bias" in names,
        attention_sinks="blk.0.attn_sinks.weight" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        layer_windows=windows,
        rope_local_theta=GEMMA3_LOCAL_THETA if gemma else 0.0,
        # GGUF's Gemma norm weights already hold 1 + w (llama.cpp adds the 1 on conversion).
        embedding_scale=hidden**0.5 if gemma else 1.0,
        norm_scale_in_float32=gemma,
        sandwich_norms=gemma,
        hidden_act="gelu_tanh" if gemma else "swiglu_oai" if oss else "silu",
        name=str(_field(reader, "general.name", "")),
        **_moe_fields(reader, arch, layers),
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
    # mixtures of experts (kvserve.models.moe.SparseMoE.load)
    "ffn_gate_inp": "router", "ffn_gate_shexp": "shared.gate", "ffn_up_shexp": "shared.up",
    "ffn_down_shexp": "shared.down_proj", "ffn_gate_inp_shexp": "shared_gate",
    "attn_sinks": "sinks",  # gpt-oss
}
# Experts' stacks [n_expert, rows, cols], each expert's matrix its own (canonical) tensor.
_GGUF_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down_proj"}


def _row_order(rows: int, n_heads: int) -> torch.Tensor:
    """The file rows of llama.cpp's interleaved q/k weight in rotate-half order (_unpermute)."""
    return _unpermute(torch.arange(rows)[:, None], n_heads)[:, 0].contiguous()


def _in_place(raw: np.ndarray, kind: str, rows: int, cols: int, heads: int | None
              ) -> GGUFTensor:
    """A matrix [rows, cols] of a type gguf_linear reads (`raw`: its blocks, [rows, bytes a
    row]), as a view of the file's memory map; its groups (for a layer that cannot read it in
    place) decoded only when asked for."""
    with warnings.catch_warnings():  # the map is read-only, and nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(raw)
    order = _row_order(rows, heads) if heads else None

    def groups():
        g = decode_groups(raw, kind, rows, cols)
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
        if cfg.architecture == "gpt-oss" and name == "attn_out_norm":
            name = "post_attention_layernorm"  # gpt-oss's MLP input norm has Gemma's name
        heads = None
        if cfg.architecture == "llama" and name in ("q", "k"):
            heads = cfg.num_heads if name == "q" else cfg.num_kv_heads
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_EXPERTS:
            prefix, proj = f"layers.{parts[1]}.experts", _GGUF_EXPERTS[parts[2]]
            if parts[3] == "bias":
                yield from _expert_biases(t, prefix, proj)
            else:
                yield from _experts(t, kind, prefix, proj)
            continue
        in_place = len(t.shape) == 2 and gguf_native(kind) and (
            t.name in ("token_embd.weight", "output.weight") or name in _PROJECTIONS
            and not (cfg.architecture == "phi3" and name in ("qkv", "up")))
        if in_place:
            cols, rows = (int(x) for x in t.shape)  # GGUF lists the inner dimension first
            w = _in_place(t.data, kind, rows, cols, heads)
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
                yield from split_fused(cfg, parts[1], kind, parts[3], w, source)
                continue
            yield f"layers.{parts[1]}.{name}.{parts[3]}", w, source
        else:
            log.warning("ignoring unknown GGUF tensor %s", t.name)


_PROJECTIONS = {"q", "k", "v", "qkv", "o_proj", "gate", "up", "down_proj", "shared.gate",
                "shared.up", "shared.down_proj"}


def _experts(t, kind: str, prefix: str, proj: str
             ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor, GgufSource | None]]:
    """A stack of experts' matrices (GGUF shape [cols, rows, n_expert]) as one tensor per
    expert, `{prefix}.{e}.{proj}.weight`. Each expert's rows are contiguous in the file:
    where gguf_linear reads the type, an expert is a view of the file's blocks, as a dense
    layer's matrix is (and goes where that would: read in place, or its codes onto the
    int4/int8 kernel); otherwise it is dequantized one expert at a time, so the stack is
    never held in float32 at once."""
    from gguf import quants

    if len(t.shape) != 3:
        raise ValueError(f"tensor {t.name}: {len(t.shape)} dimensions, expected 3 "
                         "(cols, rows, experts)")
    cols, rows, count = (int(x) for x in t.shape)
    for e in range(count):
        name = f"{prefix}.{e}.{proj}.weight"
        if gguf_native(kind):
            yield name, _in_place(t.data[e], kind, rows, cols, None), (kind, None)
            continue
        try:
            arr = quants.dequantize(t.data[e], t.tensor_type)
        except NotImplementedError as err:
            raise ValueError(f"tensor {t.name}: unsupported GGUF tensor type {kind}") from err
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(rows, cols), \
            (kind, None)


def _expert_biases(t, prefix: str, proj: str
                   ) -> Iterator[tuple[str, torch.Tensor, GgufSource | None]]:
    """A stack of experts' biases (GGUF shape [rows, n_expert], gpt-oss's) as one vector per
    expert, `{prefix}.{e}.{proj}.bias`."""
    from gguf import quants

    if len(t.shape) != 2:
        raise ValueError(f"tensor {t.name}: {len(t.shape)} dimensions, expected 2 "
                         "(rows, experts)")
    try:
        arr = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as err:
        raise ValueError(f"tensor {t.name}: unsupported GGUF tensor type "
                         f"{t.tensor_type.name}") from err
    stack = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(int(t.shape[1]),
                                                                       int(t.shape[0]))
    for e in range(stack.shape[0]):
        yield f"{prefix}.{e}.{proj}.bias", stack[e].clone(), None


# Types whose kernel groups give back gguf's dequantized floats bit for bit (q * d + m in
# float32, as gguf computes them: tests/test_gguf.py). Their 2-D tensors' floats come from
# the groups (decoded anyway for projections) instead of from gguf's slower numpy pass, a
# third of the default model's load when it was measured.
_EXACT_FROM_GROUPS = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}


@dataclass(frozen=True)
class WeightBytes:
    """A GGUF model's weights as a --quantization serves them: `resident`, the bytes held,
    and `per_token`, the bytes a decode step reads (every layer matrix and the LM head, not
    the embedding, whose lookups read one row per token); `in_place`, of resident, the
    file's own pages (a read-only map: shared, evictable). `one_token`: what a step of one
    token reads, the same but for a mixture of experts, whose token reads only its k of each
    layer's E experts (k/E of each expert stack, rounded down). `stacks`: of per_token, the
    expert stacks' bytes, `used` of `experts` a token reads (all 0 for a dense model)."""

    resident: int
    per_token: int
    in_place: int
    one_token: int
    stacks: int = 0
    experts: int = 0
    used: int = 0

    def reads(self, tokens: int) -> float:
        """Bytes a decode step of `tokens` tokens reads on average: per_token with the expert
        stacks at the share experts_read gives (uniform, independent routing). reads(1) is
        one_token before its rounding; a dense model's is per_token whatever the batch."""
        if not self.stacks:
            return float(self.per_token)
        return self.per_token - self.stacks + \
            self.stacks * experts_read(self.experts, self.used, tokens)


def gguf_weight_bytes(path: Path, dtype: torch.dtype, in_place: bool) -> WeightBytes | None:
    """WeightBytes of a GGUF file from its tensor table (no weights read), served in place
    (`--quantization gguf`) or as `auto` serves it; None for a model that is not a GGUF file.
    A matrix gguf_linear serves (in place: every type it reads; auto: gguf_auto_types()) counts
    its bytes in the file, in the file's pages (`in_place`) unless auto interleaves it at
    load (paths.INTERLEAVED_TYPES); the embedding is looked up in place when the head is served so.
    Any other quantized matrix counts the int4 or int8 tiles it is packed into (0.625 or 1.125
    bytes a weight), the embedding `dtype`'s floats and a tied head an int8 copy; float
    tensors count `dtype`'s size. An MoE layer's stack of experts counts as its matrices, every
    expert in `per_token` (a step whose tokens touch them all), k of E in `one_token`, the
    share experts_read gives in `reads(tokens)`."""
    if path.suffix != ".gguf":
        return None
    reader = open_gguf(path)
    arch = str(_field(reader, "general.architecture", ""))
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    used = int(_field(reader, f"{arch}.expert_used_count", 0) or 0)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    tied = "output.weight" not in kinds

    auto_types = quant.gguf_auto_types()

    def served(kind: str) -> bool:  # by gguf_linear
        return gguf_native(kind) and (in_place or kind in auto_types)

    head_served = served(kinds.get("output.weight", kinds.get("token_embd.weight", "")))
    resident = per_token = mapped = one_token = stacks = 0
    item = torch.empty(0, dtype=dtype).element_size()
    for t in reader.tensors:
        kind, count = t.tensor_type.name, int(np.prod([int(x) for x in t.shape]))
        matrix = len(t.shape) >= 2  # 3-D: a stack of experts' matrices
        quantized = matrix and (gguf_native(kind) or kind in INT4_SOURCES | INT8_SOURCES)
        embedding = t.name == "token_embd.weight"
        head = 0
        if matrix and (served(kind) and not embedding or
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
            stack = "_exps." in t.name and experts and used
            one_token += size * used // experts if stack else size
            stacks += size if stack else 0
        elif embedding and tied:
            per_token += size if head_served else head
            one_token += size if head_served else head
    return WeightBytes(resident, per_token, mapped, one_token, stacks,
                       experts if stacks else 0, used if stacks else 0)
