"""CUDA graphs for decode steps: the model's forward captured once per padded batch size and
replayed, so a decode step costs one graph launch instead of a kernel launch (and ~10-50 us
of Python) per operation: at batch 1 on a GPU the launches, not the weights' bytes, would
otherwise set the step time.

A graph replays the exact kernels and addresses it was captured with, so everything a step
varies lives in static buffers written before each replay: token ids, positions, cache slots,
the sequences' context lengths and block tables (per KV group). A step of n decodes runs the
graph of the smallest captured size G >= n; its G - n padding rows get slot -1 (the attention
backend's store skips them: they write no cache slot) and context length 0 (they attend to
nothing), and their outputs are dropped. Every row of the buffers up to G is rewritten each
step, so no padding row can keep the slot of a request from an earlier, larger step.

Only steps where every request decodes one token take a graph; prompt chunks and verified
drafts (varying rows per request) run eagerly. The attention backend must be able to run
from device tensors alone (AttentionBackend.graph_metadata; the Triton kernels can, torch's
padded gather cannot).

`eager_capture` stands in for the CUDA capture where there is no GPU: the same buffers,
padding and replays, the forward run anew on each replay (the tests' way to check the
plumbing on a CPU).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.kv_cache.layout import KVLayout
from kvserve.worker.forward import ForwardItem

if TYPE_CHECKING:
    from kvserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# Padded batch sizes captured (those up to --max-num-seqs, and it): more sizes cost capture
# time and a little memory; fewer cost padding rows.
CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class Captured:
    replay: Callable[[], object]
    hidden: torch.Tensor  # [G, hidden]: the forward's output, rewritten by every replay


def cuda_capture(forward: Callable[[], torch.Tensor], pool: object) -> Captured:
    """`forward` run once on a side stream (Triton compiles, cuBLAS sets up), then captured
    into a CUDA graph sharing the memory `pool` with the other sizes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        hidden = forward()
    return Captured(graph.replay, hidden)


def eager_capture(forward: Callable[[], torch.Tensor], pool: object) -> Captured:
    """No graph: each replay runs `forward` again into the same output tensor."""
    del pool
    hidden = forward()
    return Captured(lambda: hidden.copy_(forward()), hidden)


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                 layout: KVLayout, block_size: int, max_seqs: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device,
                 capture: Callable[[Callable[[], torch.Tensor], object], Captured]
                 = cuda_capture) -> None:
        backend = model.layers[0].self_attn.backend
        if not backend.graph_safe(dtype, device):
            raise ValueError("the attention backend cannot run from static buffers here")
        top = min(max_seqs, CAPTURE_SIZES[-1])
        self.sizes = [s for s in CAPTURE_SIZES if s < top] + [top]
        self.block_size, self.layout = block_size, layout
        n, width = self.sizes[-1], -(-max_model_len // block_size)
        groups = layout.num_groups

        def buf(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.long, device=device)

        self.ids, self.positions = buf(n), buf(n)
        self.slots = [buf(n, fill=-1) for _ in range(groups)]
        self.seqs = buf(n, 3)  # (row, 1 row, context length) per row
        self.seqs[:, 0] = torch.arange(n, device=device)
        self.seqs[:, 1] = 1
        self.tables = [buf(n, width) for _ in range(groups)]
        caches = [kv_caches[s] for s in layout.layer_slot] if layout.hybrid else kv_caches
        self.graphs: dict[int, Captured] = {}
        self.replays = 0
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        t0 = time.perf_counter()
        with torch.inference_mode():
            for g in reversed(self.sizes):  # the largest first: the others fit in its pool
                metas = [backend.graph_metadata(self.slots[k][:g], self.seqs[:g],
                                                self.tables[k][:g], block_size)
                         for k in range(groups)]
                per_layer = [metas[k] for k in layout.layer_group] if layout.hybrid \
                    else metas[0]

                def forward(g=g, per_layer=per_layer) -> torch.Tensor:
                    return model(self.ids[:g], self.positions[:g], caches, per_layer)

                self.graphs[g] = capture(forward, pool)
        log.info("CUDA graphs: decode batches of %s captured in %.1f s",
                 ", ".join(map(str, self.sizes)), time.perf_counter() - t0)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, items: list[ForwardItem]) -> bool:
        """Whether a step's items can replay a graph: 1 to max_batch requests, each decoding
        one token and sampling from it."""
        return 0 < len(items) <= self.max_batch and all(
            len(it.token_ids) == 1 and it.num_outputs == 1 for it in items)

    @torch.inference_mode()
    def run(self, items: list[ForwardItem], timings: dict[str, float] | None = None
            ) -> torch.Tensor:
        """The final hidden states [len(items), hidden] of a step that `fits` (a copy: the
        graph's own output is rewritten by the next replay)."""
        t0 = time.perf_counter()
        n, bs = len(items), self.block_size
        g = self.sizes[bisect_left(self.sizes, n)]
        pad = g - n
        pos = [it.start for it in items]

        def put(dst: torch.Tensor, values: list[int]) -> None:
            dst.copy_(torch.tensor(values, dtype=torch.long))

        put(self.ids[:g], [it.token_ids[0] for it in items] + [0] * pad)
        put(self.positions[:g], pos + [0] * pad)
        put(self.seqs[:g, 2], [p + 1 for p in pos] + [0] * pad)  # padding: no context
        for k in range(self.layout.num_groups):
            tables = [it.block_ids if k == 0 else it.group_tables[k - 1] for it in items]
            put(self.slots[k][:g], [t[p // bs] * bs + p % bs
                                    for t, p in zip(tables, pos, strict=True)] + [-1] * pad)
            # Only the blocks up to each context are read: a row's stale entries past them
            # (from an earlier step) are never used.
            used = [t[:p // bs + 1] for t, p in zip(tables, pos, strict=True)]
            width = max(len(t) for t in used)
            rows = torch.tensor([t + [0] * (width - len(t)) for t in used], dtype=torch.long)
            self.tables[k][:n, :width].copy_(rows)
        t1 = time.perf_counter()
        graph = self.graphs[g]
        graph.replay()
        self.replays += 1
        hidden = graph.hidden[:n].clone()
        if timings is not None:
            timings["prepare"] = timings.get("prepare", 0.0) + t1 - t0
            timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t1
        return hidden
