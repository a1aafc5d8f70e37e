"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, and the
mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss) over a paged KV cache. What the
families differ in is a field of ModelConfig: q/k norms, sliding windows per layer and their
RoPE base, the attention scale, Gemma's embedding scale, float32 norm scaling, norms on the
attention's and MLP's outputs, the MLP's activation, biases, attention sinks, and experts in
place of a layer's dense MLP (kvserve.models.moe).

The model sees one flat batch of tokens from many requests; which request a token belongs to
and where its K/V live is the attention backend's business (`meta`).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.config import ModelConfig, RopeScaling
from kvserve.distributed.parallel import SINGLE, TensorParallel, head_shard
from kvserve.kernels import isa, norm_kernels, ops
from kvserve.layers.linear import (
    LinearBase,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kvserve.layers.mlp import GatedMLP
from kvserve.layers.norm import RMSNorm
from kvserve.layers.quant import IN_PLACE, INT4_GROUP, DenseWeight, GGUFWeight, QuantizedWeight
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.moe import DENSE_ROWS, RouterLinear, SparseMoE

# Values a step of torch's vectorized elementwise loops takes (two 512-bit vectors of bf16).
ELEMENTWISE_STEP = 64


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, window: int = 0,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.window = window  # sliding window of this layer (0: the whole context)
        shard = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = shard.q_count, shard.kv_count
        self.head_dim = d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.o_bias, tp,
                                        [(shard.q_start * d, shard.q_count * d)])
        self.backend = backend
        # gpt-oss: each query head's sink logit (this rank's heads), in float32 whatever the
        # compute dtype (the kernel adds it to a float32 softmax).
        self.q_heads = (shard.q_start, shard.q_count, cfg.num_heads)
        self.sinks = nn.Parameter(torch.zeros(shard.q_count, dtype=torch.float32),
                                  requires_grad=False) if cfg.attention_sinks else None
        # Qwen3, Gemma 3: each head of q and k RMS-normed (one weight per head dimension)
        # before RoPE.
        norm = cfg.norm_scale_in_float32
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, norm) if cfg.qk_norm else None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: torch.Tensor, meta: object) -> torch.Tensor:
        h, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, h + 2 * hkv, self.head_dim)
        qk = qkv[:, :h + hkv]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h:h + hkv])), 1)
        qk = RotaryEmbedding.apply(qk, *rope)  # q and k heads rotated together
        out = self.backend.forward(qk[:, :h], qk[:, h:], qkv[:, h + hkv:], kv_cache, meta,
                                   self.window, self.sinks)
        return self.o_proj(out)

    def load_sinks(self, w: torch.Tensor) -> None:
        """A checkpoint's sink logits of every head into this rank's."""
        if self.sinks is None:
            raise ValueError("checkpoint has attention sinks for a model built without them")
        start, count, heads = self.q_heads
        if tuple(w.shape) != (heads,):
            raise ValueError(f"attention sinks: checkpoint shape {tuple(w.shape)} != "
                             f"{(heads,)} (one logit per query head)")
        with torch.no_grad():
            self.sinks.copy_(w[start:start + count].float())


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); with sandwich norms (Gemma) the attention's
    and the MLP's outputs are normed too before they are added. `post_attention_layernorm`
    is the MLP's input norm, as Llama checkpoints name it (Gemma's pre_feedforward_layernorm;
    its post_attention_layernorm is `attn_out_norm` here). A `sparse` layer's MLP is a
    mixture of experts."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, window: int = 0,
                 tp: TensorParallel = SINGLE, sparse: bool = False) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_scale_in_float32)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, backend, window, tp)
        self.attn_out_norm = norm() if cfg.sandwich_norms else None
        self.post_attention_layernorm = norm()
        swiglu = ((cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.hidden_act == "swiglu_oai"
                  else None)
        self.mlp: GatedMLP | SparseMoE = (
            SparseMoE(cfg, tp) if sparse else
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act == "gelu_tanh", tp,
                     swiglu=swiglu))
        self.mlp_out_norm = norm() if cfg.sandwich_norms else None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: torch.Tensor, meta: object) -> torch.Tensor:
        h = self.self_attn(rope, self.input_layernorm(x), kv_cache, meta)
        x = x + (h if self.attn_out_norm is None else self.attn_out_norm(h))
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h if self.mlp_out_norm is None else self.mlp_out_norm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta,
                                      cfg.rope_scaling)
        # Sliding-window layers with a RoPE base of their own (Gemma 3), without scaling.
        self.rotary_local = RotaryEmbedding(
            cfg.head_dim, cfg.max_position, cfg.rope_local_theta,
            RopeScaling()) if cfg.rope_local_theta else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, cfg.window(i), tp, cfg.sparse(i))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_scale_in_float32)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self._fused = None  # fused_weights(), built on first use
        # Seconds run_layers spent in each of its phases (ops().layer_phases()) since
        # take_layer_phases() last read them; made with the first fused call.
        self._phase_seconds: torch.Tensor | None = None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: object | list[object]) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden] (normed). `meta` is
        the attention metadata of every layer, or a list with each layer's (when layers
        keep block tables of their own: kv_cache.layout)."""
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale != 1.0:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        rope = self.rotary.tables(positions, x.dtype)  # once per step, shared by all layers
        local = self.rotary_local.tables(positions, x.dtype) if self.rotary_local else rope
        metas = meta if isinstance(meta, list) else [meta]
        attn = self.layers[0].self_attn
        fused = None
        if self.tp.size == 1:
            by_meta = {id(m): attn.backend.fused_inputs(m, x.dtype) for m in metas}
            if all(f is not None for f in by_meta.values()):
                fused = [by_meta[id(m)] for m in metas]
        if fused is not None:
            # All layers in one C++ call making the same ATen and kernel calls as the modules
            # below, without the modules' Python between each layer's calls.
            slots, seqs, tables, block_size, scale = zip(*fused, strict=True)
            k = ops()
            if self._phase_seconds is None:
                self._phase_seconds = torch.zeros(len(k.layer_phases()), dtype=torch.float64)
            return self.norm(k.run_layers(
                x, *rope, *local, self.fused_weights(), kv_caches, list(slots), seqs[0],
                list(tables), block_size[0], scale[0], attn.num_heads, attn.num_kv_heads,
                self.norm.eps, INT4_GROUP, self._phase_seconds))
        if len(metas) == 1:
            metas = metas * len(self.layers)
        for layer, kv_cache, m in zip(self.layers, kv_caches, metas, strict=True):
            x = layer(local if self._local_rope(layer) else rope, x, kv_cache, m)
        return self.norm(x)

    def take_layer_phases(self) -> dict[str, float]:
        """The seconds the C++ layer loop spent in each of its phases (those that took any)
        since the last call, which starts them afresh; empty where it has not run."""
        if self._phase_seconds is None:
            return {}
        seconds = self._phase_seconds.tolist()
        self._phase_seconds.zero_()
        return {n: s for n, s in zip(ops().layer_phases(), seconds, strict=True) if s}

    def _local_rope(self, layer: DecoderLayer) -> bool:
        """Whether `layer` takes the sliding layers' RoPE tables."""
        return self.rotary_local is not None and layer.self_attn.window > 0

    def fused_weights(self):
        """Every layer's tensors by name, as the C++ run_layers reads them (its
        DecoderWeights): norms, optional q/k norms, and (weight, packed, scales, bias) of
        each projection; an empty tensor for what a layer lacks. Built once."""
        if self._fused is None:
            k = ops()
            none = torch.empty(0)

            def linear(m: LinearBase, bias: torch.Tensor | None = None):
                """`bias`: in place of the layer's own (a router's, padded)."""
                if m.packed is None:
                    m.materialize()
                if bias is None:
                    bias = none if m.bias is None else m.bias
                if isinstance(m.packed, GGUFWeight):
                    return k.LinearWeights(m.weight, none, none, bias, **m.packed.gguf_parts())
                packed, scales = m.packed.fused() if m.packed is not None else (none, none)
                return k.LinearWeights(m.weight, packed, scales, bias)

            def weight(norm: RMSNorm | None) -> torch.Tensor:
                return none if norm is None else norm.weight

            absent = k.LinearWeights(none, none, none, none)

            def router(m: RouterLinear):
                """A router's weights, its bias zero-padded to the padded tile's outputs
                (run_layers adds it before cutting them: the same sums on the kept ones)."""
                if m.bias is None or not isinstance(m.packed, DenseWeight):
                    return linear(m)
                rows = -(-m.out_features // DENSE_ROWS) * DENSE_ROWS
                return linear(m, torch.cat((m.bias, m.bias.new_zeros(rows - m.out_features))))

            def activation(m: GatedMLP) -> dict:
                alpha, limit = m.swiglu if m.swiglu is not None else (0.0, 0.0)
                return {"gelu": m.gelu, "swiglu_alpha": alpha, "swiglu_limit": limit}

            def mlp(m: GatedMLP | SparseMoE) -> dict:
                """The MLP's fields: a dense layer's gate_up and down, or a sparse layer's
                experts (MoEWeights; run_layers' moe_mlp)."""
                if isinstance(m, GatedMLP):
                    return {**activation(m), "gate_up": linear(m.gate_up_proj),
                            "down": linear(m.down_proj)}
                shared = m.shared_expert
                return {**activation(m.experts[0]), "gate_up": absent, "down": absent,
                        "moe": k.MoEWeights(
                            top_k=m.top_k, normalize=m.normalize,
                            topk_softmax=m.gating == "topk_softmax", router=router(m.router),
                            gate_up=[linear(e.gate_up_proj) for e in m.experts],
                            down=[linear(e.down_proj) for e in m.experts],
                            shared_gate=absent if m.shared_gate is None
                            else router(m.shared_gate),
                            shared_gate_up=absent if shared is None
                            else linear(shared.gate_up_proj),
                            shared_down=absent if shared is None
                            else linear(shared.down_proj))}

            self._fused = k.DecoderWeights([k.LayerWeights(
                window=layer.self_attn.window, local_rope=self._local_rope(layer),
                input_norm=layer.input_layernorm.weight,
                post_attention_norm=layer.post_attention_layernorm.weight,
                attn_out_norm=weight(layer.attn_out_norm),
                mlp_out_norm=weight(layer.mlp_out_norm),
                q_norm=weight(layer.self_attn.q_norm), k_norm=weight(layer.self_attn.k_norm),
                qkv=linear(layer.self_attn.qkv_proj), o=linear(layer.self_attn.o_proj),
                sinks=none if layer.self_attn.sinks is None else layer.self_attn.sinks,
                **mlp(layer.mlp)) for layer in self.layers])
        return self._fused

    def weight_kernel(self) -> str:
        """Which kernel the projections run on, in words (for logs): the attention's, and
        the GGUF kernel's layers where it serves others (an MoE's experts, say)."""
        packed = self.layers[0].self_attn.qkv_proj.packed
        gguf = [m.packed for m in self.modules() if isinstance(m, LinearBase)
                and isinstance(m.packed, GGUFWeight)]
        if isinstance(packed, GGUFWeight) or not gguf:
            return self._projection_kernel(packed, gguf)
        return f"{self._projection_kernel(packed, gguf)}; {self._projection_kernel(gguf[0], gguf)}"

    def _projection_kernel(self, packed: object, gguf: list[GGUFWeight]) -> str:
        """The kernel of a layer packed as `packed`, in words; `gguf`: every layer on the
        GGUF kernel, counted by tensor type and by how many were interleaved at load (the
        rest are read in place)."""
        if isinstance(packed, DenseWeight):
            amx = packed.packed.dtype == torch.bfloat16 and packed.kernels.dense_uses_amx(
                self.config.hidden_size)
            stored = ({torch.bfloat16: ", bf16 weights", torch.float16: ", float16 weights"}
                      .get(packed.packed.dtype, "") if packed.packed.dtype !=
                      self.embed_tokens.weight.dtype else "")
            return "kvserve's dense kernel" + (" (AMX)" if amx else f" ({isa()}{stored})")
        if isinstance(packed, GGUFWeight):
            tensors = [(kind, x8) for p in gguf
                       for kind, x8 in zip(p.kinds, p.interleaved, strict=True)]
            kinds = Counter(kind for kind, _ in tensors)
            interleaved = sum(x8 for _, x8 in tensors)
            return (f"kvserve's GGUF kernel ({packed.kernels.gguf_path()}), the file's own "
                    "blocks: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
                    + f" tensors, {interleaved} of them interleaved at load, the rest read "
                    "in place")
        if isinstance(packed, QuantizedWeight):
            if packed.kernels is None:
                return f"torch's {packed.method} kernel"
            layers = [m.packed for m in self.modules() if isinstance(m, LinearBase)
                      and m is not self.lm_head and isinstance(m.packed, QuantizedWeight)]
            methods = Counter(p.method for p in layers)
            exact = sum(p.exact for p in layers)
            name = "VNNI" if isa() == "AVX-512" else isa()
            return (f"kvserve's {name} kernel, " + ", ".join(f"{n} {k}" for k, n in
                                                          sorted(methods.items()))
                    + f" layers, {exact} of {len(layers)} with the GGUF's own codes")
        return "torch's matmul"

    def tie_gguf_head(self) -> None:
        """A tied head whose embedding is read in place reads the same blocks (as a layer's
        GGUF tensor: in place once packed, its floats filled only for an unpacked head)."""
        gguf = self.embed_tokens.gguf
        if self.config.tie_word_embeddings and gguf is not None:
            self.lm_head.gguf_types, self.lm_head.gguf_tensors = {0: gguf.kind}, {0: gguf}

    def reads_gguf_in_place(self) -> bool:
        """Whether any weight is read in place from the GGUF file's memory map."""
        return self.embed_tokens.gguf is not None or any(
            isinstance(m, LinearBase) and isinstance(m.packed, GGUFWeight)
            for m in self.modules())

    def batch_variant_parts(self) -> list[str]:
        """The parts of a forward pass whose result for a row can depend on the other rows
        of the step (torch's CPU and GPU kernels pick their blocking, and so their summation
        order, by shape); empty when every part runs one of kvserve's batch-invariant
        kernels (see kvserve.kernels)."""
        parts = []
        attn = self.layers[0].self_attn
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        if attn.backend.ops_for(dtype, device) is None:
            parts.append("attention on torch's ops")
        if any(isinstance(m, LinearBase) and m.packed is None for m in self.modules()):
            parts.append("matmuls on torch's F.linear")
        if norm_kernels(dtype, device) is None:
            parts.append("RMSNorm on torch's ops")
        # torch's elementwise kernels (the MLP's SiLU/GELU) take a scalar path for the last
        # values of a tensor, which differs from the vector path in the last bit: a row's
        # activations are its own only when the rows fill whole vector steps.
        odd = sorted({n for m in self.modules() if isinstance(m, GatedMLP)
                      if (n := m.gate_up_proj.out_features // 2) % ELEMENTWISE_STEP})
        if odd:
            parts.append(f"the MLP activation over {', '.join(map(str, odd))} features (not a "
                         f"multiple of {ELEMENTWISE_STEP}: torch's elementwise tail)")
        if self.tp.size > 2:
            parts.append(f"the all-reduce over {self.tp.size} ranks (its summation order "
                         "follows the message size)")
        return parts

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [T, vocab] in float32, only for the rows the caller selected (the sampled
        positions). Under tensor parallelism every rank must call this; the full logits come
        back on rank 0 and None on the others."""
        logits = self.tp.gather_last_dim(self.lm_head(hidden).float())
        if logits is None or logits.shape[-1] == self.config.vocab_size:
            return logits
        return logits[:, :self.config.vocab_size]  # the last shard's zero padding

    def pack_(self, quantization: str) -> None:
        """Every projection in the form its kernel reads (see LinearBase.pack_): quantized
        copies for int4/int8/auto, where the LM head gets int8 whatever the method (its logits
        feed sampling directly); the weights repacked for the dense kernel for none. Under
        gguf (IN_PLACE) the layers, the embedding and the head (tied or not) read the file's
        own blocks in place where gguf_linear reads their types; so does `auto` where they
        are of GGUF_AUTO_TYPES (interleaved at load)."""
        self._fused = None
        for module in self.modules():
            if isinstance(module, LinearBase) and module is not self.lm_head:
                module.pack_(quantization)
        head, embedding = self.lm_head, self.embed_tokens
        native = None
        if quantization == IN_PLACE or quantization == "auto" and head.auto_reads_gguf():
            native = head.gguf_weight(interleave=quantization == "auto")
        if native is not None:  # the embedding too stays in place: looked up row by row
            head.packed = native
            head.weight = nn.Parameter(head.weight.data.new_empty(0), requires_grad=False)
            return
        # Any other form re-packs the file's weights (the weight cache keeps them): the
        # embedding too is held as floats then.
        if quantization != IN_PLACE or self.config.tie_word_embeddings:
            embedding.materialize()
        if self.config.tie_word_embeddings:
            head.gguf_tensors = {}
            head.weight = embedding.weight
        # The head's weight stays: it is the tied embedding, or the MTP drafter reads it.
        head.pack_("none" if quantization == "none" else "int8", keep_weight=True)
