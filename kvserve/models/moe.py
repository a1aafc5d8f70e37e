"""The mixture-of-experts MLP of Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss as torch modules: the
reference for the C++ layer loop, which computes the same bits in one call a step (run_layers'
moe_mlp: moe_route, every used expert's rows on gguf_grouped, moe_combine; tests/test_moe.py
compares the two), and the path where that loop does not run (no C++ kernels, another device).

A sparse layer's MLP routes each token to `k` of its experts:

    router logits [T, E] -> softmax (float32) -> the k largest, ties to the lower expert id
      -> renormalized over those k where the model says (norm_topk_prob)
      (gpt-oss: the router has a bias, and its k largest logits, chosen the same way, are
      weighted by a softmax over those k)
    token rows grouped by expert (a stable sort by expert id, then position)
      -> each used expert's rows in one matmul (gate and up fused) -> down
    each token's k weighted outputs summed in the order of their expert ids (+ Qwen2-MoE's
    shared expert times sigmoid(its gate))

Determinism: every part computes a row from that row alone, in an order fixed by the row:
the matmuls are kvserve's batch-invariant kernels (a row's result does not depend on how
many rows share the expert's matmul; see LlamaForCausalLM.batch_variant_parts for where
none runs), the top-k is a stable sort of the row's own probabilities, the k outputs are
added one after another in expert-id order, and the shared expert's gate is computed row by
row (_sigmoid_by_row). The experts' SiLU is torch's, as the dense MLP's is: a row's own where
the width is a multiple of the vector loop's step (batch_variant_parts names other widths).
So a token's output does not depend on which other tokens share the step or its experts.

Each expert is a GatedMLP of its own, so its weights take whatever form the dense MLP's would
(--quantization: the GGUF's own blocks in place, their codes on the int4/int8 kernel, or
floats): experts are never widened to float copies where a dense layer would not be.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve import kernels
from kvserve.config import ModelConfig
from kvserve.distributed.parallel import SINGLE, TensorParallel
from kvserve.layers.linear import ReplicatedLinear
from kvserve.layers.mlp import GatedMLP
from kvserve.layers.quant import DenseWeight, GGUFTensor, QuantGroups

DENSE_ROWS = 16  # dense_linear's tile of outputs (kernels.dense_kernels: n a multiple of 16)


class RouterLinear(ReplicatedLinear):
    """A projection to a few outputs that stays in floats whatever --quantization says: an MoE
    router (its logits choose the experts, and a quantized copy would change the choice;
    llama.cpp keeps routers in float too) and Qwen2-MoE's shared-expert gate (one output).
    Its rows are padded with zeros to a multiple of the dense kernel's tile, so it runs on
    kvserve's batch-invariant dense_linear rather than torch's F.linear (8 experts, or one
    gate, are not a tile); the padding's outputs are cut off."""

    def pack_(self, quantization: str, keep_weight: bool = False) -> None:
        self.materialize()
        w = self.weight.data
        n, k = w.shape
        rows = -(-n // DENSE_ROWS) * DENSE_ROWS
        if kernels.dense_kernels(w.dtype, w.device, rows, k) is None:
            return  # torch's F.linear (batch_variant_parts says so)
        self.packed = DenseWeight(torch.cat((w, w.new_zeros(rows - n, k))))
        if not keep_weight:
            self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
            self.gguf_groups = {}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = super().matmul(x)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features].contiguous()


def experts_read(experts: int, used: int, tokens: int) -> float:
    """The expected share of a layer's `experts` that a step of `tokens` tokens reads, each
    token routed to `used` distinct experts of them: 1 - (1 - used/experts)**tokens (one
    token: used/experts exactly; 0 tokens: 0; used == experts: all of them).

    Assumes each token's experts are a uniformly random `used` of the `experts`, independent
    of every other token's. The figure is an expectation, not a bound on any one step: a
    router skewed toward popular experts (tokens routed alike) reads fewer, tokens that
    favour different experts more. The one rule the cost models (kvserve roofline's,
    kvserve plan's) count expert bytes by."""
    if not 0 < used <= experts or tokens < 0:
        raise ValueError(f"{used} experts used of {experts}, {tokens} tokens")
    return 1.0 - (1.0 - used / experts) ** tokens


def route(logits: torch.Tensor, k: int, normalize: bool, gating: str = "softmax"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), each row's
    k experts in ascending id order (the order their outputs are summed in).

    The experts are the k largest of the row's softmax (in float32, as transformers computes
    it), taken from a stable descending sort: among equal probabilities the lower expert id
    comes first, whatever the batch. `normalize` (norm_topk_prob; Mixtral always): the k
    weights divided by their sum, else the softmax's own values (Qwen2-MoE's default).
    `gating` "topk_softmax" (gpt-oss): the k largest logits, chosen the same way, weighted by
    a softmax over those k (in rank order; `normalize` has nothing to add)."""
    scores = logits.float().contiguous()
    if gating == "topk_softmax":
        ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
        weights = torch.softmax(ranked.values[:, :k].contiguous(), dim=-1)
        ids, pos = ranked.indices[:, :k].sort(dim=-1)
        return weights.gather(1, pos), ids
    probs = torch.softmax(scores, dim=-1)
    ranked = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = ranked.values[:, :k], ranked.indices[:, :k]
    if normalize:  # the sum added in rank order, one addition at a time
        total = weights[:, 0]
        for j in range(1, k):
            total = total + weights[:, j]
        weights = weights / total[:, None]
    ids, pos = ids.sort(dim=-1)  # distinct ids: no ties
    return weights.gather(1, pos), ids


class SparseMoE(nn.Module):
    """A sparse layer's MLP: `num_experts` GatedMLPs, a router and, for Qwen2-MoE, a shared
    expert with its sigmoid gate.

    Under tensor parallelism every rank holds every expert, each cut by its intermediate
    features as a dense MLP is (gate/up by output rows, down by input columns), and the
    router and shared gate whole. Each rank routes the same tokens to the same experts,
    weights and adds its experts' partial outputs, and the layer's output is summed over
    the ranks once. Cutting by features rather than handing whole experts to ranks keeps
    every rank's work equal whatever the routing (at batch 1 a token's k experts would fall
    unevenly on the ranks, and the step waits for the busier one) and needs no exchange of
    token rows between ranks: one all-reduce a layer, as a dense MLP has."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gating = cfg.moe_gating
        hidden, gelu = cfg.hidden_size, cfg.hidden_act == "gelu_tanh"
        swiglu = ((cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.hidden_act == "swiglu_oai"
                  else None)
        self.router = RouterLinear(hidden, cfg.num_experts, cfg.moe_bias)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, cfg.moe_intermediate_size, gelu, tp, cfg.moe_bias, swiglu)
            for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden, shared, gelu, tp) if shared else None
        self.shared_gate = RouterLinear(hidden, 1) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(x), self.top_k, self.normalize, self.gating)
        out = self._experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_gate is not None:
            out = out + _sigmoid_by_row(self.shared_gate(x)) * self.shared_expert.partial(x)
        return self.tp.all_reduce(out)  # one rank: out itself

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                 ) -> torch.Tensor:
        """The routed experts' weighted sum for each row of x [T, H]. Slot s = (token
        s // k, its (s % k)-th expert by id); slots are grouped by expert, in slot order
        within one, and each used expert runs once on its rows. The products are kept in
        float32 and a token's k of them added in slot (= expert id) order, then rounded once
        to x's dtype."""
        t, k = ids.shape
        hidden = x.shape[1]
        flat = ids.flatten()
        order = torch.sort(flat, stable=True).indices  # by expert id, then by slot
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        w = weights.flatten()
        slots = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n == 0:
                continue  # an expert no row uses is not read
            rows = order[start:start + n]
            start += n
            slots[rows] = expert.partial(x[rows // k]).float() * w[rows, None]
        slots = slots.view(t, k, hidden)
        out = slots[:, 0]
        for j in range(1, k):  # one addition at a time: a fixed order per row
            out = out + slots[:, j]
        return out.to(x.dtype)

    def load(self, name: list[str], w: torch.Tensor | GGUFTensor,
             source: tuple[str, QuantGroups | None] | None) -> None:
        """A checkpoint tensor by its canonical name within the layer (split at the dots):
        router.weight, experts.E.{gate,up,down_proj}.weight, shared.{gate,up,down_proj}.weight
        or shared_gate.weight; router.bias and experts.E.{gate,up,down_proj}.bias (gpt-oss)."""
        joined = ".".join(name)
        if name == ["router", "bias"]:
            self.router.load_bias(w)
        elif name[0] == "router" and len(name) == 2:
            self.router.load(_dense(w, self.router, joined))
        elif name[0] == "experts" and len(name) == 4 and name[1].isdigit() and \
                int(name[1]) < len(self.experts):
            self.experts[int(name[1])].load(name[2], w, name[3], source)
        elif name[0] == "shared" and len(name) == 3 and self.shared_expert is not None:
            self.shared_expert.load(name[1], w, name[2], source)
        elif name[0] == "shared_gate" and len(name) == 2 and self.shared_gate is not None:
            self.shared_gate.load(_dense(w, self.shared_gate, joined))
        else:
            raise ValueError(f"unexpected tensor {joined} in a mixture-of-experts layer")


def _sigmoid_by_row(g: torch.Tensor) -> torch.Tensor:
    """sigmoid(g) of a gate g [T, 1], as softmax([g, 0])'s first column. torch's sigmoid (as
    its other elementwise kernels) runs a vector path and, for a tensor's last few values, a
    scalar one, and the two differ in the last bit: a row's gate would depend on how many
    rows follow it in the step. Softmax computes each row on its own."""
    return torch.softmax(torch.cat((g, torch.zeros_like(g)), dim=1), dim=1)[:, :1]


def _dense(w: torch.Tensor | GGUFTensor, layer: RouterLinear, name: str) -> torch.Tensor:
    """A router's (or shared gate's) weight as [out, in] floats: a GGUF stores the shared
    gate as one vector."""
    if isinstance(w, GGUFTensor):
        w = w.dequantized()
    if w.numel() != layer.out_features * layer.in_features:
        raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != expected "
                         f"{(layer.out_features, layer.in_features)}")
    return w.reshape(layer.out_features, layer.in_features)


def moe_tensor_names(cfg: ModelConfig, layer: int) -> set[str]:
    """The canonical names of sparse layer `layer`'s MLP tensors, each of which a checkpoint
    must hold."""
    what = ("weight", "bias") if cfg.moe_bias else ("weight",)
    names = {f"layers.{layer}.router.{w}" for w in what}
    for e in range(cfg.num_experts):
        names |= {f"layers.{layer}.experts.{e}.{k}.{w}" for k in ("gate", "up", "down_proj")
                  for w in what}
    if cfg.shared_expert_intermediate_size:
        names |= {f"layers.{layer}.shared.{k}.weight" for k in ("gate", "up", "down_proj")}
        names.add(f"layers.{layer}.shared_gate.weight")
    return names
