"""Tensor parallelism: how heads and vocabulary are cut (unit), greedy outputs of two gloo
ranks identical to one process (tiny models whose KV heads do not divide by the ranks, the
default model, quantized weights and KV, speculation), and a dead or hung rank failing the
in-flight requests and /health instead of hanging.

Identity is checked in float32. In bfloat16 the ranks' partial sums are added in another
order than one process's matmul adds them, and rounding every activation to bf16 turns
those last-bit differences into different tokens at near-ties (benchmarks/tensor_parallel.py
measures how soon)."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvserve.distributed.parallel import TensorParallel, check_split, head_shard, split
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import EngineArgs
from kvserve.engine.startup import create_config
from kvserve.layers.linear import ParallelLMHead, VocabParallelEmbedding
from kvserve.sample.sampling_params import SamplingParams
from kvserve.worker.tp_workers import (
    TensorParallelError,
    TensorParallelWorkers,
    WorkerSpec,
    rank_device,
    wait_until,
)
from tests.conftest import build_tiny_model
from tests.server_utils import run_server

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TINY_PROMPTS = ["hello world", "a" * 45, "The quick brown fox jumps over", "0123456789" * 3]


# ------------------------------------------------------------------------------ partition


@given(st.integers(1, 200), st.integers(1, 9), st.data())
def test_split_is_contiguous_near_even_and_complete(n, parts, data):
    ranges = [split(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0
    for (s0, n0), (s1, _) in zip(ranges, ranges[1:], strict=False):
        assert s0 + n0 == s1
    assert sum(size for _, size in ranges) == n
    assert max(size for _, size in ranges) - min(size for _, size in ranges) <= 1


@pytest.mark.parametrize("heads,kv,size", [
    (9, 3, 2),  # the default model: 3 KV heads over 2 ranks -> 2 and 1
    (6, 3, 2), (32, 8, 3), (8, 8, 4), (12, 4, 4),
    (4, 1, 2), (8, 2, 4), (8, 2, 8), (12, 3, 6),  # fewer KV heads than ranks: replicated
])
def test_head_shard_gives_every_query_head_once_beside_its_kv_head(heads, kv, size):
    group = heads // kv
    seen: list[int] = []
    for rank in range(size):
        s = head_shard(heads, kv, rank, size)
        assert s.q_count >= 1 and s.kv_count >= 1
        local_group = s.q_count // s.kv_count
        assert local_group * s.kv_count == s.q_count  # each rank is a uniform GQA
        for i in range(s.q_count):
            q = s.q_start + i
            seen.append(q)
            # the KV head this query head reads, as the rank's local GQA maps it
            assert s.kv_start + i // local_group == q // group
    assert seen == list(range(heads))


@pytest.mark.parametrize("heads,kv,size", [(4, 2, 3), (2, 1, 4), (6, 3, 4)])
def test_head_shard_rejects_impossible_splits(heads, kv, size):
    with pytest.raises(ValueError, match="ranks"):
        check_split(heads, kv, size)


def test_vocab_shards_are_equal_and_zero_padded():
    full = torch.arange(7 * 3, dtype=torch.float32).view(7, 3) + 1
    shards = []
    for rank in range(2):
        emb = VocabParallelEmbedding(7, 3, TensorParallel(rank, 2))
        emb.load(full)
        head = ParallelLMHead(3, 7, TensorParallel(rank, 2))
        head.load(full)
        assert torch.equal(head.weight, emb.weight)
        shards.append(emb.weight)
    assert [s.shape[0] for s in shards] == [4, 4]
    assert torch.equal(torch.cat(shards)[:7], full)
    assert not shards[1][3].any()  # the padding row of the last rank


def test_features_that_keep_rank0_state_are_refused(tiny_llama_dir):
    """Refused by create_config, before a rank is spawned or the model read."""
    def config(**kw):
        return create_config(EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, **kw))

    with pytest.raises(ValueError, match="not supported with --tensor-parallel-size"):
        config(host_kv_cache_memory="1GiB")
    with pytest.raises(ValueError, match="mtp drafter"):
        config(speculative_config=json.dumps({"method": "mtp", "model": "x.safetensors"}))
    with pytest.raises(ValueError, match="--engine-process does not support"):
        config(engine_process=True)


# ------------------------------------------------------- the NCCL path, with fakes (no GPU)


def _spec(device: str) -> WorkerSpec:
    return WorkerSpec("m", torch.float32, device, "auto", "auto", 16, 2, 0, 1.0, 1)


def test_ranks_take_consecutive_gpus_from_the_named_one():
    spec = _spec
    assert [rank_device(spec("cuda:2"), r) for r in (0, 1)] == [torch.device("cuda", 2),
                                                               torch.device("cuda", 3)]
    assert rank_device(spec("cuda"), 1) == torch.device("cuda", 1)
    assert rank_device(spec("cpu"), 1) == torch.device("cpu")


def test_wait_until_is_bounded():
    calls = iter([False, False, True])
    wait_until(lambda: next(calls), 1.0, "x")  # returns once done
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="a step did not finish within 0.05s"):
        wait_until(lambda: False, 0.05, "a step")
    assert time.monotonic() - t0 < 1.0


class _NeverDone:
    """A CUDA event on a stream blocked by a collective whose peer is gone."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return False


def test_a_hung_gpu_step_fails_the_group_within_the_timeout(monkeypatch):
    """settle() on a stream that never finishes (NCCL waiting on a dead rank) raises the
    group's error after the timeout and leaves it unhealthy, as gloo's timeout does; on the
    CPU it has nothing to wait for."""
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: _NeverDone())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    workers = TensorParallelWorkers.__new__(TensorParallelWorkers)
    workers.procs, workers.error, workers.timeout = [], None, timedelta(seconds=0.05)
    workers.settle(torch.device("cpu"))
    assert workers.status() is None
    with pytest.raises(TensorParallelError, match="did not finish within"):
        workers.settle(torch.device("cuda", 0))
    assert "tensor-parallel group failed: TimeoutError" in workers.status()


class _TimedEvent:
    """A CUDA event whose elapsed_time is the gap between the fake clock's readings."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self, stream=None) -> None:
        _TimedEvent.clock += 2.5
        self.at = _TimedEvent.clock

    def elapsed_time(self, end: _TimedEvent) -> float:  # ms, as torch's
        return end.at - self.at


def test_nccl_collective_time_is_read_from_gpu_events(monkeypatch):
    """NCCL calls return once queued: their time comes from events around them, read after
    the step (take_comm_seconds), and counting restarts from there."""
    monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
    tp = TensorParallel(rank=0, size=2, backend="nccl")
    for _ in range(2):
        tp._end(tp._begin())
    assert tp.take_comm_seconds() == pytest.approx(2 * 2.5e-3)
    assert tp.take_comm_seconds() == 0.0
    gloo = TensorParallel(rank=0, size=2, backend="gloo")
    gloo._end(gloo._begin())
    assert 0.0 <= gloo.take_comm_seconds() < 1.0 and gloo.comm_seconds == 0.0


# ------------------------------------------------------------------- identical outputs


@pytest.fixture(scope="module")
def uneven_gqa_dir(tmp_path_factory):
    """6 query heads over 3 KV heads: 2 KV heads on rank 0, 1 on rank 1."""
    return build_tiny_model(tmp_path_factory.mktemp("tp-gqa"), num_heads=6, num_kv_heads=3,
                            hidden_size=96)


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory):
    """One KV head for 4 query heads, tied embeddings: the KV head is replicated."""
    return build_tiny_model(tmp_path_factory.mktemp("tp-mqa"), tie=True, num_heads=4,
                            num_kv_heads=1)


def _generate(model, prompts, params=GREEDY, **kw) -> list[list[int]]:
    with LLM(str(model), **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _both(model, prompts, params=GREEDY, **kw):
    return (_generate(model, prompts, params, tensor_parallel_size=1, **kw),
            _generate(model, prompts, params, tensor_parallel_size=2, **kw))


@pytest.mark.parametrize("kw", [
    # chunked prefill mixed with decodes (a 45-token prompt over 16-token steps)
    dict(dtype="float32", quantization="none", max_num_batched_tokens=16),
    # int8 weights: a row-parallel shard is scaled by its whole row's magnitude
    dict(dtype="float32", quantization="int8", kv_cache_dtype="int8"),
    # float16 K/V under float32 activations on every CPU: what --dtype and --kv-cache-dtype
    # auto give on AVX2 (tests/test_kv16.py checks that resolution). Not --dtype auto here: it
    # is bf16 on a CPU with AVX512-BF16, where identity is not expected (above)
    dict(dtype="float32", kv_cache_dtype="float16", quantization="none",
         max_num_batched_tokens=16),
], ids=["fp32-chunked", "int8w-int8kv", "fp16kv-chunked"])
def test_tp2_greedy_matches_one_process_uneven_kv_heads(uneven_gqa_dir, kw):
    one, two = _both(uneven_gqa_dir, TINY_PROMPTS, kv_cache_memory="8MiB", **kw)
    assert one == two


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_requests_are_independent_of_their_batch(uneven_gqa_dir, dtype):
    """Two ranks add two partial sums, which is exact in either order, so under tensor
    parallelism too a request's tokens and logprobs do not depend on its batch, on chunking
    or on prefix-cache hits (the solo runs leave the prompts cached)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLM(str(uneven_gqa_dir), dtype=dtype, kv_cache_memory="8MiB",
             tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        if llm.engine.local_core.runner.model.batch_variant_parts():
            pytest.skip("no batch-invariant kernels here")
        alone = [llm.generate([p], params)[0].outputs[0] for p in TINY_PROMPTS]
        together = [o.outputs[0] for o in llm.generate(TINY_PROMPTS, params)]
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]


def test_tp2_greedy_matches_one_process_replicated_kv_head(mqa_dir):
    one, two = _both(mqa_dir, TINY_PROMPTS, dtype="float32", quantization="int4",
                     kv_cache_memory="8MiB")
    assert one == two


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_with_speculation_matches_plain_decoding(uneven_gqa_dir, mqa_dir, method):
    """Drafts are proposed on rank 0 (a draft model there, unsharded) and verified by the
    split target."""
    prompts = ["abcabcabcabcabcabc", "hello hello hello hello"]
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
            if method == "ngram" else  # a draft model with the same tokenizer
            {"method": "draft_model", "num_speculative_tokens": 3, "model": str(mqa_dir),
             "quantization": "none", "adaptive_depth": False, "max_batch_size": 64})
    plain = _generate(uneven_gqa_dir, prompts, dtype="float32", kv_cache_memory="8MiB")
    with LLM(str(uneven_gqa_dir), dtype="float32", kv_cache_memory="8MiB",
             tensor_parallel_size=2, speculative_config=json.dumps(spec)) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.local_core.speculation.stats.num_drafts > 0
    assert plain == out


def test_tp2_greedy_matches_one_process_default_model(real_model_path):
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    one, two = _both(real_model_path, prompts, params, kv_cache_memory="64MiB",
                     dtype="float32", quantization="none")
    assert one == two


def test_tp2_int4_next_tokens_match_one_process_default_model(real_model_path):
    """int4 on the VNNI kernel quantizes activations to int8 per group. The different order
    of a row-parallel layer's partial sums moves a few values across a rounding step, and
    each such step perturbs the next layer enough to move more: the two runs end up with
    independent rounding noise, as large as int8 activations' own error (measured here:
    the top-5 logprobs differ by 0.175 at the median, 0.49 at most; int4 against float32
    weights, 0.187 and 0.49). Compared then: the next-token distribution after every prefix
    of a greedy continuation (teacher forcing), to within that noise."""
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
    cont = _generate(real_model_path, prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                              ignore_eos=True),
                     kv_cache_memory="64MiB", dtype="float32", quantization="int4")
    with LLM(str(real_model_path)) as llm:
        tok = llm.engine.tokenizer
    prefixes = [tok.encode(p) + c[:j] for p, c in zip(prompts, cont, strict=True)
                for j in range(len(c))]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)
    firsts = []
    for tp in (1, 2):
        with LLM(str(real_model_path), kv_cache_memory="64MiB", dtype="float32",
                 quantization="int4", tensor_parallel_size=tp) as llm:
            firsts.append([o.outputs[0].logprobs[0] for o in llm.generate(prefixes, params)])
    same = [a.token_id == b.token_id for a, b in zip(*firsts, strict=True)]
    diffs = sorted(abs(a.logprob - b.logprob) for a, b in zip(*firsts, strict=True))
    assert sum(same) >= 0.85 * len(same)
    assert diffs[len(diffs) // 2] < 0.3 and diffs[-1] < 1.0


# ---------------------------------------------------------------------------- failures


def _stream_until_error(url: str, on_first_chunk) -> tuple[list[str], float]:
    """Stream a long completion, call `on_first_chunk` after the first token; returns the
    SSE data lines and the seconds from that call to the end of the stream."""
    lines: list[str] = []
    t_fail = None
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if t_fail is None:
                on_first_chunk()
                t_fail = time.monotonic()
    assert t_fail is not None
    return lines, time.monotonic() - t_fail


def _engine_workers(app):
    return app.state.kvserve.llm_engine.workers


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_dead_or_hung_rank_fails_requests_and_health(uneven_gqa_dir, how):
    args = EngineArgs(model=str(uneven_gqa_dir), tensor_parallel_size=2, tp_timeout=3.0,
                      kv_cache_memory="8MiB", dtype="float32")
    with run_server(args, served_model_name="tiny") as (url, app):
        worker = _engine_workers(app).procs[0]
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        try:
            lines, waited = _stream_until_error(url, lambda: os.kill(worker.pid, sig))
            errors = [json.loads(x)["error"] for x in lines if x.startswith('{"error"')]
            assert errors and "tensor-parallel group failed" in errors[0]["message"], lines[-3:]
            assert lines[-1] == "[DONE]"
            assert waited < 30
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 503
            assert "tensor-parallel" in health.json()["error"]["message"]
            again = httpx.post(f"{url}/v1/completions", timeout=10,
                               json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert again.status_code == 503
        finally:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGKILL)


def test_idle_rank_death_makes_health_unhealthy(uneven_gqa_dir):
    args = EngineArgs(model=str(uneven_gqa_dir), tensor_parallel_size=2, kv_cache_memory="8MiB",
                      dtype="float32")
    with run_server(args, served_model_name="tiny") as (url, app):
        ok = httpx.post(f"{url}/v1/completions", timeout=30,
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
        assert ok.status_code == 200
        worker = _engine_workers(app).procs[0]
        worker.kill()
        worker.join(10)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 after a rank died"
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", timeout=10,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "exited" in r.json()["error"]["message"]
