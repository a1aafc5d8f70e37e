"""Speculative decoding: the drafters (ngram, draft_model, mtp) and the coordinator that
decides who drafts (verification is kvserve.sample.rejection_sampler)."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.config import SchedulerConfig, SpecConfig
from kvserve.layers.quant import check_quantization
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.paths import resolve_model
from kvserve.spec_decode.base import Drafter
from kvserve.spec_decode.draft_model import DraftModelDrafter, draft_head
from kvserve.spec_decode.mtp import MTPDrafter
from kvserve.spec_decode.ngram import NgramDrafter


def draft_quantization(quantization: str, device: torch.device) -> str:
    """The draft model's weight form: `auto` is int4 on the CPU (a draft step is one row
    through the weights: bytes are its time) and none elsewhere, where int4/int8 (kvserve's
    and torch's kernels are the CPU's) are refused by name."""
    if quantization == "auto":
        return "int4" if device.type == "cpu" else "none"
    if check_quantization(quantization) != "none" and device.type != "cpu":
        raise ValueError(f"the draft model's quantization {quantization} runs on CPU kernels "
                         f"only; use \"auto\" or \"none\" on {device}")
    return quantization


def build_drafter(spec: SpecConfig, target: LlamaForCausalLM, target_path, dtype: torch.dtype,
                  device: torch.device, sched: SchedulerConfig) -> Drafter:
    """The drafter `spec` names, loaded and checked against the target."""
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        path = resolve_model(spec.model) if spec.model else target_path
        loaded = load_model(path, dtype, device, TorchPagedAttention.for_model,
                            max_model_len=sched.max_model_len)
        if loaded.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft model {path.name} has a vocabulary of "
                             f"{loaded.config.vocab_size} tokens, the target "
                             f"{target.config.vocab_size}: they must share a tokenizer")
        quantization = draft_quantization(spec.quantization, device)
        loaded.model.pack_(quantization)
        head = draft_head(loaded.model, spec.draft_vocab_size, quantization) \
            if 0 < spec.draft_vocab_size < loaded.config.vocab_size else None
        lm_head = loaded.model.lm_head
        if lm_head.packed is not None and not loaded.config.tie_word_embeddings:
            # pack_ keeps a head's float weight for an MTP drafter reading the target's; a
            # draft model's own is read packed only (272 MB for Qwen2.5-Coder-0.5B's).
            lm_head.weight = nn.Parameter(lm_head.weight.data.new_empty(0), requires_grad=False)
        return DraftModelDrafter(loaded.model, dtype, device, sched.max_num_batched_tokens,
                                 head)
    assert spec.model is not None
    return MTPDrafter.load(spec.model, target, device)
