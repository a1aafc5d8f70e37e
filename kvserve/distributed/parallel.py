"""How a model is cut across tensor-parallel ranks, and the collectives that join the pieces.

Every split is a contiguous, near-even range (the first ranks take one more when a count does
not divide), so a model whose head or KV-head count does not divide by the rank count still
shards. Attention is split by KV group: a rank holds whole groups (its KV heads and all the
query heads that read them), so each rank's attention is an ordinary GQA over fewer heads.
When there are fewer KV heads than ranks, each KV head is replicated on the ranks that share
its group, and the group's query heads are split among them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when n items are cut into `parts` contiguous, near-even
    parts, the first n % parts of them one larger."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(start, rows) of a rank's vocabulary shard: every rank holds the same number of rows
    (the last one's padded past the vocabulary), so logit shards gather as equal pieces."""
    rows = -(-vocab_size // size)
    return rank * rows, rows


@dataclass(frozen=True)
class HeadShard:
    """The query and KV heads one rank holds, as (start, count) ranges of the full model's."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Rank `rank`'s heads; raises ValueError for a split that leaves a rank without query
    heads or cannot keep every query head next to its KV head."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= size:
        kv_start, kv_count = split(num_kv_heads, size, rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {size} "
                         f"ranks: the rank count must be a multiple of the KV head count")
    sharers = size // num_kv_heads  # ranks replicating each KV head
    if group < sharers:
        raise ValueError(f"{num_heads} query heads do not cover {size} ranks "
                         f"({group} per KV head, {sharers} ranks per KV head)")
    kv = rank // sharers
    q_start, q_count = split(group, sharers, rank % sharers)
    return HeadShard(kv * group + q_start, q_count, kv, 1)


def check_split(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raise ValueError, before any rank starts, if the heads cannot be split over `size`
    ranks (see head_shard)."""
    for rank in range(size):
        head_shard(num_heads, num_kv_heads, rank, size)


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group. `group` carries the collectives
    inside the forward pass; `take_comm_seconds` adds up the time spent in them (waiting for
    the slower rank included), which the runner reports per step."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    backend: str = "gloo"
    comm_seconds: float = field(default=0.0, compare=False)  # host-timed (gloo)
    # NCCL collectives return once queued: their time is the GPU's, between CUDA events.
    _gpu_spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(
        default_factory=list, compare=False, repr=False)

    def _begin(self) -> float | torch.cuda.Event:
        if self.backend != "nccl":
            return time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _end(self, start: float | torch.cuda.Event) -> None:
        if isinstance(start, float):
            self.comm_seconds += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._gpu_spans.append((start, end))

    def take_comm_seconds(self) -> float:
        """Seconds spent in collectives since the last call, and start counting afresh. On
        NCCL the spans are read from their events, so call it once the step's work is done
        (after the runner's settle and sampling)."""
        total = self.comm_seconds + sum(s.elapsed_time(e) for s, e in self._gpu_spans) / 1e3
        self.comm_seconds = 0.0
        self._gpu_spans.clear()
        return total

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks; every rank gets the same bits. Partial sums travel in float32,
        so a reduced-precision model rounds once after the sum, as a single matmul would.

        On gloo the sum is built from cheaper collectives than its all_reduce, which costs
        the same large fixed time between two processes for any step size: two ranks swap
        their parts with one send/recv pair each (a fraction of it at decode sizes), more
        ranks all-gather and sum in rank order. NCCL's all_reduce is used as it is."""
        if self.size == 1:
            return x
        t0 = self._begin()
        y = x.float()
        if self.backend == "nccl":
            dist.all_reduce(y, group=self.group)
        elif self.size == 2:
            other = torch.empty_like(y)
            peer = self._global(1 - self.rank)
            ops = [dist.P2POp(dist.isend, y, peer, self.group),
                   dist.P2POp(dist.irecv, other, peer, self.group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            y = y + other  # addition commutes exactly: both ranks hold the same sum
        else:
            parts = y.new_empty((self.size, *y.shape))
            dist.all_gather_single(parts.view(-1, *y.shape[1:]), y, group=self.group)
            y = parts.sum(0)
        self._end(t0)
        return y.to(x.dtype)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x (same shape on all) along the last dimension on rank 0;
        None on the other ranks."""
        if self.size == 1:
            return x
        t0 = self._begin()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=self._global(0), group=self.group)
        self._end(t0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


SINGLE = TensorParallel()
