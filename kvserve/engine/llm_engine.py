"""The synchronous engine: add_request / abort_request / step.

One step: the scheduler picks what runs, the runner computes and samples, and the engine
appends the tokens, detokenizes, checks stop conditions and releases finished requests.
A request with n > 1 becomes n sibling `Request`s (sample i seeded with seed + i) that share
the prompt's full KV blocks through the prefix cache; the caller sees one output with n
completions.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from kvserve.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpecConfig,
    parse_size,
    resolve_dtype,
)
from kvserve.distributed.parallel import SINGLE, TensorParallel, check_split
from kvserve.kv_cache.layout import KVLayout
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.planner import (
    capacity_gain,
    dtype_name,
    kv_token_bytes,
    plan_num_blocks,
    slot_bytes,
)
from kvserve.kv_cache.tiers import build_store, cache_fingerprint
from kvserve.models.loader import read_model_config, resolve_model, shard_config
from kvserve.outputs import CompletionOutput, OutputKind, RequestMetrics, RequestOutput
from kvserve.request import Request, RequestStatus, timeline_segments
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from kvserve.spec_decode import build_drafter
from kvserve.spec_decode.coordinator import SpecCoordinator
from kvserve.stats import EngineStats, SpecState, StepRecord, TierState
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer
from kvserve.worker.model_runner import ModelRunner, load_target, resolve_quantization
from kvserve.worker.tp_workers import TensorParallelError, TensorParallelWorkers

log = logging.getLogger(__name__)


@dataclass
class _Sample:
    request: Request
    detok: IncrementalDetokenizer
    index: int
    stop_reason: str | int | None = None
    sent_tokens: int = 0  # output tokens already handed out
    new_text: list[str] = field(default_factory=list)  # text not yet handed out


@dataclass
class _Group:
    """One caller request and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: OutputKind = OutputKind.CUMULATIVE
    samples: list[_Sample] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.status.finished for s in self.samples)


@dataclass
class EngineArgs:
    """User-facing knobs, named as vLLM names them."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    short_prompt_steps: bool = True
    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    num_kv_blocks: int | None = None  # exact block count, overriding the memory budget
    kv_cache_dtype: str = "auto"  # "auto" (the compute dtype) or "int8"
    # weight-only quantization: auto (a GGUF's precision class where kvserve's int4/int8
    # kernel runs, unless dtype is float32 by name; else none) | none | int8 | int4
    quantization: str = "auto"
    enable_prefix_caching: bool = True
    # keep blocks before the windows of sliding-window layers (see kv_cache.layout)
    disable_hybrid_kv_cache_manager: bool = False
    host_kv_cache_memory: int | str = 0  # host tier of the prefix cache; 0 = none
    kv_cache_dir: str | None = None  # disk tier of the prefix cache, kept across restarts
    kv_cache_disk_size: int | str = "8GiB"
    kv_cache_write_policy: str = "write-back"  # or "write-through"
    # speculative decoding: JSON string or dict, vLLM's --speculative-config (SpecConfig)
    speculative_config: str | dict | None = None
    timeline_buffer_size: int = 1000  # finished requests whose timelines are kept; 0: off
    step_buffer_size: int = 1000  # recent engine steps kept by the step profiler; 0: off
    # ranks the model is split over (torch.distributed: gloo on CPU, NCCL on CUDA); the KV
    # budget is per rank
    tensor_parallel_size: int = 1
    tp_timeout: float = 60.0  # seconds a collective may wait for a rank before it is failed
    seed: int = 0


class EngineDeadError(RuntimeError):
    """The engine can no longer serve (its loop died, or a tensor-parallel rank failed)."""


def _check_tensor_parallel(args: EngineArgs) -> None:
    """Features that keep state only on rank 0 and so cannot work split over ranks."""
    if parse_size(args.host_kv_cache_memory) or args.kv_cache_dir:
        raise ValueError("the host and disk prefix-cache tiers copy one process's KV cache; "
                         "they are not supported with --tensor-parallel-size > 1")
    spec = SpecConfig.parse(args.speculative_config)
    if spec is not None and spec.method == "mtp":
        raise ValueError("the mtp drafter reads the target's full embedding and LM head, "
                         "which tensor parallelism splits; use ngram or draft_model")


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but no CUDA device is available")
        dtype = resolve_dtype(args.dtype, device)
        if args.timeline_buffer_size < 0 or args.step_buffer_size < 0:
            raise ValueError("timeline and step buffer sizes must be >= 0")
        torch.manual_seed(args.seed)
        path = resolve_model(args.model)
        t0 = time.perf_counter()
        self.workers: TensorParallelWorkers | None = None
        self.dead: str | None = None  # why the engine can no longer step, once it cannot
        tp = SINGLE
        if args.tensor_parallel_size > 1:
            _check_tensor_parallel(args)
            cfg = read_model_config(path)  # metadata only: refuse a bad split before spawning
            check_split(cfg.num_heads, cfg.num_kv_heads, args.tensor_parallel_size)
            self.workers = TensorParallelWorkers(
                str(path), dtype, device.type, args.kv_cache_dtype,
                resolve_quantization(args.quantization, args.dtype),
                args.block_size, args.tensor_parallel_size, args.tp_timeout,
                args.max_model_len)
            tp = self.workers.tp
            device = self.workers.device
        elif args.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        try:
            self._build(args, path, dtype, device, tp, t0)
        except BaseException:
            if self.workers is not None:
                self.workers.close(timeout=1.0)
            raise

    def _build(self, args: EngineArgs, path, dtype: torch.dtype, device: torch.device,
               tp: TensorParallel, t0: float) -> None:
        """Load this rank's model shard and set up the cache, scheduler and drafter."""
        loaded, self.quantization = load_target(
            str(path), dtype, device, args.kv_cache_dtype,
            resolve_quantization(args.quantization, args.dtype), tp, args.max_model_len)
        self.model_config = cfg = loaded.config
        if loaded.gguf_reader is not None:
            self.tokenizer = Tokenizer.from_gguf(path, reader=loaded.gguf_reader)
            # The reader's parsed metadata (a numpy array per vocabulary entry and merge) and
            # its mapped file held ~230 MB measured here; drop it before the KV cache is
            # allocated, which is when resident memory peaks.
            loaded.gguf_reader = None
        else:
            self.tokenizer = Tokenizer.from_dir(path)
        max_len = args.max_model_len or cfg.max_position
        if max_len > cfg.max_position:
            raise ValueError(f"--max-model-len {max_len} exceeds the model's context length "
                             f"{cfg.max_position}")
        cache = CacheConfig(args.block_size, parse_size(args.kv_cache_memory),
                            args.num_kv_blocks, args.kv_cache_dtype)
        sched = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len,
                                args.short_prompt_steps)
        self.config = EngineConfig(str(path), dtype, device, cache, sched, args.seed)
        spec = SpecConfig.parse(args.speculative_config)
        drafter = (build_drafter(spec, loaded.model, path, dtype, device, sched)
                   if spec is not None else None)
        extra = drafter.kv_bytes_per_token() if drafter is not None else 0
        # A draft model keeps its K/V at the slots of group 0's table, which must then cover
        # every token: with no whole-context layer to head it, no block is freed early.
        all_windowed = all(cfg.window(i) for i in range(cfg.num_layers))
        free = not args.disable_hybrid_kv_cache_manager and not (extra and all_windowed)
        self.kv_layout = layout = KVLayout.for_model(cfg, free_windows=free)
        num_blocks = plan_num_blocks(shard_config(cfg, tp), cache, dtype, extra, layout)
        if self.workers is not None:
            num_blocks = self.workers.agree_num_blocks(cache, layout, num_blocks)
        self.runner = ModelRunner(loaded.model, cache, num_blocks, dtype, device, self.workers,
                                  layout)
        store = None
        host_bytes = parse_size(args.host_kv_cache_memory)
        if host_bytes or args.kv_cache_dir:
            if not args.enable_prefix_caching:
                raise ValueError("--host-kv-cache-memory and --kv-cache-dir need prefix caching")
            kv0 = self.runner.kv_caches[0]
            fingerprint = cache_fingerprint(path, cfg, dtype, (tuple(kv0.shape[:2]), kv0.shape[3],
                                                               str(kv0.dtype), layout),
                                            cache.block_size)
            store = build_store(self.runner.kv_caches, cache.block_size,
                                host_bytes, args.kv_cache_dir,
                                parse_size(args.kv_cache_disk_size), fingerprint,
                                args.kv_cache_write_policy)
        self.kv = KVCacheManager(num_blocks, cache.block_size, args.enable_prefix_caching,
                                 store, layout)
        self.scheduler = Scheduler(sched, self.kv)
        self.speculation: SpecCoordinator | None = None
        if spec is not None and drafter is not None:
            self.speculation = SpecCoordinator(spec, drafter, self.kv)
            self.runner.keep_hidden = drafter.needs_hidden
            log.info("speculative decoding: %s", spec)
        per_tok = kv_token_bytes(shard_config(cfg, tp), cache.kv_cache_dtype, dtype).total
        log.info("loaded %s (%s, %d layers, %s weights, %s; quantization %s: %s) in %.1fs",
                 path.name, cfg.architecture, cfg.num_layers, loaded.weight_format,
                 dtype_name(dtype), self.quantization, loaded.model.weight_kernel(),
                 time.perf_counter() - t0)
        variant = loaded.model.batch_variant_parts()
        if variant:
            log.warning("not batch-invariant here: a request's tokens may depend on what else "
                        "runs with it (%s)", "; ".join(variant))
        if layout.hybrid:
            # A block holds one group's layers; a token costs per_tok in the whole-context
            # layers and nothing more in a sliding-window layer once it leaves the window.
            blk = slot_bytes(shard_config(cfg, tp), cache.kv_cache_dtype, dtype, layout)
            log.info("KV cache%s: %d blocks x %d tokens x %d layers, %.2f GiB; %s; a token "
                     "takes %.1f KiB in every layer, %.1f KiB once older than the windows",
                     " (rank 0's heads)" if tp.size > 1 else "", num_blocks,
                     cache.block_size, layout.group_size,
                     num_blocks * cache.block_size * blk / 2**30, layout.describe(),
                     per_tok / 1024, blk * layout.group_windows.count(0) / 1024)
        else:
            log.info("KV cache%s: %d blocks x %d tokens = %d tokens, %.1f KiB per token, "
                     "%.2f GiB%s", " (rank 0's heads)" if tp.size > 1 else "", num_blocks,
                     cache.block_size, num_blocks * cache.block_size, per_tok / 1024,
                     num_blocks * cache.block_size * per_tok / 2**30,
                     "" if not any(cfg.window(i) for i in range(cfg.num_layers)) else
                     f"; {layout.describe()}" if layout.group_windows[0] else
                     "; blocks before the sliding windows kept")
        if cache.kv_cache_dtype == "int8":
            log.info("int8 KV: %.2fx the tokens of %s", capacity_gain(cfg, "int8", dtype),
                     dtype_name(dtype))
        self._timelines: OrderedDict[str, dict] = OrderedDict()  # finished, newest last
        self._timeline_limit = args.timeline_buffer_size
        self.steps: deque[StepRecord] = deque(maxlen=max(args.step_buffer_size, 1))
        self._keep_steps = args.step_buffer_size > 0
        self._num_steps = 0
        self._wall_offset = time.time() - time.perf_counter()  # perf_counter -> unix time
        self._groups: dict[str, _Group] = {}
        self._samples: dict[str, tuple[_Group, _Sample]] = {}  # by scheduler request id
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests in and out

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    output_kind: OutputKind = OutputKind.CUMULATIVE) -> str:
        """Queue a request; a str prompt is tokenized (with BOS if the model wants one).
        `cache_salt` keeps its prefix-cache blocks apart from other salts (tenants);
        `output_kind` says what its outputs hold (see OutputKind).
        Raises ValueError, naming the problem, for anything that cannot be served."""
        if self.dead is not None:
            raise EngineDeadError(f"engine failed: {self.dead}")
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups or request_id in self._samples:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, "
                                 f"{self.model_config.vocab_size}): {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        params.validate_vocab(self.model_config.vocab_size)
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise ValueError(f"prompt has {len(ids)} tokens, max_model_len is "
                             f"{self.max_model_len}")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        group = _Group(request_id, text, ids, output_kind)
        eos = self.tokenizer.eos_token_ids
        for i in range(params.n):
            sp = params.child(i) if params.n > 1 else params
            req = Request(f"{request_id}#{i}" if params.n > 1 else request_id, ids, sp,
                          eos, max_tokens, arrival, cache_salt=cache_salt)
            req.timeline.record = self._timeline_limit > 0
            req.timeline.add(arrival, "arrival", prompt_tokens=len(ids))
            group.samples.append(_Sample(req, IncrementalDetokenizer(
                self.tokenizer, sp.skip_special_tokens, sp.stop or (),
                sp.include_stop_str_in_output), i))
        for s in group.samples:  # validate every sample before queueing any
            if s.request.request_id in self._samples:
                raise ValueError(f"request id {s.request.request_id!r} is already in use")
            self.scheduler.check_request(s.request)
        for s in group.samples:
            self.scheduler.add_request(s.request)
            self._samples[s.request.request_id] = (group, s)
        self._groups[request_id] = group
        return request_id

    def abort_request(self, request_id: str, error: str | None = None) -> bool:
        """Stop a request now and free its KV blocks; its final output (finish_reason "abort",
        and `error` when it failed) comes out of the next step. False if the id is unknown or
        already finished."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for s in group.samples:
            if not s.request.status.finished:
                self._finish(s, RequestStatus.FINISHED_ABORTED)
                if error and s.request.timeline.events:
                    s.request.timeline.events[-1][2]["error"] = error
        out = self._output(group)
        out.error = error
        self._pending.append(out)
        self._forget(group)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._pending)

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------------------ a step

    def step(self) -> list[RequestOutput]:
        """Run one batch. A failure is confined to the requests it touches: if the model step
        raises, every request in that batch fails (the others keep going); if handling one
        request's new token raises, only that request fails. Failed requests come out
        finished with `error` set."""
        t0 = time.perf_counter()
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        t1 = time.perf_counter()
        sched = self.scheduler.schedule()
        t2 = time.perf_counter()
        if sched.is_empty:
            return self._take_pending()
        try:
            result = self.runner.execute(sched)
        except TensorParallelError as e:
            self._die(str(e))
            return self._take_pending()
        except Exception as e:
            log.exception("model step failed; failing the %d requests in it",
                          len(sched.scheduled))
            self.kv.discard_step()  # blocks registered for this step hold no valid K/V
            for s in sched.scheduled:
                entry = self._samples.get(s.request.request_id)
                if entry is not None:
                    self.abort_request(entry[0].request_id, f"{type(e).__name__}: {e}")
            return self._take_pending()
        self.scheduler.update_after_step(sched)
        self.kv.after_step()
        now = time.perf_counter()
        touched: dict[str, _Group] = {}
        hidden = result.hidden or [None] * len(result.token_ids)
        sampled = iter(zip(result.token_ids, result.logprobs, hidden, strict=True))
        for s in sched.scheduled:
            if not s.samples:
                continue
            tokens, logprobs, h = next(sampled)
            req = s.request
            if s.num_drafts:
                assert self.speculation is not None
                self.speculation.verified(req, s.num_drafts, len(tokens) - 1)
            entry = self._samples.get(req.request_id)
            if entry is None:
                continue  # its request failed earlier in this loop
            group, sample = entry
            try:
                self._append(sample, tokens, logprobs, now)
                if not req.status.finished:
                    if self.speculation is not None:
                        self.speculation.observe_hidden(req, h)
                    if s.num_drafts:
                        self.scheduler.rollback(req)
            except Exception as e:
                log.exception("request %s failed", group.request_id)
                self.abort_request(group.request_id, f"{type(e).__name__}: {e}")
                continue
            touched[group.request_id] = group
        outputs = self._take_pending()
        for group in touched.values():
            if group.request_id not in self._groups:
                continue  # failed after an earlier sample of it was appended
            outputs.append(self._output(group))
            if group.finished:
                self._forget(group)
        self._record_step(sched, result.timings, t0, t1, t2)
        return outputs

    def check_health(self) -> str | None:
        """Why the engine cannot serve, or None. Notices a tensor-parallel worker that died
        while the engine was idle (and then fails the engine as a failed step would)."""
        if self.dead is None and self.workers is not None:
            reason = self.workers.status()
            if reason is not None:
                self._die(reason)
        return self.dead

    def _die(self, reason: str) -> None:
        """A failure the engine cannot step past: fail every request with `reason`; later
        adds raise EngineDeadError."""
        log.error("engine failed: %s; failing %d requests", reason, len(self._groups))
        self.dead = reason
        for request_id in list(self._groups):
            self.abort_request(request_id, reason)

    def _record_step(self, sched, timings: dict[str, float], t0: float, t1: float,
                     t2: float) -> None:
        self._num_steps += 1
        if not self._keep_steps:
            return
        t_end = time.perf_counter()
        t3 = t2 + sum(timings.get(k, 0.0) for k in ("prepare", "forward", "sample"))
        prefill = sum(s.num_new_tokens for s in sched.scheduled if s.prefill)
        decode = sum(s.num_new_tokens for s in sched.scheduled if not s.prefill)
        drafts = sum(s.num_drafts for s in sched.scheduled)
        self.steps.append(StepRecord(
            self._num_steps, t0 + self._wall_offset, len(sched.scheduled), prefill, decode,
            drafts, len(sched.preempted), t1 - t0, t2 - t1, timings.get("prepare", 0.0),
            timings.get("forward", 0.0), timings.get("sample", 0.0), max(t_end - t3, 0.0),
            t_end - t0, timings.get("all_reduce", 0.0)))

    def _append(self, sample: _Sample, tokens: list[int], logprobs: list, now: float) -> None:
        """Add a step's tokens (several after speculation) to a request one at a time,
        streaming text and checking every stop rule after each; tokens after a stop are
        dropped, exactly as if they had been generated one per step."""
        req = sample.request
        for token, lp in zip(tokens, logprobs, strict=True):
            req.append_token(token)
            if req.sampling_params.logprobs is not None:
                req.logprobs.append(lp)
            if req.timeline.first_token is None:
                req.timeline.first_token = now
                req.timeline.add(now, "first_token")
            sample.new_text.append(sample.detok.add_tokens([token]))
            status = req.check_stop_token()
            if status is RequestStatus.FINISHED_STOPPED:
                sample.stop_reason = token if token not in req.eos_token_ids else None
            if sample.detok.stopped:
                status = RequestStatus.FINISHED_STOPPED
                sample.stop_reason = sample.detok.stop_reason
            if status is not None:
                self._finish(sample, status, now)
                return

    def _take_pending(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    # ------------------------------------------------------------------------------ helpers

    def _forget(self, group: _Group) -> None:
        del self._groups[group.request_id]
        for s in group.samples:
            del self._samples[s.request.request_id]
        if self._timeline_limit:
            self._timelines[group.request_id] = self._timeline_json(group)
            while len(self._timelines) > self._timeline_limit:
                self._timelines.popitem(last=False)

    def request_timeline(self, request_id: str) -> dict | None:
        """The timeline of a running request or of one of the last `timeline_buffer_size`
        finished ones (JSON-ready), None when unknown or expired. Call it on the thread that
        steps the engine (AsyncEngine.call does, between steps)."""
        group = self._groups.get(request_id)
        if group is not None:
            return self._timeline_json(group)
        return self._timelines.get(request_id)

    def stats(self) -> EngineStats:
        """A snapshot of the engine now, made of copies (see EngineStats)."""
        sched, kv = self.scheduler, self.kv
        tiers = ()
        if kv.store is not None:
            st = kv.store.stats
            tiers = tuple(TierState(t.name, len(t), getattr(t, "capacity", None),
                                    st.loads.get(t.name, 0), st.saves.get(t.name, 0))
                          for t in kv.store.tiers)
        spec = None
        if self.speculation is not None:
            c, t = self.speculation.config, self.speculation.stats
            spec = SpecState(c.method, c.num_speculative_tokens, c.max_batch_size,
                             c.min_acceptance, t.num_drafts, t.num_accepted, t.num_rounds,
                             t.num_steps_off, tuple(t.drafts_at), tuple(t.accepted_at))
        return EngineStats(
            num_steps=self._num_steps, running=len(sched.running), waiting=len(sched.waiting),
            num_preemptions=sched.num_preemptions, kv_usage=kv.usage,
            kv_blocks=kv.num_blocks, kv_free_blocks=kv.num_free_blocks,
            block_size=kv.block_size, tiers=tiers, prefix_queried_tokens=kv.stats.queries,
            prefix_hit_tokens=MappingProxyType(dict(kv.stats.hits)), spec=spec,
            steps=tuple(self.steps) if self._keep_steps else ())

    def dashboard_state(self, recent: int = 20) -> dict:
        """The engine's side of the dashboard (JSON-ready): batch, KV pool and tiers, prefix
        cache, speculation, and the newest requests' waterfall segments. Call it on the thread
        that steps the engine."""
        timelines = list(self._timelines.values())[-recent:]
        timelines += [self._timeline_json(g) for g in itertools.islice(
            self._groups.values(), recent)]
        return {
            **self.stats().as_json(),
            "recent": [{"id": t["id"], "arrival_unix": t["arrival_unix"],
                        "finished": t["finished"], "breakdown": t["breakdown"],
                        "segments": timeline_segments(t["samples"][0]["events"])}
                       for t in timelines],
        }

    def _timeline_json(self, group: _Group) -> dict:
        reqs = [s.request for s in group.samples]
        metrics = RequestMetrics.from_requests(reqs)
        return {
            "id": group.request_id,
            "object": "request.timeline",
            "arrival_unix": round(metrics.arrival_time + self._wall_offset, 6),
            "finished": group.finished,
            "prompt_tokens": len(group.prompt_token_ids),
            "breakdown": metrics.as_dict(),
            "samples": [{"index": s.index, "status": s.request.status.value,
                         "output_tokens": s.request.num_output_tokens,
                         "events": s.request.timeline.as_json()} for s in group.samples],
        }

    def _finish(self, sample: _Sample, status: RequestStatus, now: float | None = None) -> None:
        req = sample.request
        if self.speculation is not None:
            self.speculation.forget(req)
        if not sample.detok.stopped:
            sample.new_text.append(sample.detok.finish())
        req.timeline.finished = time.perf_counter() if now is None else now
        req.timeline.add(req.timeline.finished, "finished", reason=status.finish_reason)
        self.scheduler.finish(req, status)

    def _output(self, group: _Group) -> RequestOutput:
        """The group's output for this step, holding what its OutputKind asks for: the new
        tokens, text and logprobs are sliced from the end, so only CUMULATIVE outputs (and
        the last one of FINAL_ONLY) cost more as a request grows."""
        kind = group.output_kind
        full = kind is OutputKind.CUMULATIVE or (kind is OutputKind.FINAL_ONLY
                                                 and group.finished)
        completions = []
        for s in group.samples:
            req = s.request
            new_ids = req.output_token_ids[s.sent_tokens:]
            new_text = "".join(s.new_text)
            s.new_text.clear()
            logprobs = None
            if req.sampling_params.logprobs is not None:
                logprobs = (list(req.logprobs) if full else req.logprobs[s.sent_tokens:]
                            if kind is OutputKind.DELTA else [])
            if full:
                text, token_ids = s.detok.text, list(req.output_token_ids)
            elif kind is OutputKind.DELTA:
                text, token_ids = new_text, new_ids
            else:
                text, token_ids = "", []
            completions.append(CompletionOutput(
                index=s.index,
                text=text,
                token_ids=token_ids,
                finish_reason=req.status.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=logprobs,
                delta_text=new_text,
                delta_token_ids=new_ids,
                num_output_tokens=req.num_output_tokens,
            ))
            s.sent_tokens = req.num_output_tokens
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            metrics=RequestMetrics.from_requests([s.request for s in group.samples]),
            num_cached_tokens=group.samples[0].request.num_cached_tokens or 0,
        )

    def close(self) -> None:
        """Persist the prefix cache to the disk tier, when there is one (a clean shutdown),
        and stop the tensor-parallel workers."""
        if self.kv.store is not None and any(t.name == "disk" for t in self.kv.store.tiers):
            t0 = time.perf_counter()
            written = self.kv.flush_to_disk()
            log.info("flushed %d KV blocks to disk in %.1fs", written,
                     time.perf_counter() - t0)
        if self.workers is not None:
            self.workers.close()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if not self.scheduler.has_unfinished:
            assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"
