"""The attention backend contract.

Per step the model runner describes the batch once (`AttentionBatch`); the backend turns that
into whatever metadata it needs (`build_metadata`, once per step, shared by every layer), then
each layer calls `forward`, which must first write the step's new K/V into the paged cache and
only then read: a request may attend to blocks another request of the same step is writing
(prefix sharing), and to its own new tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionBatch:
    """One step's requests, in the order their tokens appear in the flat batch."""

    query_lens: list[int]  # new tokens per request this step
    context_lens: list[int]  # tokens with K/V after this step (computed before + new)
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of every new token
    block_size: int


class AttentionBackend(ABC):
    # how K/V are stored: "auto" (the compute dtype), a float dtype or "int8" (kv_quant)
    kv_cache_dtype: str = "auto"

    @abstractmethod
    def kv_cache_shape(self, num_slots: int) -> tuple[int, ...]:
        """Shape of one layer's K/V cache tensor holding `num_slots` token slots."""

    @abstractmethod
    def kv_cache_tensor_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """Dtype of that tensor when the model computes in `compute_dtype`."""

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch) -> object:
        """Precompute per-step tensors (gather indices, masks) shared by every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: object, window: int = 0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache of `kv_cache_shape` and
        `kv_cache_tensor_dtype` -> out [T, H * D] in q's dtype.

        Writes k/v into the cache at the batch's slots, then attends every query to its
        request's context (causally within the request); with a sliding `window`, a query
        at position p to keys p - window + 1 .. p only. `sinks` [H] (float32; gpt-oss): a
        logit per query head that joins each row's softmax as one more key with no value,
        so the row's weights over its keys sum to less than one."""

    def graph_safe(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `forward` can run from `graph_metadata`'s tensors alone, with no host-side
        work per step, so that a CUDA graph can hold it (worker.cuda_graphs)."""
        del dtype, device
        return False

    def graph_metadata(self, slot_mapping: torch.Tensor, seqs: torch.Tensor,
                       tables: torch.Tensor, block_size: int) -> object:
        """Metadata over static buffers for a step of decodes, one query row per sequence:
        row i of every tensor is sequence i; seqs [B, 3] holds (i, 1, context length),
        tables [B, width] the block tables. A padding row has slot -1 (its K/V are written
        nowhere) and context length 0 (it attends to nothing; its output is garbage to drop).
        Only where `graph_safe`."""
        raise NotImplementedError

    def fused_inputs(self, meta: object, dtype: torch.dtype) -> tuple | None:
        """When the C++ `run_layers` can run this backend's layers whole (activations in
        `dtype`): the attention arguments it takes after the caches (slot mapping, sequences,
        block tables, block size, scale; see there); None when it cannot (the default).
        Decided by configuration, never by the step, so every step takes the same path."""
        del meta, dtype
        return None
