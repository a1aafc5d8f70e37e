"""The gated MLP of Llama-family decoders: down(act(gate(x)) * up(x)), gate and up one matmul.
A dense layer's MLP, and each expert (and the shared expert) of a mixture of experts; gpt-oss's
experts gate with a clamped SwiGLU and carry biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel import SINGLE, TensorParallel
from kvserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kvserve.layers.quant import GGUFTensor, QuantGroups


class GatedMLP(nn.Module):
    """SwiGLU (`gelu`: GELU-tanh gating, Gemma's) of `intermediate` features, column- then
    row-parallel under tensor parallelism. `swiglu` (alpha, limit): gpt-oss's clamped form,
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with g = min(gate, limit).
    `bias`: both projections carry one (gpt-oss's experts)."""

    def __init__(self, hidden: int, intermediate: int, gelu: bool = False,
                 tp: TensorParallel = SINGLE, bias: bool = False,
                 swiglu: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp)
        self.gelu = gelu
        self.swiglu = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._activated(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of forward(x), before the sum over ranks (forward(x) itself on
        one rank): a mixture of experts weights and adds its experts' shares first, then
        sums once a layer instead of once an expert. The down projection's bias (never
        sharded) is rank 0's share."""
        y = self.down_proj.matmul(self._activated(x))
        bias = self.down_proj.bias
        return y if bias is None or self.down_proj.tp.rank else y + bias

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        """The activation as run_layers' `activate` computes it, op for op (so the same bits)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.swiglu is not None:
            alpha, limit = self.swiglu
            g = gate.clamp_max(limit)
            glu = g * torch.sigmoid(g * alpha)
            return (up.clamp(-limit, limit) + 1) * glu
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return act * up

    def load(self, kind: str, w: torch.Tensor | GGUFTensor, what: str = "weight",
             source: tuple[str, QuantGroups | None] | None = None) -> None:
        """A checkpoint's full `gate`, `up` or `down_proj` tensor (`what`: weight or bias)
        into this rank's shard; `source`: its GGUF type and groups (LinearBase.pack_)."""
        if kind in ("gate", "up"):
            self.gate_up_proj.load_part(0 if kind == "gate" else 1, w, what, source)
        elif kind == "down_proj" and what == "bias":
            self.down_proj.load_bias(w)
        elif kind == "down_proj":
            self.down_proj.load(w, gguf=source)
        else:
            raise ValueError(f"unexpected MLP tensor {kind}.{what}")
