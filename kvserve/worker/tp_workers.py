"""Tensor-parallel worker processes, and the engine's handle on them.

The engine process is rank 0: it runs the scheduler, the KV block accounting and the sampler
once, and its own shard of the model. Ranks 1..N-1 are spawned processes that each load their
shard and allocate their share of the KV cache (their own heads, the same block count), then
loop: receive a step's `ForwardItem`s, run the same forward, join the collectives inside it
(the all-reduces after row-parallel layers and the vocab-parallel embedding, the logit
gather). Only rank 0 samples, so every rank sees the same tokens because only one rank chooses
them.

Two process groups, both from `torch.distributed`:
- WORLD carries the collectives of the forward pass (gloo on CPU, NCCL on CUDA), with the
  `--tp-timeout`: a rank that dies or hangs mid-step surfaces as an error on rank 0 within it.
  Gloo's collectives block the host, so their own timeout raises. NCCL's only queue work on
  the GPU: rank 0 waits for each step's work with that timeout itself (`settle`, polling a
  CUDA event, never an unbounded synchronize), and NCCL's watchdog is told not to tear the
  process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=0), so a dead rank fails requests as on gloo.
- `control` (gloo, with no practical timeout) carries the step broadcast, which workers wait
  on while the server is idle. A worker whose driver dies sees its connection close and exits.

Any failure of a step under tensor parallelism leaves the ranks out of step with each other,
so it is fatal: the runner raises `TensorParallelError` and the engine fails every request and
reports unhealthy.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from kvserve import kernels
from kvserve.distributed.parallel import TensorParallel
from kvserve.kv_cache.planner import plan_num_blocks
from kvserve.models.loader import shard_config
from kvserve.worker.model_runner import (
    allocate_kv_caches,
    load_target,
    release_freed_memory,
    run_forward,
)

log = logging.getLogger(__name__)

_NO_TIMEOUT = timedelta(days=365)
# Start-up (a worker's spawn and imports before it reaches the store, then its shard's load
# before it takes the cache plan) gets at least this long; a step keeps --tp-timeout. A
# worker spawned on a loaded 2-core machine took over 3 s just to reach the store.
STARTUP_TIMEOUT_S = 120.0


class TensorParallelError(RuntimeError):
    """A rank died, hung past the timeout, or a step failed midway: the group is unusable."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its shard the same way (picklable, sent to workers)."""

    model_path: str
    dtype: torch.dtype
    device: str  # "cpu", "cuda" or "cuda:N": rank r runs on cuda:N+r
    kv_cache_dtype: str
    quantization: str  # as given: "auto" is resolved per rank from the same checkpoint
    block_size: int
    size: int
    store_port: int  # rank 0's TCPStore on 127.0.0.1, where the ranks meet
    timeout_s: float
    threads: int  # torch threads per rank
    max_model_len: int | None = None  # chooses LongRoPE's factors as rank 0 does


def rank_device(spec: WorkerSpec, rank: int) -> torch.device:
    """Rank `rank`'s device: consecutive GPUs from the one --device names (cuda = cuda:0)."""
    device = torch.device(spec.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def wait_until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `done` (a CUDA event's query) until it is true, sleeping 50 us growing to 2 ms
    between polls; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g}s")
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)


def join_group(spec: WorkerSpec, rank: int,
               store: dist.Store) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Form the process groups over `store`; returns this rank's TensorParallel (WORLD) and
    the control group."""
    torch.set_num_threads(spec.threads)
    device = rank_device(spec, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        # A timed-out collective must not kill the process: rank 0 detects it (settle).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.size,
                            timeout=timedelta(seconds=spec.timeout_s))
    control = dist.new_group(backend="gloo", timeout=_NO_TIMEOUT)
    return TensorParallel(rank, spec.size, dist.group.WORLD, backend), control


def broadcast_object(obj: object, group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Rank 0: send a picklable object to every rank, failing after `timeout` (gloo's
    broadcast waits for the receivers to post theirs, so a hung rank would block it)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    for t in (torch.tensor([data.numel()], dtype=torch.long), data):
        dist.broadcast(t, src=0, group=group, async_op=True).wait(timeout)


def receive_object(group: dist.ProcessGroup) -> object:
    """Ranks 1..N-1: the next object rank 0 broadcasts (waits as long as the group allows)."""
    size = torch.empty(1, dtype=torch.long)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 - from rank 0 of our own group


def agree_num_blocks(tp: TensorParallel, num_blocks: int, device: torch.device) -> int:
    """The smallest block count any rank can hold (each plans its own heads' share)."""
    t = torch.tensor([num_blocks], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())


def worker_main(rank: int, spec: WorkerSpec) -> None:
    """Entry point of ranks 1..N-1 (spawned)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(message)s")
    try:
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False,
                              timeout=timedelta(seconds=spec.timeout_s))
        store.set(f"up/{rank}", "1")
        tp, control = join_group(spec, rank, store)
        device = rank_device(spec, rank)
        loaded, _ = load_target(spec.model_path, spec.dtype, device, spec.kv_cache_dtype,
                                spec.quantization, tp, spec.max_model_len)
        model = loaded.model
        loaded.gguf_reader = None  # metadata only the tokenizer needs (on rank 0)
        # Rank 0 sends its plan (which may include a drafter's share or an explicit count);
        # each rank answers with what it can hold and all take the minimum.
        cache, layout = receive_object(control)
        num_blocks = agree_num_blocks(
            tp, plan_num_blocks(shard_config(loaded.config, tp), cache, spec.dtype,
                                layout=layout), device)
        release_freed_memory()
        kv_caches = allocate_kv_caches(model, num_blocks * spec.block_size, spec.dtype, device,
                                       layout)
        with torch.inference_mode():
            while True:
                items = receive_object(control)
                if items is None:
                    break
                hidden = run_forward(model, kv_caches, spec.block_size, items, device,
                                     layout=layout)
                if hidden.shape[0]:
                    model.compute_logits(hidden)  # this rank's share of the logit gather
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Stopped cleanly: the interpreter's own teardown (torch's modules, the shard's tensors)
    # would add ~0.6 s to every close and free nothing the exit does not.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TensorParallelWorkers:
    """The driver's (rank 0's) side: starts ranks 1..N-1, joins the group as rank 0, sends
    each step's inputs, watches the workers' health and stops them."""

    def __init__(self, model_path: str, dtype: torch.dtype, device: str, kv_cache_dtype: str,
                 quantization: str, block_size: int, size: int, timeout_s: float,
                 max_model_len: int | None = None) -> None:
        if size < 2:
            raise ValueError("tensor parallelism needs at least 2 ranks")
        first = torch.device(device)
        if first.type == "cuda" and torch.cuda.device_count() < (first.index or 0) + size:
            raise ValueError(f"--tensor-parallel-size {size} on {device} needs CUDA devices "
                             f"{first.index or 0}..{(first.index or 0) + size - 1}, "
                             f"{torch.cuda.device_count()} visible")
        if first.type == "cpu":
            kernels.ops()  # build the C++ kernels once here, not in every rank at the same time
        cores = len(os.sched_getaffinity(0))
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        self.spec = WorkerSpec(model_path, dtype, device, kv_cache_dtype, quantization,
                               block_size, size, store.port, timeout_s, max(1, cores // size),
                               max_model_len)
        self.timeout = timeout
        self.startup_s = max(timeout_s, STARTUP_TIMEOUT_S)
        self.error: str | None = None
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
        self.procs = [ctx.Process(target=worker_main, args=(rank, self.spec), daemon=True,
                                  name=f"kvserve-tp{rank}") for rank in range(1, size)]
        for p in self.procs:
            p.start()
        try:
            self._wait_for_workers(store, time.monotonic() + self.startup_s)
            self.tp, self.control = join_group(self.spec, 0, store)
        except Exception as e:
            self.close()
            raise TensorParallelError(f"tensor-parallel start-up failed: {e}") from e
        self.device = rank_device(self.spec, 0)
        log.info("tensor parallel: %d ranks (%s), %d threads each, timeout %.0fs", size,
                 dist.get_backend(), self.spec.threads, timeout_s)

    def _wait_for_workers(self, store: dist.Store, deadline: float) -> None:
        """Until every worker has reached the store; a worker that exits first (a crash, or
        a script that spawns without an `if __name__ == "__main__":` guard) fails at once
        instead of at the rendezvous timeout."""
        keys = [f"up/{p}" for p in range(1, self.spec.size)]
        while not store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not start within {self.startup_s:.0f}s")
            time.sleep(0.05)

    def agree_num_blocks(self, cache, layout, num_blocks: int) -> int:
        """Send the cache config and KV layout to the workers and agree on the block
        count. The workers take the plan once their shards are loaded: start-up's timeout."""
        self.check()
        self._guard(lambda: broadcast_object((cache, layout), self.control,
                                             timedelta(seconds=self.startup_s)))
        return self._guard(lambda: agree_num_blocks(self.tp, num_blocks, self.device))

    def status(self) -> str | None:
        """Why the group cannot run steps (a worker exited, or a step failed), or None."""
        if self.error is None:
            dead = [(p.name, p.exitcode) for p in self.procs if p.exitcode is not None]
            if dead:
                self.error = ", ".join(f"{name} exited with code {code}" for name, code in dead)
        return None if self.error is None else f"tensor-parallel group failed: {self.error}"

    def check(self) -> None:
        """Raise TensorParallelError if the group cannot run steps."""
        reason = self.status()
        if reason is not None:
            raise TensorParallelError(reason)

    def send(self, obj: object) -> None:
        """Broadcast a step's ForwardItems (or the cache config, or None: stop)."""
        self.check()
        self._guard(lambda: broadcast_object(obj, self.control, self.timeout))

    def settle(self, device: torch.device) -> None:
        """Wait, at most the timeout, for the work queued so far on `device`'s stream (a
        step's forward and its collectives); nothing to wait for off a GPU, where every
        collective has already returned. A hung or dead peer fails the group."""
        if device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._guard(lambda: wait_until(event.query, self.timeout.total_seconds(),
                                       "a tensor-parallel step on the GPU"))

    def _guard(self, fn):
        try:
            return fn()
        except Exception as e:
            self.fail(e)

    def fail(self, e: BaseException) -> NoReturn:
        """Record a failure of the group and raise it as TensorParallelError."""
        if self.error is None:
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            with_exit = [p.name for p in self.procs if p.exitcode is not None]
            if with_exit:
                self.error += f" ({', '.join(with_exit)} exited)"
        raise TensorParallelError(f"tensor-parallel group failed: {self.error}") from e

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers: a stop message when the group is healthy, then terminate."""
        if self.error is None and dist.is_initialized():
            with contextlib.suppress(Exception):  # stopping anyway
                self.send(None)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        # A failed NCCL communicator may still have work queued on a hung peer; destroying
        # it would wait on that work, so it is left to the process's exit.
        if dist.is_initialized() and (self.error is None or dist.get_backend() != "nccl"):
            dist.destroy_process_group()
