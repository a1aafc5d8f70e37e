"""SchedulerOutput -> tensors -> forward -> sample -> ModelRunnerOutput.

The runner owns the KV cache tensors: per layer of a KV group (kv_cache.layout; with one
group, per layer) one tensor holding K and V for num_blocks * block_size token slots (shape
and dtype chosen by the attention backend, which may store them quantized), addressed by
slot = block_id * block_size + offset through the table of the layer's group. How many
blocks fit a memory budget is `kv_cache.planner.plan_num_blocks`.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import math
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import torch

from kvserve import kernels, weight_arena
from kvserve.attention.backend import AttentionBatch
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.config import CacheConfig, ModelConfig
from kvserve.distributed.parallel import SINGLE, TensorParallel
from kvserve.kv_cache.layout import KVLayout
from kvserve.layers.quant import IN_PLACE, check_quantization
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import LoadedModel, auto_quantization
from kvserve.models.paths import resolve_model
from kvserve.models.weight_cache import load_packed
from kvserve.outputs import TokenLogprobs
from kvserve.request import Request
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.rejection_sampler import verify
from kvserve.sample.sampler import Sampler, token_logprobs
from kvserve.sample.structured import fill_bitmasks
from kvserve.sched.output import ScheduledRequest, SchedulerOutput
from kvserve.worker.cuda_graphs import Captured, DecodeGraphs, cuda_capture
from kvserve.worker.forward import ForwardItem

log = logging.getLogger(__name__)


def load_target(model: str | None, dtype: torch.dtype, device: torch.device,
                kv_cache_dtype: str, quantization: str, tp: TensorParallel = SINGLE,
                max_model_len: int | None = None) -> tuple[LoadedModel, str]:
    """The served model (this rank's shard of it) with its attention backend and its weights
    in the form their kernels read (LlamaForCausalLM.pack_); returns it and the quantization
    applied. `auto` keeps a quantized GGUF's own codes and precision class, layer by layer,
    where kvserve's int4/int8 kernel runs them on the compute dtype (bf16, or float32 on CPUs
    without native bf16: see resolve_quantization for a float32 asked for), and is none
    elsewhere: torch's int4/int8 kernels are slower than the float weights at prompt sizes
    (and in float32 at every size). `kv_cache_dtype` `auto` is resolved per model against
    the kernels (kernels.kv_cache_dtype_for); the attention backends hold the result.
    `max_model_len` chooses LongRoPE's factors (see RopeScaling.for_context)."""
    path = resolve_model(model)

    def pack(loaded: LoadedModel) -> str:
        applied = quantization
        if applied == "auto":
            fast = kernels.quant_kernels(dtype, device, 16, 32) is not None
            # Each layer its own GGUF class (LinearBase.pack_), where kvserve's kernel runs it.
            applied = "auto" if fast and auto_quantization(loaded.weight_format) != "none" \
                else "none"
        if applied == IN_PLACE and device.type != "cpu":
            raise ValueError(f"--quantization gguf reads the file on CPU kernels; use none on "
                             f"{device.type}")
        if applied not in ("auto", IN_PLACE) and check_quantization(applied) != "none" and \
                device.type != "cpu":
            raise ValueError(f"--quantization int8/int4 uses CPU kernels; use none on "
                             f"{device.type}")
        loaded.model.pack_(applied)
        return applied

    # Packed once per model, dtype, quantization and rank, then mapped from the weight cache.
    def backend(c: ModelConfig) -> TorchPagedAttention:
        kv = kernels.kv_cache_dtype_for(kv_cache_dtype, dtype, device, c.head_dim)
        return TorchPagedAttention.for_model(c, kv)

    try:
        return load_packed(path, dtype, device, backend, pack, quantization, tp, max_model_len)
    finally:
        weight_arena.settle()  # the CLI's reservation (prefault_weights): hand back the rest


def resolve_quantization(quantization: str, dtype: str | torch.dtype) -> str:
    """--quantization as the engine passes it on (to every rank): `auto` is none when float32
    was asked for by name (which asks for exactness: the checkpoint's weights dequantized, as
    transformers reads them), else left for load_target to resolve against the kernels."""
    if quantization == "auto" and (dtype is torch.float32 or
                                   isinstance(dtype, str) and dtype in ("float32", "fp32")):
        return "none"
    return quantization


def run_forward(model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                items: list[ForwardItem], device: torch.device,
                timings: dict[str, float] | None = None,
                layout: KVLayout | None = None) -> torch.Tensor:
    """One forward pass over a batch of items -> final hidden states [sum(num_outputs), H],
    item after item. Shared by the target and by draft models (with their own caches).
    `kv_caches` are allocate_kv_caches' for `layout` (None: one group, a cache per layer).
    `timings`, when given, receives the seconds spent in "prepare" and "forward", and where
    the C++ layer loop ran, its phases' as "layers.PHASE" (parts of forward)."""
    t0 = time.perf_counter()
    bs = block_size
    num_groups = layout.num_groups if layout is not None else 1
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    out_idx: list[int] = []
    query_lens, context_lens = [], []
    tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
    for it in items:
        n = len(it.token_ids)
        input_ids.extend(it.token_ids)
        pos = range(it.start, it.start + n)
        positions.extend(pos)
        for g, table in enumerate((it.block_ids, *it.group_tables[:num_groups - 1])):
            slots[g].extend(table[p // bs] * bs + p % bs for p in pos)
            tables[g].append(table)
        query_lens.append(n)
        context_lens.append(it.start + n)
        out_idx.extend(range(len(input_ids) - it.num_outputs, len(input_ids)))
    backend = model.layers[0].self_attn.backend
    metas = [backend.build_metadata(AttentionBatch(
        query_lens, context_lens, tables[g],
        torch.tensor(slots[g], dtype=torch.long, device=device), bs))
        for g in range(num_groups)]
    ids = torch.tensor(input_ids, dtype=torch.long, device=device)
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    if timings is not None:
        model.take_layer_phases()  # this forward's alone, not untimed ones' before it
    t1 = time.perf_counter()
    if layout is not None and layout.hybrid:
        hidden = model(ids, pos, [kv_caches[s] for s in layout.layer_slot],
                       [metas[g] for g in layout.layer_group])
    else:
        hidden = model(ids, pos, kv_caches, metas[0])
    if len(out_idx) != len(input_ids):
        hidden = hidden[torch.tensor(out_idx, dtype=torch.long, device=device)]
    if timings is not None:
        timings["prepare"] = timings.get("prepare", 0.0) + t1 - t0
        timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t1
        for name, seconds in model.take_layer_phases().items():
            key = f"layers.{name}"
            timings[key] = timings.get(key, 0.0) + seconds
    return hidden


@dataclass
class ModelRunnerOutput:
    # One entry per scheduled request that samples, in scheduling order: the tokens it gets
    # this step (one, or with drafts the accepted ones and one more) and their logprobs.
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]
    # Per entry, the final hidden state of the row its last token was sampled from; kept
    # only when a drafter drafts from it (MTP).
    hidden: list[torch.Tensor] | None = None
    # Prompt logprobs computed this step: (request id, the TokenLogprobs of its next prompt
    # tokens, in order).
    prompt_logprobs: list[tuple[str, list[TokenLogprobs]]] = field(default_factory=list)
    # Embedding requests: (request id, this step's final hidden states [k, H] in float32 of
    # the positions to pool (mean), or the last position's (last), k).
    pooled: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    # Seconds spent in "prepare" (inputs, metadata), "forward", "grammar" (structured outputs'
    # masks) and "sample"; under tensor parallelism also "all_reduce", the part of forward and
    # sample spent in collectives; where the C++ layer loop ran, "layers.PHASE" for each of
    # its phases (run_forward), parts of forward.
    timings: dict[str, float] = field(default_factory=dict)


class StepPeers(Protocol):
    """The other ranks of a tensor-parallel group, as rank 0's runner drives them
    (`worker.tp_workers.TensorParallelWorkers`)."""

    def send(self, obj: object) -> None:
        """Hand a step's ForwardItems to every other rank (before rank 0 runs its shard)."""

    def fail(self, e: BaseException) -> NoReturn:
        """Record that a step failed midway and raise it as the group's error."""

    def settle(self, device: torch.device) -> None:
        """Wait, within the group's timeout, for the step's work queued on `device` (its
        collectives may wait on a dead peer); raise the group's error if it does not end."""


class ModelRunner:
    """Runs steps on the model; with `workers`, the model is rank 0's shard and every step is
    first sent to the other ranks, which run the same forward (see worker.tp_workers)."""

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig, num_blocks: int,
                 dtype: torch.dtype, device: torch.device,
                 workers: StepPeers | None = None,
                 layout: KVLayout | None = None) -> None:
        self.model = model
        self.layout = layout or KVLayout.single(model.config.num_layers)
        self.workers = workers
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
        release_freed_memory()
        self.kv_caches = allocate_kv_caches(model, num_blocks * cache.block_size, dtype, device,
                                            self.layout)
        self.sampler = Sampler()
        self.keep_hidden = False  # set by a drafter that drafts from the target's states
        self.graphs: DecodeGraphs | None = None  # capture_decode_graphs
        if device.type == "cpu":
            kernels.ops()  # build or load the C++ kernels now rather than in the first request

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def can_capture_graphs(self) -> bool:
        """Whether decode steps can run as CUDA graphs: one rank (a graph would hold the
        collectives too; not done) on an attention backend that runs from static buffers,
        and no experts (their rows per expert are data-dependent shapes a graph cannot
        replay)."""
        return (self.workers is None and self.backend.graph_safe(self.dtype, self.device)
                and not self.model.config.num_experts)

    def capture_decode_graphs(self, max_seqs: int, max_model_len: int,
                              capture: Callable[[Callable[[], torch.Tensor], object], Captured]
                              = cuda_capture) -> None:
        """Capture the forward of decode steps of up to `max_seqs` requests (see
        worker.cuda_graphs); steps that fit replay them from then on."""
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.layout, self.block_size,
                                   max_seqs, max_model_len, self.dtype, self.device, capture)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.workers is None:
            return self._execute(sched)
        tp = self.model.tp
        tp.take_comm_seconds()  # whatever came before this step (start-up's collectives)
        try:
            out = self._execute(sched)
        except Exception as e:  # the ranks may now be out of step: the group is done
            self.workers.fail(e)
        out.timings["all_reduce"] = tp.take_comm_seconds()
        return out

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        batch = _Batch.of(sched)
        timings: dict[str, float] = {}
        if self.workers is not None:
            self.workers.send(batch.items)
        if self.graphs is not None and self.graphs.fits(batch.items):
            hidden = self.graphs.run(batch.items, timings)
        else:
            hidden = run_forward(self.model, self.kv_caches, self.block_size, batch.items,
                                 self.device, timings, self.layout)
        pooled = [(req.request_id, hidden[o:o + k].float() if how == "mean"
                   else hidden[o + k - 1:o + k].float(), k) for req, o, k, how in batch.pooled]
        rows = batch.sampled
        if not rows and not batch.prompt and (self.workers is None or not hidden.shape[0]):
            if self.workers is not None:
                self.workers.settle(self.device)
            return ModelRunnerOutput([], [], pooled=pooled, timings=timings)
        t0 = time.perf_counter()
        # Under tensor parallelism every rank computes logits for every output row.
        logits = self.model.compute_logits(hidden)
        if self.workers is not None:  # before any host read of the results: bounded
            self.workers.settle(self.device)
        prompt_lps = []
        if batch.prompt or batch.pooled:
            prompt_lps, logits, hidden = batch.take_prompt_rows(logits, hidden)
            if not rows:
                timings["sample"] = time.perf_counter() - t0
                return ModelRunnerOutput([], [], prompt_logprobs=prompt_lps, pooled=pooled,
                                         timings=timings)
        token_ids, logprobs, kept = self._sample(rows, logits, hidden, timings)
        timings["sample"] = time.perf_counter() - t0 - timings.get("grammar", 0.0)
        return ModelRunnerOutput(token_ids, logprobs, kept, prompt_lps, pooled, timings)

    def _sample(self, rows: list[ScheduledRequest], logits: torch.Tensor,
                hidden: torch.Tensor, timings: dict[str, float]
                ) -> tuple[list[list[int]], list, list[torch.Tensor] | None]:
        """The sampled rows' tokens (or verified drafts and one more), their logprobs and,
        for a drafter that reads them, the hidden state each request's last token came
        from. Grammar masks first, timed apart."""
        allowed, constrained, offset = None, [], 0
        for s in rows:
            if s.request.grammar is not None:
                constrained.append((offset, s.request.grammar, s.request.draft_token_ids))
            offset += s.num_drafts + 1
        if constrained:
            tg = time.perf_counter()
            allowed = fill_bitmasks(constrained, logits.shape[-1])
            timings["grammar"] = time.perf_counter() - tg
        if not any(s.num_drafts for s in rows):
            reqs = [s.request for s in rows]
            out = self.sampler(logits, SamplingMetadata.build(reqs, logits.shape[-1],
                                                              self.device, allowed))
            return ([[t] for t in out.token_ids], [[lp] for lp in out.logprobs],
                    list(hidden) if self.keep_hidden else None)
        verified = verify(self.sampler, logits, [s.request for s in rows], self.device,
                          allowed)
        kept = None
        if self.keep_hidden:
            kept, offset = [], 0
            for s, toks in zip(rows, verified.token_ids, strict=True):
                kept.append(hidden[offset + len(toks) - 1])
                offset += s.num_drafts + 1
        return verified.token_ids, verified.logprobs, kept


@dataclass
class _Batch:
    """A step's forward items and what each output row is for: sampled rows (`sampled`, in
    output order), prompt logprob rows (`prompt`: request, first row, first and end
    position) and pooled rows (`pooled`: request, first row, rows, how)."""

    items: list[ForwardItem] = field(default_factory=list)
    sampled: list[ScheduledRequest] = field(default_factory=list)
    prompt: list[tuple[Request, int, int, int]] = field(default_factory=list)
    pooled: list[tuple[Request, int, int, str]] = field(default_factory=list)

    @classmethod
    def of(cls, sched: SchedulerOutput) -> _Batch:
        batch, offset = cls(), 0
        for s in sched.scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            tokens = [req.token_at(i) for i in range(start, start + n)]
            num_outputs = s.num_drafts + 1 if s.samples else 0
            pooling = req.sampling_params.pooling
            if pooling is not None:  # an embedding: pooled hidden states, no sampling
                first = max(start, req.num_pooled) if pooling == "mean" else start + n - 1
                num_outputs = start + n - first if pooling == "mean" or s.samples else 0
                if num_outputs:
                    batch.pooled.append((req, offset, num_outputs, pooling))
            else:
                # Requests wanting prompt logprobs get a row per position of the chunk whose
                # next token is a prompt token.
                first = max(start, len(req.prompt_logprobs))  # survives preemption
                end = min(start + n, req.num_prompt_tokens - 1)
                if req.sampling_params.prompt_logprobs is not None and first < end:
                    num_outputs = start + n - first  # the prompt rows, then any sampled row
                    batch.prompt.append((req, offset, first, end))
                if s.samples:
                    batch.sampled.append(s)
            batch.items.append(ForwardItem(tokens, start, req.block_ids, num_outputs,
                                           req.group_tables))
            offset += num_outputs
        return batch

    def take_prompt_rows(self, logits: torch.Tensor, hidden: torch.Tensor
                         ) -> tuple[list, torch.Tensor, torch.Tensor]:
        """The prompt logprobs per request, and the logits and hidden states of the rows
        left to sample (those neither prompt nor pooled rows), in order."""
        keep = torch.ones(logits.shape[0], dtype=torch.bool)
        for _, o, k, _ in self.pooled:
            keep[o:o + k] = False
        prompt_lps = []
        for req, o, first, end in self.prompt:
            targets = req.prompt_token_ids[first + 1:end + 1]
            prompt_lps.append((req.request_id, token_logprobs(
                logits[o:o + len(targets)], targets, req.sampling_params.prompt_logprobs)))
            keep[o:o + len(targets)] = False
        return prompt_lps, logits[keep], hidden[keep]


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc's malloc_trim), so memory
    freed after loading does not stay resident under the KV cache about to be allocated.

    Only the young generations are collected: a full collection walks every object torch's
    import leaves (~185k, a noticeable part of each start) and, after a load from the GGUF,
    found a handful of small objects and no tensor (what loading frees goes by reference
    counts), while the trim handed back hundreds of MB. The collector's own passes still
    reclaim the rest."""
    gc.collect(1)
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def allocate_kv_caches(model: LlamaForCausalLM, num_slots: int, dtype: torch.dtype,
                       device: torch.device, layout: KVLayout | None = None
                       ) -> list[torch.Tensor]:
    """One K/V tensor per layer of a KV group (`layout`; None: one group, so one per
    layer), in the form the model's attention backend stores."""
    backend = model.layers[0].self_attn.backend
    shape = backend.kv_cache_shape(num_slots)
    kv_dtype = backend.kv_cache_tensor_dtype(dtype)
    n = layout.group_size if layout is not None else model.config.num_layers
    return [zeros(shape, kv_dtype, device) for _ in range(n)]


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU in fresh anonymous memory, which the kernel hands out as
    zero pages on first touch: a GiB of KV cache then costs nothing at start-up (torch.zeros
    writes every byte, a visible part of a start for the default 1 GiB), its pages are paid
    for as blocks are first written, and every slot still reads 0 until then, whatever the
    memory held before (no dependence on uninitialised memory). Resident memory grows with
    use instead."""
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a forked child gets copy-on-write pages, never a view of this process's cache
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
