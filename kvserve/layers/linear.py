"""Linear layers laid out for tensor parallelism.

A column-parallel layer splits its output features across ranks (each rank computes a slice of
the heads or of the FFN), a row-parallel layer splits its input features and sums the partial
results. With one rank both are ordinary linears. Each layer knows which rows or columns of
the full checkpoint tensor it holds, so loading is the same call on every rank: `load` cuts
the full tensor down to this rank's shard.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.distributed.parallel import (
    SINGLE,
    TensorParallel,
    head_shard,
    split,
    vocab_shard,
)
from kvserve.layers import quant
from kvserve.layers.quant import (
    IN_PLACE,
    INT4_GROUP,
    DenseWeight,
    GGUFTensor,
    GGUFWeight,
    PackedWeight,
    QuantGroups,
    QuantizedWeight,
    quantization_class,
)

T = TypeVar("T")
Ranges = list[tuple[int, int]]  # (start, size) ranges of the full tensor, in shard order


class LinearBase(nn.Module):
    """y = x W^T (+ b). `tp_dim` is the weight dimension that is sharded: 0 (output features,
    column parallel), 1 (input features, row parallel) or None (replicated); `ranges` are the
    pieces of that dimension this rank holds."""

    tp_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallel = SINGLE, ranges: Ranges | None = None) -> None:
        super().__init__()
        self.tp = tp
        shape = [out_features, in_features]
        if self.tp_dim is not None:
            self.ranges = ranges if ranges is not None else [split(shape[self.tp_dim],
                                                                   tp.size, tp.rank)]
            shape[self.tp_dim] = sum(size for _, size in self.ranges)
        self.in_features, self.out_features = shape[1], shape[0]
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        # A row-parallel bias is added once, after the reduction, so it is never sharded.
        self.bias = nn.Parameter(torch.empty(shape[0]), requires_grad=False) if bias else None
        # The form the matmul reads (pack_); None: torch's F.linear on `weight`.
        self.packed: PackedWeight | None = None
        # Row-parallel shards: each full row's largest magnitude, so an int8 copy scales a
        # shard as one process scales the whole row and both compute with the same integers.
        self.row_absmax: torch.Tensor | None = None
        # Per part (0 for a plain layer), the GGUF type its weight came as and, where that type
        # has an exact form, its blocks as the VNNI kernel's groups (this rank's shard).
        self.gguf_types: dict[int, str] = {}
        self.gguf_groups: dict[int, QuantGroups | None] = {}
        # Per part, its blocks in place in the GGUF file (an unsharded layer whose parts'
        # types gguf_linear reads): `weight` is not filled unless packing falls back to it.
        self.gguf_tensors: dict[int, GGUFTensor] = {}

    def pack_(self, quantization: str, keep_weight: bool = False) -> None:
        """Put the (loaded) weight in the form its kernel reads: a quantized copy (int4,
        int8), or unquantized, repacked for the dense kernel where there is one. That form
        then serves every batch and the weight itself goes (an empty tensor of its dtype
        stays in its place) unless `keep_weight`; so do its GGUF groups, which only packing
        reads (and a layer without its weight cannot be packed again).

        `gguf` (IN_PLACE) serves a layer whose every part is a GGUF tensor of a type
        gguf_linear reads in the file's own blocks, in place (GGUFWeight), and any other layer
        as `auto` does. `auto` does the same for a layer whose parts are all of
        quant.gguf_auto_types() (GGUF_AUTO_TYPES where gguf_linear has a vector path), each
        interleaved at load (the same results). Otherwise a GGUF weight whose type has an
        exact form (see models/gguf_quants.py) keeps its own codes on the VNNI kernel, 4-bit
        ones widened to 8 for int8 or where parts mix; other weights are quantized again.
        `auto` (per layer): the layer's own GGUF precision class, none for float weights."""
        if quantization == IN_PLACE or quantization == "auto" and self.auto_reads_gguf():
            if (native := self.gguf_weight(interleave=quantization == "auto")) is not None:
                self.packed = native
                self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)
                return
            quantization = "auto"
        self.materialize()
        w = self.weight.data
        if quantization == "auto":
            quantization = quantization_class(self.gguf_types.values())
        groups = self._source_groups(quantization) if quantization != "none" else None
        if groups is not None and (packed := QuantizedWeight.from_groups(
                groups, w.dtype, w.device)) is not None:
            self.packed = packed
        elif quantization != "none":
            # Per-group int8 of a row-parallel shard cut at group boundaries is the same as
            # one process's; other shards scale by their whole rows on torch's kernel.
            aligned = self.tp_dim != 1 or all(
                start % INT4_GROUP == 0 and size % INT4_GROUP == 0 for start, size in self.ranges)
            self.packed = QuantizedWeight(w, quantization, None if aligned else self.row_absmax)
        elif kernels.dense_kernels(w.dtype, w.device, *w.shape) is not None:
            self.packed = DenseWeight(w)
        else:
            return
        if not keep_weight:
            self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
            self.gguf_groups = {}

    def gguf_weight(self, interleave: bool = False) -> GGUFWeight | None:
        """The layer served from its GGUF blocks in place (those with an interleaved layout,
        paths.INTERLEAVED_TYPES, interleaved at load with `interleave`), where every part has
        them and gguf_linear reads their types here; else None."""
        parts = self._per_part(self.gguf_tensors)
        if any(p is None for p in parts):
            return None
        w = self.weight
        if kernels.gguf_kernels(w.dtype, w.device, [p.type_id for p in parts]) is None:
            return None
        return GGUFWeight(parts, w.dtype, w.device, interleave)

    def _per_part(self, held: dict[int, T]) -> list[T | None]:
        """`held`'s entry for each part of the layer (one for a plain layer), None where
        it has none."""
        return [held.get(i) for i in range(max(len(self.gguf_types), 1))]

    def auto_reads_gguf(self) -> bool:
        """Whether `auto` serves this layer on gguf_linear: every part is held in place, of a
        type auto reads in place here (gguf_auto_types)."""
        parts = self._per_part(self.gguf_tensors)
        types = quant.gguf_auto_types()
        return all(p is not None and p.kind in types for p in parts)

    def materialize(self) -> None:
        """Fill `weight` (and the GGUF groups) from the parts still in the file's blocks."""
        offsets = getattr(self, "part_ranges", None)
        for index, t in sorted(self.gguf_tensors.items()):
            local = sum(s for _, s in offsets[:index]) if offsets else 0
            _copy(self.weight.data.narrow(0, local, t.rows), t.dequantized(), "weight")
            self.gguf_groups[index] = t.groups() if t.groups is not None else None
        self.gguf_tensors = {}

    def full_weight(self) -> torch.Tensor:
        """The float weight [out, in], from the GGUF blocks when the layer reads those."""
        if isinstance(self.packed, GGUFWeight):
            return torch.cat([p.dequantized() for p in self.packed.parts]).to(
                self.weight.dtype)
        self.materialize()
        return self.weight

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the float weight [len(ids), in]: from a one-part GGUF weight only those
        rows are dequantized (a 152k-row LM head is 0.9 GB as float32)."""
        if isinstance(self.packed, GGUFWeight) and len(self.packed.parts) == 1:
            return self.packed.parts[0].dequantized(ids.cpu(), self.weight.dtype).to(ids.device)
        return self.full_weight().detach()[ids].clone()

    def _in_place(self, weight: torch.Tensor | GGUFTensor, index: int, rows: int
                  ) -> torch.Tensor | None:
        """Keep a GGUF tensor of an unsharded layer in place (part `index`, `rows` rows): None.
        Otherwise the float weight to copy (a GGUF tensor dequantized, its groups noted)."""
        if not isinstance(weight, GGUFTensor):
            return weight
        self.gguf_types[index] = weight.kind
        if self.tp.size == 1 and weight.rows == rows:
            self.gguf_tensors[index] = weight
            return None
        self.gguf_groups[index] = weight.groups() if weight.groups is not None else None
        return weight.dequantized()

    def _source_groups(self, quantization: str) -> QuantGroups | None:
        """The GGUF groups of every part, in row order, as `quantization` holds them; None
        when a part has none or int4 was asked of 8-bit codes."""
        parts = self._per_part(self.gguf_groups)
        if not parts or any(g is None for g in parts):
            return None
        if quantization == "int4" and any(g.bits == 8 for g in parts):
            return None
        # Scales per 16 inputs (Q6_K) and per 32 do not share one packed form.
        if len({g.group for g in parts}) > 1:
            return None
        bits = 8 if quantization == "int8" or any(g.bits == 8 for g in parts) else 4
        return QuantGroups(torch.cat([g.q for g in parts]), torch.cat([g.d for g in parts]),
                           torch.cat([g.m for g in parts]), bits, parts[0].group)

    def _shard_groups(self, g: QuantGroups | None, rows: tuple[int, int] | None
                      ) -> QuantGroups | None:
        """This rank's part of a full weight's groups: `rows` (start, size) of a column
        shard, or the column ranges of a row-parallel shard when they fall on groups."""
        if g is None:
            return None
        if rows is not None:
            start, size = rows
            return QuantGroups(g.q[start:start + size], g.d[start:start + size],
                               g.m[start:start + size], g.bits, g.group)
        if self.tp_dim != 1 or self.tp.size == 1:
            return g
        # Cut at the kernel's groups of 32 (a tile's inputs), whatever the scales' group.
        if any(start % INT4_GROUP or size % INT4_GROUP for start, size in self.ranges):
            return None
        cols = [(s // g.group, n // g.group) for s, n in self.ranges]
        return QuantGroups(torch.cat([g.q[:, s:s + n] for s, n in self.ranges], 1),
                           torch.cat([g.d[:, s:s + n] for s, n in cols], 1),
                           torch.cat([g.m[:, s:s + n] for s, n in cols], 1), g.bits, g.group)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias."""
        if self.packed is not None:
            return self.packed.matmul(x)
        if self.gguf_tensors:  # an unpacked layer computes on its float weight
            self.materialize()
        return F.linear(x, self.weight)

    def _shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp_dim is None or dim != self.tp_dim:
            return full
        if len(self.ranges) == 1 and self.ranges[0] == (0, full.shape[dim]):
            return full
        return torch.cat([full.narrow(dim, start, size) for start, size in self.ranges], dim)

    def load(self, weight: torch.Tensor | GGUFTensor, bias: torch.Tensor | None = None,
             gguf: tuple[str, QuantGroups | None] | None = None) -> None:
        """Copy a full (unsharded) checkpoint weight [out, in] and bias into this rank's shard;
        `gguf`: the weight's GGUF type and its groups (see pack_). A GGUFTensor of an
        unsharded layer stays in the file's blocks (see pack_)."""
        if isinstance(weight, GGUFTensor):
            kind = weight.kind
            full = self._in_place(weight, 0, self.out_features)
            if full is not None:
                weight, gguf = full, (kind, self.gguf_groups.get(0))
        if isinstance(weight, torch.Tensor):
            _copy(self.weight, self._shard(weight, self.tp_dim or 0), "weight")
            self._note_source(weight, gguf)
        if bias is not None:
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a layer built without one")
            _copy(self.bias, self._shard(bias, 0), "bias")

    def load_bias(self, bias: torch.Tensor) -> None:
        """A checkpoint's bias alone (its weight comes as a tensor of its own)."""
        if self.bias is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        _copy(self.bias, self._shard(bias, 0), "bias")

    def _note_source(self, weight: torch.Tensor,
                     gguf: tuple[str, QuantGroups | None] | None) -> None:
        if gguf is not None:
            kind, groups = gguf
            if self.tp_dim == 0 and len(self.ranges) > 1:
                groups = None  # rows from several ranges: quantized again from the shard
            rows = self.ranges[0] if self.tp_dim == 0 else None
            self.gguf_types[0] = kind
            self.gguf_groups[0] = self._shard_groups(groups, rows)
        if self.tp_dim == 1 and self.tp.size > 1:
            # from the weight as stored (compute dtype), as quantize_ sees it in one process
            self.row_absmax = weight.to(self.weight.dtype).float().abs().amax(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(LinearBase):
    tp_dim = None


class ColumnParallelLinear(LinearBase):
    tp_dim = 0


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate and
    up of the MLP); each part is sharded on its own, by `part_ranges` (part -> the (start,
    size) of its rows this rank holds) or near-evenly."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp: TensorParallel = SINGLE, part_ranges: list[tuple[int, int]] | None = None):
        part_ranges = part_ranges or [split(s, tp.size, tp.rank) for s in output_sizes]
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        super().__init__(in_features, sum(output_sizes), bias, tp,
                         [(off + start, size) for off, (start, size)
                          in zip(offsets, part_ranges, strict=True)])
        self.part_ranges = part_ranges

    def load_part(self, index: int, tensor: torch.Tensor | GGUFTensor, what: str = "weight",
                  gguf: tuple[str, QuantGroups | None] | None = None) -> None:
        """Copy the full checkpoint weight (or bias) of part `index` into its rows; `gguf`:
        the weight's GGUF type and its groups (see pack_). A GGUFTensor of an unsharded layer
        stays in the file's blocks (see pack_)."""
        start, size = self.part_ranges[index]
        if isinstance(tensor, GGUFTensor):
            full = self._in_place(tensor, index, size)
            if full is None:
                return
            tensor, gguf = full, (tensor.kind, self.gguf_groups.get(index))
        local = sum(s for _, s in self.part_ranges[:index])
        dst = self.weight if what == "weight" else self.bias
        if dst is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        _copy(dst.narrow(0, local, size), tensor.narrow(0, start, size), f"part {index} {what}")
        if gguf is not None and what == "weight":
            self.gguf_types[index] = gguf[0]
            self.gguf_groups[index] = self._shard_groups(gguf[1], (start, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q, k and v projections; each rank computes the heads `head_shard` gives it."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TensorParallel = SINGLE) -> None:
        s = head_shard(num_heads, num_kv_heads, tp.rank, tp.size)
        q = (s.q_start * head_dim, s.q_count * head_dim)
        kv = (s.kv_start * head_dim, s.kv_count * head_dim)
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden, sizes, bias, tp, [q, kv, kv])

    def load_qkv(self, name: str, tensor: torch.Tensor | GGUFTensor, what: str = "weight",
                 gguf: tuple[str, QuantGroups | None] | None = None) -> None:
        self.load_part("qkv".index(name), tensor, what, gguf)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed over the group."""

    tp_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ranks. Every rank holds the same number
    of rows (`rows_per_rank`, the last rank's padded with zeros) so the tied LM head's logit
    shards can be gathered as equal pieces. A rank looks up the ids in its range, zeros the
    rest, and the all-reduce assembles the full embedding (each sum has one nonzero term)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.rows_per_rank = vocab_shard(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden), requires_grad=False)
        # The GGUF tensor whose blocks the lookups dequantize in place (no float copy of the
        # vocabulary): an unsharded embedding of a type gguf_rows reads. `weight` is then an
        # empty tensor of the compute dtype.
        self.gguf: GGUFTensor | None = None

    def load(self, weight: torch.Tensor | GGUFTensor) -> None:
        if isinstance(weight, GGUFTensor):
            w = self.weight
            if (self.tp.size == 1 and weight.rows == self.rows_per_rank and
                    kernels.gguf_kernels(w.dtype, w.device, [weight.type_id]) is not None):
                self.gguf = weight
                self.weight = nn.Parameter(w.data.new_empty(0), requires_grad=False)
                return
            weight = weight.dequantized()
        _copy_vocab_rows(self.weight, weight, self.start, "embedding")

    def full_weight(self) -> torch.Tensor:
        """The float embedding [rows, hidden], dequantized when it is read in place."""
        if self.gguf is None:
            return self.weight
        return self.gguf.dequantized().to(self.weight.dtype)

    def materialize(self) -> None:
        """Hold the embedding as floats (a float LM head tied to it needs them)."""
        if self.gguf is not None:
            self.weight = nn.Parameter(self.full_weight(), requires_grad=False)
            self.gguf = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf is not None:
            return self.gguf.dequantized(ids, self.weight.dtype)
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows_per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))


class ParallelLMHead(ColumnParallelLinear):
    """The output projection, its vocabulary split like `VocabParallelEmbedding`'s (equal,
    zero-padded shards, so a tied head shares the embedding's shard): each rank computes its
    slice of the logits; `LlamaForCausalLM.compute_logits` gathers them on rank 0."""

    def __init__(self, hidden: int, vocab_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(hidden, vocab_size, False, tp, [vocab_shard(vocab_size, tp.rank,
                                                                     tp.size)])

    def load(self, weight: torch.Tensor | GGUFTensor, bias: torch.Tensor | None = None,
             gguf: tuple[str, QuantGroups | None] | None = None) -> None:
        if isinstance(weight, GGUFTensor):
            weight = self._in_place(weight, 0, self.out_features)
            if weight is None:
                return
        _copy_vocab_rows(self.weight, weight, self.ranges[0][0], "lm_head")


def _copy_vocab_rows(dst: torch.Tensor, full: torch.Tensor, start: int, what: str) -> None:
    """Copy a vocabulary shard's rows of `full` into `dst`, zeroing its padding rows."""
    part = full[start:start + dst.shape[0]]
    with torch.no_grad():
        dst[len(part):].zero_()
    _copy(dst[:len(part)], part, what)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != expected "
                         f"{tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)
