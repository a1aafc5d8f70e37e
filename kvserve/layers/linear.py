"""Linear layers laid out for tensor parallelism.

A column-parallel layer splits its output features across ranks (each rank computes a slice of
the heads or of the FFN), a row-parallel layer splits its input features and sums the partial
results. With `tp_size == 1` both are ordinary linears; the weight loaders already cut the
full checkpoint tensor into this rank's shard, so a tensor-parallel runner only has to pass a
rank and a process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvserve.layers.quant import SMALL_BATCH, QuantizedWeight


class LinearBase(nn.Module):
    """y = x W^T (+ b). `tp_dim` is the weight dimension that is sharded: 0 (output features,
    column parallel), 1 (input features, row parallel) or None (replicated)."""

    tp_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        shape = [out_features, in_features]
        if self.tp_dim is not None:
            if shape[self.tp_dim] % tp_size:
                raise ValueError(f"{shape[self.tp_dim]} features do not split over {tp_size} ranks")
            shape[self.tp_dim] //= tp_size
        self.in_features, self.out_features = shape[1], shape[0]
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        # A row-parallel bias is added once, after the reduction, so it is never sharded.
        bias_len = shape[0]
        self.bias = nn.Parameter(torch.empty(bias_len), requires_grad=False) if bias else None
        self.quantized: QuantizedWeight | None = None

    def quantize_(self, method: str) -> None:
        """Add a weight-only quantized copy of the (loaded) weight, used for small batches."""
        self.quantized = QuantizedWeight(self.weight.data, method)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias: the quantized kernel for small batches when there is one."""
        if self.quantized is not None and x.shape[0] <= SMALL_BATCH:
            return self.quantized.matmul(x)
        return F.linear(x, self.weight)

    def _shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp_size == 1:
            return full
        size = full.shape[dim] // self.tp_size
        return full.narrow(dim, self.tp_rank * size, size)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy a full (unsharded) checkpoint weight [out, in] and bias into this rank's shard."""
        if self.tp_dim is not None:
            weight = self._shard(weight, self.tp_dim)
        _copy(self.weight, weight, "weight")
        if bias is not None:
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a layer built without one")
            _copy(self.bias, self._shard(bias, 0) if self.tp_dim == 0 else bias, "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(LinearBase):
    tp_dim = None


class ColumnParallelLinear(LinearBase):
    tp_dim = 0


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate and up of the MLP); each part is sharded on its own."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size)
        self.output_sizes = [s // tp_size for s in output_sizes]

    def load_part(self, index: int, tensor: torch.Tensor, what: str = "weight") -> None:
        """Copy the full checkpoint weight (or bias) of part `index` into its rows."""
        start = sum(self.output_sizes[:index])
        size = self.output_sizes[index]
        dst = self.weight if what == "weight" else self.bias
        if dst is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        _copy(dst.narrow(0, start, size), self._shard(tensor, 0), f"part {index} {what}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q, k and v projections; heads are split across ranks (KV heads too)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1) -> None:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden, sizes, bias, tp_rank, tp_size)

    def load_qkv(self, name: str, tensor: torch.Tensor, what: str = "weight") -> None:
        self.load_part("qkv".index(name), tensor, what)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed over the group."""

    tp_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, group: dist.ProcessGroup | None = None):
        super().__init__(in_features, out_features, bias, tp_rank, tp_size)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != expected "
                         f"{tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)
