"""SchedulerOutput -> tensors -> forward -> sample -> ModelRunnerOutput.

The runner owns the KV cache tensors: per layer one tensor holding K and V for
num_blocks * block_size token slots (layout chosen by the attention backend), addressed by
slot = block_id * block_size + offset.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBatch
from kvserve.config import CacheConfig, ModelConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sampler import Sampler, SamplingMetadata, TokenLogprobs
from kvserve.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    # One entry per scheduled request that samples, in scheduling order.
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return cfg.kv_elements_per_token * torch.empty((), dtype=dtype).element_size()


def plan_num_blocks(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Blocks that fit in the KV memory budget (or the explicit override)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = cache.block_size * kv_bytes_per_token(cfg, dtype)
    num = cache.kv_cache_memory // per_block
    if num < 1:
        raise ValueError(f"--kv-cache-memory {cache.kv_cache_memory} bytes holds no block "
                         f"({per_block} bytes per block of {cache.block_size} tokens)")
    return num


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig, num_blocks: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.cfg = model.config
        self.block_size = cache.block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.backend = model.layers[0].self_attn.backend
        shape = self.backend.kv_cache_shape(num_blocks * cache.block_size)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(self.cfg.num_layers)]
        self.sampler = Sampler()

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        rows = []
        query_lens, context_lens, tables = [], [], []
        for s in sched.scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            input_ids.extend(req.all_token_ids[start:start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            if s.samples:
                logits_idx.append(len(input_ids) - 1)
                rows.append(req)
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        meta = self.backend.build_metadata(
            AttentionBatch(query_lens, context_lens, tables, slot_mapping, bs))
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev),
                            self.kv_caches, meta)
        if not rows:
            return ModelRunnerOutput([], [])
        logits = self.model.compute_logits(
            hidden[torch.tensor(logits_idx, dtype=torch.long, device=dev)])
        out = self.sampler(logits, SamplingMetadata.build(rows, logits.shape[-1], dev))
        return ModelRunnerOutput(out.token_ids, out.logprobs)
