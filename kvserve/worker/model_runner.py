"""SchedulerOutput -> tensors -> forward -> sample -> ModelRunnerOutput.

The runner owns the KV cache tensors: per layer one tensor holding K and V for
num_blocks * block_size token slots (shape and dtype chosen by the attention backend, which
may store them quantized), addressed by slot = block_id * block_size + offset. How many
blocks fit a memory budget is `kv_cache.planner.plan_num_blocks`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.attention import cpu_ops
from kvserve.attention.backend import AttentionBatch
from kvserve.config import CacheConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sampler import Sampler, SamplingMetadata, TokenLogprobs
from kvserve.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    # One entry per scheduled request that samples, in scheduling order.
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


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
        if self.backend.kv_cache_dtype != cache.kv_cache_dtype:
            # the block count was planned for one layout; allocating another would break it
            raise ValueError(f"the model's attention backend stores a "
                             f"{self.backend.kv_cache_dtype} KV cache but the cache config "
                             f"asks for {cache.kv_cache_dtype}")
        shape = self.backend.kv_cache_shape(num_blocks * cache.block_size)
        kv_dtype = self.backend.kv_cache_tensor_dtype(dtype)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=device)
                          for _ in range(self.cfg.num_layers)]
        self.sampler = Sampler()
        if device.type == "cpu":
            cpu_ops.ops()  # build or load the C++ kernels now rather than in the first request

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
