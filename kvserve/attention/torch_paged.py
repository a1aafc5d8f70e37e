"""Paged attention with stock torch ops; runs anywhere torch does.

Decode tokens (one query per request) are attended in one batched call over a padded gather
of their contexts; prompt chunks go one request at a time, since padding a 500-token chunk
to the batch would waste more than the loop costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, AttentionBatch


@dataclass
class PrefillSpan:
    start: int  # first token of the request in the flat batch
    end: int
    ctx_slots: torch.Tensor | None  # [ctx] cache slots, None when the chunk is the whole context
    mask: torch.Tensor | None  # [q, ctx] True = may attend


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_tokens: int
    decode_idx: torch.Tensor | None  # [Bd] positions of decode tokens in the flat batch
    decode_slots: torch.Tensor | None  # [Bd, L]
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, L]
    prefills: list[PrefillSpan]


def _slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of token positions 0..length-1 for a [..., max_blocks] block table."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[..., pos // block_size] * block_size + pos % block_size


class TorchPagedAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        device = batch.slot_mapping.device
        bs = batch.block_size
        decode_rows, prefills = [], []
        start = 0
        for i, (q, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
            if q == 1:
                decode_rows.append((start, i))
            else:
                span = PrefillSpan(start, start + q, None, None)
                if ctx != q:
                    table = torch.tensor(batch.block_tables[i], device=device)
                    span.ctx_slots = _slots(table, ctx, bs)
                    qpos = torch.arange(ctx - q, ctx, device=device)
                    span.mask = torch.arange(ctx, device=device)[None, :] <= qpos[:, None]
                prefills.append(span)
            start += q
        meta = TorchAttentionMetadata(batch.slot_mapping, start, None, None, None, prefills)
        if decode_rows:
            idx = [r[0] for r in decode_rows]
            ctx = torch.tensor([batch.context_lens[r[1]] for r in decode_rows], device=device)
            width = max(len(batch.block_tables[r[1]]) for r in decode_rows)
            tables = torch.zeros(len(idx), width, dtype=torch.long, device=device)
            for j, (_, i) in enumerate(decode_rows):
                t = batch.block_tables[i]
                tables[j, :len(t)] = torch.tensor(t)
            longest = int(ctx.max())
            meta.decode_idx = torch.tensor(idx, device=device)
            meta.decode_slots = _slots(tables, longest, bs)
            meta.decode_mask = (torch.arange(longest, device=device)[None, :]
                                < ctx[:, None])[:, None, None, :]
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        kv_cache[0].index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.decode_idx is not None:
            qd = q[meta.decode_idx].unsqueeze(2)  # [Bd, H, 1, D]
            kd = kv_cache[0][meta.decode_slots].transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = kv_cache[1][meta.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                                enable_gqa=True)
            out[meta.decode_idx] = od.squeeze(2)
        for span in meta.prefills:
            qp = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if span.ctx_slots is None:
                kp = k[span.start:span.end].transpose(0, 1).unsqueeze(0)
                vp = v[span.start:span.end].transpose(0, 1).unsqueeze(0)
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                kp = kv_cache[0][span.ctx_slots].transpose(0, 1).unsqueeze(0)
                vp = kv_cache[1][span.ctx_slots].transpose(0, 1).unsqueeze(0)
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask,
                                                    enable_gqa=True)
            out[span.start:span.end] = op.squeeze(0).transpose(0, 1)
        return out.flatten(1)
