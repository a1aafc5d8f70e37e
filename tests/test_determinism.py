"""Deterministic by default: a request's tokens are a function of its own prompt and sampling
parameters (for a given model, configuration and seed) — never of what else runs with it, how
its prompt was chunked, prefix-cache hits from any tier, preemption or speculation.

Random workloads (prompts sharing prefixes, staggered arrivals, step budgets that chunk the
prompts, KV pools small enough to preempt, prefix caching with host and disk tiers, n > 1,
n-gram and draft-model speculation) are run through one engine, and every request's greedy
or seeded tokens are compared with the same request run alone on an engine with no prefix
cache and no speculation. So are the logprobs of those tokens, bit for bit: the tiny test
models' peaked distributions would hide a numeric difference from the tokens alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.llm_engine import EngineArgs, LLMEngine, build_engine
from kvserve.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def _invariant_or_skip(engine: LLMEngine) -> None:
    variant = engine.local_core.runner.model.batch_variant_parts()
    if variant:
        pytest.skip(f"no batch-invariant kernels here: {'; '.join(variant)}")


Completion = tuple[list[int], list[float] | None]


def _completions(out) -> list[Completion]:
    return [(c.token_ids, None if c.logprobs is None else [lp.logprob for lp in c.logprobs])
            for c in out.outputs]


def run_workload(args: EngineArgs, requests: list[tuple[list[int], SamplingParams, int]],
                 counts: dict[str, int] | None = None, must_be_invariant: bool = False
                 ) -> list[list[Completion]]:
    """Each request (prompt ids, params, arrival step) added at its step of one engine;
    returns every request's completions (token ids, their logprobs), in request order.
    `counts` gets the run's "preemptions" and, under speculation, its draft tokens
    ("drafts") and how many of them were accepted ("accepted"). An engine without
    batch-invariant kernels skips the test, or fails it with `must_be_invariant`."""
    engine = build_engine(args)
    if must_be_invariant:
        assert not engine.local_core.runner.model.batch_variant_parts()
    _invariant_or_skip(engine)
    order = sorted(range(len(requests)), key=lambda i: requests[i][2])
    done: dict[str, list[Completion]] = {}
    step = 0
    while order or engine.has_unfinished_requests():
        while order and requests[order[0]][2] <= step:
            i = order.pop(0)
            engine.add_request(str(i), requests[i][0], requests[i][1])
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = _completions(out)
        step += 1
    engine.check_integrity()
    if counts is not None:
        counts["preemptions"] = engine.local_core.scheduler.num_preemptions
        if (spec := engine.local_core.speculation) is not None:
            counts["drafts"], counts["accepted"] = spec.stats.num_drafts, spec.stats.num_accepted
    engine.close()
    return [done[str(i)] for i in range(len(requests))]


class Alone:
    """Requests run one at a time on an engine without prefix caching or speculation, and
    keeping every block of sliding-window layers (one block table for all layers), one
    engine per configuration (model, dtype, weights, KV storage), results kept."""

    def __init__(self) -> None:
        self.engines: dict[tuple, LLMEngine] = {}
        self.results: dict[tuple, list[Completion]] = {}

    def __call__(self, args: EngineArgs, prompt: list[int], params: SamplingParams
                 ) -> list[Completion]:
        config = (args.model, args.dtype, args.quantization, args.kv_cache_dtype)
        key = (config, tuple(prompt), repr(params))
        if key not in self.results:
            if config not in self.engines:
                self.engines[config] = build_engine(EngineArgs(
                    model=args.model, dtype=args.dtype, quantization=args.quantization,
                    kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False,
                    disable_hybrid_kv_cache_manager=True, kv_cache_memory="64MiB"))
            engine = self.engines[config]
            engine.add_request("alone", prompt, params)
            outs: list = []
            while not outs:
                outs = [o for o in engine.step() if o.finished]
            self.results[key] = _completions(outs[0])
        return self.results[key]


@pytest.fixture(scope="module")
def alone() -> Alone:
    return Alone()


def params_strategy(max_tokens: int) -> st.SearchStrategy[SamplingParams]:
    logprobs = st.sampled_from([None, 1, 1, 1])
    greedy = st.builds(SamplingParams, temperature=st.just(0.0), logprobs=logprobs,
                       max_tokens=st.integers(1, max_tokens), ignore_eos=st.just(True))
    seeded = st.builds(SamplingParams, temperature=st.sampled_from([0.7, 1.0, 1.3]),
                       top_p=st.sampled_from([1.0, 0.9]), top_k=st.sampled_from([0, 20]),
                       seed=st.integers(0, 2**31), n=st.sampled_from([1, 1, 2]),
                       logprobs=logprobs, max_tokens=st.integers(1, max_tokens),
                       ignore_eos=st.just(True))
    return st.one_of(greedy, seeded)


@st.composite
def workloads(draw, vocab: int, max_prompt: int, max_tokens: int, max_requests: int):
    """Prompts built from a few shared prefixes (so that they hit the prefix cache) and
    their own tails; each with params and an arrival step."""
    prefixes = draw(st.lists(st.lists(st.integers(2, vocab - 1), min_size=0,
                                      max_size=max_prompt), min_size=1, max_size=3))
    n = draw(st.integers(2, max_requests))
    requests = []
    for _ in range(n):
        prefix = draw(st.sampled_from(prefixes))
        tail = draw(st.lists(st.integers(2, vocab - 1), min_size=1, max_size=12))
        requests.append((prefix + tail, draw(params_strategy(max_tokens)),
                         draw(st.integers(0, 6))))
    return requests


def engine_strategy(model: str, draft_model: str, spec: bool = True
                    ) -> st.SearchStrategy[dict]:
    speculation = st.sampled_from([None, "ngram", "draft_model"] if spec else [None])
    return st.fixed_dictionaries({
        "max_num_batched_tokens": st.sampled_from([8, 16, 32, 512]),
        "block_size": st.sampled_from([4, 16]),
        "num_kv_blocks": st.sampled_from([12, 24, 256]),
        "enable_prefix_caching": st.booleans(),
        "short_prompt_steps": st.booleans(),
        "tier": st.sampled_from([None, "host", "disk"]),
        "speculation": speculation,
    }).map(lambda d: {**d, "model": model, "draft_model": draft_model})


def engine_args(cfg: dict, dtype: str, tmp_path, quantization: str = "auto",
                kv_cache_dtype: str = "auto", tier_bytes: str = "16KiB") -> EngineArgs:
    """`tier_bytes`: the host and disk tiers' size, a few blocks of the model."""
    spec = None
    if cfg["speculation"] == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    elif cfg["speculation"] == "draft_model":
        spec = {"method": "draft_model", "model": cfg["draft_model"],
                "num_speculative_tokens": 2, "quantization": "none", "adaptive_depth": False,
                "max_batch_size": 64}
    # The pool must hold one request at a time (prompt + output, in blocks).
    blocks = max(cfg["num_kv_blocks"], -(-200 // cfg["block_size"]))
    tier = cfg["tier"] if cfg["enable_prefix_caching"] else None
    return EngineArgs(
        model=cfg["model"], dtype=dtype, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype, block_size=cfg["block_size"], num_kv_blocks=blocks,
        max_num_batched_tokens=cfg["max_num_batched_tokens"], max_num_seqs=8,
        enable_prefix_caching=cfg["enable_prefix_caching"],
        short_prompt_steps=cfg["short_prompt_steps"],
        host_kv_cache_memory=tier_bytes if tier == "host" else 0,
        kv_cache_dir=str(tmp_path / "kv") if tier == "disk" else None,
        kv_cache_disk_size=tier_bytes,
        speculative_config=json.dumps(spec) if spec else None)


def _check(args: EngineArgs, requests, alone: Alone) -> None:
    got = run_workload(args, requests)
    for (prompt, params, _), out in zip(requests, got, strict=True):
        assert out == alone(args, prompt, params), (prompt, params)


def _property(model: str, dtype: str, kvs: list[str], tmp_path_factory, alone) -> None:
    @settings(max_examples=20, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cfg=engine_strategy(model, model),
           requests=workloads(vocab=320, max_prompt=40, max_tokens=14, max_requests=7),
           kv=st.sampled_from(kvs))
    def check(cfg, requests, kv):
        _check(engine_args(cfg, dtype, tmp_path_factory.mktemp("kv"), kv_cache_dtype=kv),
               requests, alone)

    check()


@pytest.mark.parametrize("dtype,arch", [("float32", "llama"), ("bfloat16", "qwen2"),
                                        ("bfloat16", "qwen3"), ("bfloat16", "mistral"),
                                        ("float32", "gemma3"), ("bfloat16", "phi3"),
                                        ("float32", "llama_bf16")])
def test_tiny_model_requests_are_independent_of_their_batch(request, tmp_path_factory, alone,
                                                            dtype, arch):
    """mistral and gemma3: sliding windows of 8 tokens, far shorter than the prompts;
    llama_bf16: a bf16 checkpoint in float32 (16-bit weights on AVX2's dense kernel). K/V
    stored as --kv-cache-dtype auto picks (the compute dtype, or float16 under float32 on
    AVX2) and int8."""
    model = str(request.getfixturevalue(f"tiny_{arch}_dir"))
    _property(model, dtype, ["auto", "int8"], tmp_path_factory, alone)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "llama_bf16"])
def test_a_16_bit_cache_under_float32_keeps_requests_independent(request, tmp_path_factory,
                                                                 alone, kernel_build, arch):
    """K/V stored as float16 or bf16 under float32 activations, which AVX2's kernel reads:
    run on the avx2 build where the served one lacks it (an AVX-512 CPU), so the draws never
    hit a path this build does not have."""
    from kvserve.attention.torch_paged import TorchPagedAttention

    kernel_build(lambda: all(TorchPagedAttention(4, 2, 64, kv).ops_for(
        torch.float32, torch.device("cpu")) is not None for kv in ("float16", "bfloat16")),
        "paged_attention for a 16-bit cache under float32 (AVX2)")
    model = str(request.getfixturevalue(f"tiny_{arch}_dir"))
    _property(model, "float32", ["float16", "bfloat16"], tmp_path_factory, alone)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_sliding_window_hits_loaded_from_a_tier(tiny_gemma3_dir, tmp_path, alone, tier):
    """A case the property test above found: prompts of one repeated token share their
    first block; its window-layer copy is evicted to a tier while its whole-context copy
    stays in the pool, and a request hitting both loads one and adds new blocks to the
    other in the same allocation (see test_kv_tiers)."""
    model = str(tiny_gemma3_dir)
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    requests = [([2] * 29, greedy(3), 6), ([2] * 26, greedy(7), 0), ([2] * 26, greedy(8), 4),
                ([2] * 26, greedy(9), 3), ([2] * 20, greedy(7), 0), ([2] * 2, greedy(5), 3),
                ([2] * 45, greedy(5), 3)]
    cfg = {"model": model, "draft_model": model, "max_num_batched_tokens": 16,
           "block_size": 16, "num_kv_blocks": 12, "enable_prefix_caching": True,
           "short_prompt_steps": True, "tier": tier, "speculation": None}
    _check(engine_args(cfg, "float32", tmp_path), requests, alone)


@pytest.mark.real_model
@pytest.mark.parametrize("dtype,quantization", [("auto", "auto"), ("float32", "auto"),
                                                ("auto", "gguf")])
def test_default_model_requests_are_independent_of_their_batch(real_model_path,
                                                               tmp_path_factory, alone, dtype,
                                                               quantization):
    """The default configuration (bf16 with int4 weights on this CPU), float32, and the GGUF's
    blocks read in place (gguf_linear)."""
    model = str(real_model_path)

    @settings(max_examples=4 if (dtype, quantization) == ("auto", "auto") else 2,
              deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cfg=engine_strategy(model, model, spec=False).map(
               lambda d: {**d, "speculation": "ngram"}),
           requests=workloads(vocab=49152, max_prompt=48, max_tokens=8, max_requests=6))
    def check(cfg, requests):
        # the default model's blocks are 180 KiB (16 tokens, float32) or 90 KiB (bf16)
        _check(engine_args(cfg, dtype, tmp_path_factory.mktemp("kv"), quantization,
                           tier_bytes="4MiB"), requests, alone)

    check()


def test_seeded_sampling_is_independent_of_speculation_and_preemption(tiny_llama_dir, alone,
                                                                      tmp_path):
    """A fixed workload where every mechanism is on at once: seeded and greedy requests,
    n = 2, a draft model, a pool that forces preemption, 8-token steps."""
    model = str(tiny_llama_dir)
    prompts = [[5, 6, 7, 8] * 6 + [i + 10] for i in range(6)]
    params = [SamplingParams(temperature=0.9, seed=i, n=1 + i % 2, max_tokens=12,
                             ignore_eos=True, logprobs=1) if i % 3 else
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
              for i in range(6)]
    cfg = {"model": model, "draft_model": model, "max_num_batched_tokens": 8,
           "block_size": 4, "num_kv_blocks": 20, "enable_prefix_caching": True,
           "short_prompt_steps": True, "tier": "host", "speculation": "draft_model"}
    args = engine_args(cfg, "float32", tmp_path)
    engine = build_engine(args)
    _invariant_or_skip(engine)
    requests = [(p, sp, i % 3) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    _check(args, requests, alone)


def test_forward_rows_do_not_depend_on_the_batch(tiny_llama_dir):
    """One level down: the model's final hidden state for a token is bit for bit the same
    when its request runs alone and when eleven others share the step."""
    from kvserve.attention.torch_paged import TorchPagedAttention
    from kvserve.models.loader import load_model
    from kvserve.worker.forward import ForwardItem
    from kvserve.worker.model_runner import allocate_kv_caches, run_forward

    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(tiny_llama_dir, dtype, torch.device("cpu"),
                           lambda c: TorchPagedAttention(c.num_heads, c.num_kv_heads,
                                                         c.head_dim)).model
        model.pack_("none")
        if model.batch_variant_parts():
            pytest.skip("no batch-invariant kernels here")
        g = torch.Generator().manual_seed(3)
        items = [ForwardItem(torch.randint(2, 300, (3 + 5 * i,), generator=g).tolist(), 0,
                             list(range(16 * i, 16 * i + 16)), 1) for i in range(12)]
        caches = allocate_kv_caches(model, 16 * 12 * 4, dtype, torch.device("cpu"))
        together = run_forward(model, caches, 4, items, torch.device("cpu"))
        for i, it in enumerate(items):
            caches = allocate_kv_caches(model, 16 * 12 * 4, dtype, torch.device("cpu"))
            alone = run_forward(model, caches, 4, [it], torch.device("cpu"))
            assert torch.equal(alone[0], together[i])


def test_a_configuration_that_is_not_invariant_says_so(tiny_llama_dir, monkeypatch, caplog):
    """Without the C++ kernels torch's ops run: the start-up log says so, in one line."""
    import logging

    from kvserve import kernels

    monkeypatch.setenv("KVSERVE_NO_CPP", "1")
    kernels.ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvserve.engine.llm_engine"):
            engine = build_engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                                          num_kv_blocks=16, block_size=4))
    finally:
        monkeypatch.delenv("KVSERVE_NO_CPP")
        kernels.ops.cache_clear()
    lines = [r.getMessage() for r in caplog.records if "not batch-invariant" in r.getMessage()]
    assert len(lines) == 1
    assert "attention on torch's ops" in lines[0] and "F.linear" in lines[0]
    assert engine.local_core.runner.model.batch_variant_parts()
    invariant = build_engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                                     num_kv_blocks=16, block_size=4))
    if kernels.attention_kernels(torch.float32, "cpu", 16) is not None:
        assert invariant.local_core.runner.model.batch_variant_parts() == []
