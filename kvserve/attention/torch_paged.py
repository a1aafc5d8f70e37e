"""Paged attention over the layer's K/V cache: kvserve's C++ kernel where it runs, stock torch
ops elsewhere.

The cache of one layer is laid out head-major, [2, Hkv, num_slots, W] (W = head_dim D, or
D + 2 for int8), addressed by slot = block id * block size + offset.

On a CPU with AVX-512 or AVX2 (float32; on AVX2 also K/V stored in float16 or bf16) or
AVX512-BF16 (bf16), every row of a step goes
through one C++ call, `paged_attention`, which computes a row the same way whether it is a
decode token, a draft being verified or part of a prompt chunk, and whatever else is in the
step (see kernels/csrc/attention.cpp): a request's output does not depend on its batch or on
how its prompt was chunked. On a GPU with Triton, the Triton kernels of the same name do the
same (kernels/triton_paged.py), reading K/V through the block table in place.

Elsewhere (no compiler, another CPU, a GPU without Triton, an int8 KV cache on a GPU)
torch's ops run, and their results do depend on the batch (the engine logs it): decode rows
(one query per request, or a few after context: speculative drafts) are attended in one
batched call over a padded gather of their contexts (one `index_select` per K and V, already
in the [Hkv, B, L, W] order the batched matmuls want); prompt chunks go one request at a time
through SDPA.

With `kv_cache_dtype="int8"` rows are quantized on write (layout in `kv_quant`) and
dequantized on read, by the kernel as by the torch path; with a 16-bit cache under float32
activations they are rounded on write and widened on read. A prompt chunk with no earlier
context attends its own fresh K/V on the torch path, but passed through the same round trip,
so every query sees the K/V the cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.attention.backend import AttentionBackend, AttentionBatch
from kvserve.attention.kv_quant import (
    dequantize_int8,
    kv_row_width,
    kv_storage_dtype,
    quantize_int8,
    split_int8,
)
from kvserve.config import ModelConfig

# Decode batches with at most this many context tokens in all (batch x padded length) do their
# attention math in float32.
SMALL_DECODE_TOKENS = 1024
# A request with up to this many new tokens after some context (a decode verifying speculative
# drafts) is attended as that many decode rows, row j seeing the context up to its own token:
# exact causal attention in the batched decode call instead of a per-request SDPA call.
MAX_ROWS_AS_DECODES = 8


@dataclass
class PrefillSpan:
    start: int  # first token of the request in the flat batch
    end: int
    blocks: torch.Tensor  # the request's blocks up to ctx_len
    ctx_len: int  # tokens of context, the chunk's own included
    window: int = 0  # sliding window: a query at p sees keys p - window + 1 .. p; 0: all
    _mask: torch.Tensor | None = None

    @property
    def has_context(self) -> bool:
        """Whether earlier tokens precede the chunk (in the cache)."""
        return self.ctx_len != self.end - self.start

    @property
    def mask(self) -> torch.Tensor:
        """[q, ctx] True where a query may attend (made once, used by every layer)."""
        if self._mask is None:
            device = self.blocks.device
            qpos = torch.arange(self.ctx_len - (self.end - self.start), self.ctx_len,
                                device=device)[:, None]
            keys = torch.arange(self.ctx_len, device=device)[None, :]
            self._mask = keys <= qpos
            if self.window:
                self._mask &= keys > qpos - self.window
        return self._mask


@dataclass
class TorchPathMetadata:
    """What the torch path needs: decode rows batched, prompt chunks one by one."""

    decode_idx: torch.Tensor | None  # [Bd] positions of decode tokens in the flat batch
    decode_only: bool  # every token is a decode token, in batch order: no gather/scatter
    decode_blocks: torch.Tensor | None  # [Bd * nb] block tables, padded with block 0
    decode_bias: torch.Tensor | None  # [1, Bd, 1, nb * bs] 0 where valid, -inf elsewhere
    prefills: list[PrefillSpan]
    decode_lens: torch.Tensor | None = None  # [Bd] int64 context lengths


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_tokens: int
    block_size: int
    seqs: torch.Tensor  # [S, 3] int64: first row, rows, context length (paged_attention)
    tables: torch.Tensor  # [S, nb] int64 block tables, padded with block 0
    batch: AttentionBatch | None  # None: over a graph's static buffers (kernels only)
    _torch_paths: dict[int, TorchPathMetadata] = field(default_factory=dict)

    def torch_path(self, window: int) -> TorchPathMetadata:
        """Built on first use (only where the kernel does not run), one per sliding window,
        shared by every layer with that window."""
        if window not in self._torch_paths:
            assert self.batch is not None, "graph metadata runs only on the kernels"
            self._torch_paths[window] = _torch_path_metadata(self.batch, window)
        return self._torch_paths[window]


def _torch_path_metadata(batch: AttentionBatch, window: int) -> TorchPathMetadata:
    device = batch.slot_mapping.device
    bs = batch.block_size
    decode_rows, prefills = [], []  # decode rows: (flat position, request, context length)
    start = 0
    for i, (q, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        if q == 1 or (q <= MAX_ROWS_AS_DECODES and ctx > q):
            decode_rows.extend((start + j, i, ctx - q + j + 1) for j in range(q))
        else:
            prefills.append(PrefillSpan(start, start + q, torch.tensor(
                batch.block_tables[i][:-(-ctx // bs)], device=device), ctx, window))
        start += q
    meta = TorchPathMetadata(None, not prefills, None, None, prefills)
    if decode_rows:
        lens = [n for _, _, n in decode_rows]
        width = -(-max(lens) // bs)
        meta.decode_blocks = torch.tensor(
            [b for _, i, n in decode_rows
             for b in batch.block_tables[i][:-(-n // bs)] + [0] * (width - -(-n // bs))],
            device=device)
        keys = torch.arange(width * bs, device=device)[None, :]
        ends = torch.tensor(lens, device=device)[:, None]
        valid = (keys < ends) & (keys >= ends - window) if window else keys < ends
        meta.decode_lens = torch.tensor(lens, device=device)
        meta.decode_idx = torch.tensor([s for s, _, _ in decode_rows], device=device)
        meta.decode_bias = torch.zeros(valid.shape, device=device).masked_fill_(
            ~valid, float("-inf"))[None, :, None, :]
    return meta


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[2, Hkv, n * block_size, W]: the K/V of whole blocks, in order. Copying blocks rather
    than token slots moves the same bytes in 16x fewer pieces, several times faster."""
    two, hkv, _, width = kv_cache.shape
    by_block = kv_cache.view(two, hkv, -1, block_size, width)
    return by_block.index_select(2, blocks).view(two, hkv, -1, width)


class TorchPagedAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 kv_cache_dtype: str = "auto", scale: float = 0.0) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale or head_dim**-0.5
        self.kv_cache_dtype = kv_cache_dtype
        self.row_width = kv_row_width(head_dim, kv_cache_dtype)  # validates the name
        self.quantized = kv_cache_dtype == "int8"

    @classmethod
    def for_model(cls, cfg: ModelConfig, kv_cache_dtype: str = "auto") -> TorchPagedAttention:
        """The backend for a model's (or a rank's shard's) attention."""
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype,
                   cfg.attention_scale)

    def kv_cache_shape(self, num_slots: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_slots, self.row_width)

    def kv_cache_tensor_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return kv_storage_dtype(self.kv_cache_dtype, compute_dtype)

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        """K or V rows [..., D] (compute dtype) as the cache stores them: quantized, rounded
        to a 16-bit cache's dtype (nearest even), or as they are."""
        if self.quantized:
            return quantize_int8(x)
        return x.to(self.kv_cache_tensor_dtype(x.dtype))

    def _load(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows [..., W] -> [..., D] values in the compute dtype (exact but for int8)."""
        return dequantize_int8(rows, dtype) if self.quantized else rows.to(dtype)

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        device = batch.slot_mapping.device
        bs = batch.block_size
        seqs, start = [], 0
        for q, ctx in zip(batch.query_lens, batch.context_lens, strict=True):
            seqs.append((start, q, ctx))
            start += q
        width = max(-(-ctx // bs) for ctx in batch.context_lens)
        tables = [t[:width] + [0] * (width - len(t[:width])) for t in batch.block_tables]
        return TorchAttentionMetadata(
            batch.slot_mapping, start, bs, torch.tensor(seqs, dtype=torch.long, device=device),
            torch.tensor(tables, dtype=torch.long, device=device), batch)

    def ops_for(self, dtype: torch.dtype, device: torch.device):
        """The kernels serving this layer's store_kv and paged_attention: the C++ module on a
        CPU, Triton's on a GPU (see kvserve.kernels); None for torch's ops."""
        return kernels.attention_kernels(dtype, device, self.head_dim,
                                         self.kv_cache_tensor_dtype(dtype))

    def graph_safe(self, dtype: torch.dtype, device: torch.device) -> bool:
        return kernels.graph_safe(self.ops_for(dtype, device))

    def graph_metadata(self, slot_mapping: torch.Tensor, seqs: torch.Tensor,
                       tables: torch.Tensor, block_size: int) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(slot_mapping, slot_mapping.shape[0], block_size, seqs,
                                      tables, None)

    def fused_inputs(self, meta: TorchAttentionMetadata, dtype: torch.dtype) -> tuple | None:
        # The C++ path stores K/V unquantized (store_kv, rounding to a 16-bit cache) and reads
        # them with paged_attention, as forward() does.
        device = meta.slot_mapping.device
        ops = self.ops_for(dtype, device)
        if self.quantized or device.type != "cpu" or ops is None or ops is not kernels.ops():
            return None  # (under KVSERVE_NO_CPP both are None: no run_layers to call)
        return meta.slot_mapping, meta.seqs, meta.tables, meta.block_size, self.scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: TorchAttentionMetadata,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        ops = self.ops_for(q.dtype, kv_cache.device)
        if sinks is not None and ops is not None and ops is not kernels.ops():
            ops = None  # the Triton kernels take no sinks: torch's ops do
        rows = None
        if ops is not None and not self.quantized:
            ops.store_kv(kv_cache, meta.slot_mapping, k, v)  # what index_copy_ of _store writes
        else:
            # K and V written with one copy: [2, T, Hkv, W] -> slots of [2, Hkv, num_slots, W].
            rows = self._store(torch.stack((k, v)))
            kv_cache.index_copy_(2, meta.slot_mapping, rows.transpose(1, 2))
        if ops is not None:  # sinks only to the C++ kernel (Triton's signature has none)
            extra = () if sinks is None else (sinks,)
            return ops.paged_attention(q, kv_cache, meta.seqs, meta.tables, meta.block_size,
                                       self.scale, window, *extra).flatten(1)
        path = meta.torch_path(window)
        if path.decode_only:
            return self._decode(q, kv_cache, path, meta.block_size, sinks).flatten(1)
        out = torch.empty_like(q)
        if path.decode_idx is not None:
            out[path.decode_idx] = self._decode(q[path.decode_idx], kv_cache, path,
                                                meta.block_size, sinks)
        for span in path.prefills:
            qp = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if not span.has_context:
                fresh = rows if rows is not None else torch.stack((k, v))
                kv = self._load(fresh[:, span.start:span.end], q.dtype).transpose(1, 2)
            else:
                kv = _gather(kv_cache, span.blocks, meta.block_size)[:, :, :span.ctx_len]
                kv = self._load(kv, q.dtype)
            if sinks is not None:
                op = self._with_sinks(qp, kv[0:1], kv[1:2], span.mask, sinks)
            elif not span.has_context and not span.window:
                op = F.scaled_dot_product_attention(qp, kv[0:1], kv[1:2], enable_gqa=True,
                                                    is_causal=True)
            else:
                op = F.scaled_dot_product_attention(qp, kv[0:1], kv[1:2], attn_mask=span.mask,
                                                    enable_gqa=True)
            out[span.start:span.end] = op.squeeze(0).transpose(0, 1)
        return out.flatten(1)

    def _with_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """Attention of q [1, H, q, D] over k/v [1, Hkv, ctx, D] (`mask` [q, ctx]: True where a
        query may attend) with a sink logit per head in each softmax (SDPA takes none), in
        float32."""
        group = self.num_heads // self.num_kv_heads
        kf = k.float().repeat_interleave(group, dim=1)
        vf = v.float().repeat_interleave(group, dim=1)
        scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(_softmax_with_sinks(scores, sinks.view(1, -1, 1, 1)), vf).to(q.dtype)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, path: TorchPathMetadata,
                block_size: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D]; query heads of one KV head are batched together."""
        bias = path.decode_bias
        assert bias is not None and path.decode_blocks is not None
        bd, length = bias.shape[1], bias.shape[3]
        hkv, d = self.num_kv_heads, self.head_dim
        kv = _gather(kv_cache, path.decode_blocks, block_size)  # K and V in one gather
        # Small batches do the math in float32: bf16 batched matmuls of these sizes carry a
        # fixed cost several times float32's, and the conversion is cheap.
        math = torch.float32 if bd * length <= SMALL_DECODE_TOKENS else q.dtype
        if self.quantized:
            # Scale the small score and probability tensors rather than every gathered value
            # (3x faster batched decode): q.(s k) = s (q.k), sum p (s v) = sum (p s) v.
            (k, k_scale), (v, v_scale) = split_int8(kv[0], math), split_int8(kv[1], math)
        else:
            kv = kv.to(math)
            k, v = kv[0], kv[1]
        k, v = k.view(hkv, bd, length, d), v.view(hkv, bd, length, d)
        qg = q.view(bd, hkv, -1, d).transpose(0, 1).to(math)  # [Hkv, Bd, group, D]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * self.scale
        if self.quantized:
            scores *= k_scale.view(hkv, bd, 1, length)
        scores = scores + bias
        probs = (scores.softmax(dim=-1) if sinks is None else _softmax_with_sinks(
            scores, sinks.view(hkv, 1, -1, 1)))
        if self.quantized:
            probs *= v_scale.view(hkv, bd, 1, length)
        out = torch.matmul(probs.to(math), v).transpose(0, 1).reshape(bd, -1, d)
        return out.to(q.dtype)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax of float32 `scores` [..., keys] over the keys and one more logit per row,
    `sinks` (broadcast to [..., 1]), whose share is dropped: each row's weights sum to one
    less the sink's."""
    with_sink = torch.cat((scores, sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    return with_sink.softmax(dim=-1)[..., :-1]
