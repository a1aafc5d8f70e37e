"""Speculative decoding: greedy outputs identical with every drafter (alone, in mixed batches,
under chunking and preemption), exact rejection sampling (chi-square against the target on a
toy vocabulary), rollback of KV blocks, stop rules, the adaptive policy, and config errors."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SpecConfig
from kvserve.kv_cache.hashing import ROOT_HASH, BlockKey, hash_block
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sample.rejection_sampler import verify
from kvserve.sample.sampler import Sampler
from kvserve.sample.sampling_params import SamplingParams
from kvserve.spec_decode import draft_quantization
from kvserve.spec_decode.base import Drafter
from kvserve.spec_decode.mtp import MTPModule, save_mtp
from kvserve.spec_decode.ngram import NgramDrafter
from tests.conftest import make_llm

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, so prompt lookup finds matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(2, 300) for _ in range(rng.randrange(3, 12))]
        out.append(phrase * rng.randrange(2, 5) + [rng.randrange(2, 300)])
    return out


@pytest.fixture(scope="module")
def other_tiny_dir(tmp_path_factory):
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-other"), "llama", seed=1)


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    """An untrained MTP module for the tiny model: its drafts are mostly wrong, which is
    what a verification test wants."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mtp") / "mtp.safetensors"
    save_mtp(MTPModule(64, 128, 1e-5), path, {})
    return path


def spec_configs(tiny, other, mtp) -> dict[str, dict]:
    # Each request drafts as far as allowed, not as far as its measured costs say pays, in
    # batches of any size: these tests are about what verification does with drafts.
    return {name: {**cfg, "adaptive_depth": False, "max_batch_size": 64} for name, cfg in {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "draft-same": {"method": "draft_model", "model": str(tiny), "quantization": "none",
                       "num_speculative_tokens": 4},
        "draft-int8": {"method": "draft_model", "model": str(tiny), "quantization": "int8"},
        "draft-other": {"method": "draft_model", "model": str(other), "quantization": "none"},
        # Drafts from the first 200 of the 320 ids only: the rest never drafted.
        "draft-vocab": {"method": "draft_model", "model": str(tiny), "quantization": "int8",
                        "draft_vocab_size": 200},
        "mtp": {"method": "mtp", "model": str(mtp), "num_speculative_tokens": 2},
    }.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ngram", "draft-same", "draft-int8", "draft-other",
                                  "draft-vocab", "mtp"])
def test_greedy_outputs_identical_with_speculation(tiny_llama_dir, other_tiny_dir, random_mtp,
                                                   name):
    cfg = spec_configs(tiny_llama_dir, other_tiny_dir, random_mtp)[name]
    prompts = repetitive_prompts(12)
    base = make_llm(tiny_llama_dir)
    alone = [base.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    # Mixed batch, small budget (chunked prompts next to verifying decodes) and a pool too
    # small for all requests (preemption, with drafts in flight).
    llm = make_llm(tiny_llama_dir, num_kv_blocks=70, max_num_batched_tokens=24,
                   speculative_config=cfg)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    stats = llm.engine.local_core.speculation.stats
    assert stats.num_drafts > 0
    if name == "draft-same":
        assert stats.num_accepted == stats.num_drafts  # the target drafting for itself
    llm.engine.check_integrity()
    assert llm.engine.local_core.kv.num_free_blocks == llm.engine.local_core.kv.num_blocks
    # alone, one request at a time, too
    single = make_llm(tiny_llama_dir, speculative_config=cfg)
    assert single.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids == alone[0]


def test_stop_rules_and_logprobs_with_speculation(tiny_llama_dir):
    cfg = {"method": "draft_model", "model": str(tiny_llama_dir), "quantization": "none",
           "num_speculative_tokens": 5, "adaptive_depth": False, "max_batch_size": 64}
    base = make_llm(tiny_llama_dir)
    spec = make_llm(tiny_llama_dir, speculative_config=cfg)
    prompt = repetitive_prompts(1, seed=3)[0]
    full = base.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                  ignore_eos=True))[0].outputs[0]
    stop = full.text[10:13]
    for params in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                  stop_token_ids=[full.token_ids[9]])):
        want = base.generate([prompt], params)[0].outputs[0]
        got = spec.generate([prompt], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason)
        if params.logprobs:
            assert len(got.logprobs) == len(got.token_ids)
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                assert a.token_id == b.token_id
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert spec.engine.local_core.speculation.stats.num_accepted > 0
    spec.engine.check_integrity()
    # The draft model times its decode-like steps for the depth rule: one request here, so
    # at most 4 tokens a step; the prompt's catch-up (7 tokens or more) is left out.
    steps = spec.engine.local_core.speculation.draft_steps
    assert steps and all(1 <= tokens <= 4 and seconds > 0 for tokens, seconds in steps)
    assert len(prompt) > 4


@pytest.mark.parametrize("vocab", [0, 200])
def test_sampled_requests_with_speculation_stay_consistent(tiny_llama_dir, vocab):
    """(With `vocab`, the drafts' distributions are 0 past the first 200 ids.)"""
    cfg = {"method": "draft_model", "model": str(tiny_llama_dir), "quantization": "int8",
           "draft_vocab_size": vocab, "adaptive_depth": False, "max_batch_size": 64}
    llm = make_llm(tiny_llama_dir, num_kv_blocks=80, speculative_config=cfg)
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=i,
                             ignore_eos=True, n=2 if i % 3 == 0 else 1) for i in range(8)]
    outs = llm.generate(repetitive_prompts(8, seed=4), params)
    for o, p in zip(outs, params, strict=True):
        assert len(o.outputs) == p.n
        assert all(len(c.token_ids) == 20 for c in o.outputs)
    assert llm.engine.local_core.speculation.stats.num_drafts > 0
    llm.engine.check_integrity()
    assert llm.engine.local_core.kv.num_free_blocks == llm.engine.local_core.kv.num_blocks
    # Seeded: the tokens are those of decoding without speculation (verification matches
    # drafts against the token the target samples with the request's own uniform numbers).
    plain = make_llm(tiny_llama_dir, num_kv_blocks=80)
    outs2 = plain.generate(repetitive_prompts(8, seed=4), params)
    assert [[c.token_ids for c in o.outputs] for o in outs2] == \
        [[c.token_ids for c in o.outputs] for o in outs]


# ----------------------------------------------------------------------- rejection sampling


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (cells with
    expected count >= 5; the rest pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))


def _toy_requests(n: int, k: int, q: torch.Tensor | None, fixed: list[int] | None,
                  gen: torch.Generator, seeded: bool = False) -> list[Request]:
    reqs = []
    for i in range(n):
        params = SamplingParams(temperature=1.0, max_tokens=100, seed=i if seeded else None)
        r = Request(str(i), [0], params, frozenset(), 100)
        if q is None:
            r.draft_token_ids = list(fixed or [])
        else:
            r.draft_token_ids = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
            r.draft_probs = q
        reqs.append(r)
    return reqs


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("draft", ["bad-q", "one-hot"])
def test_rejection_sampling_preserves_target_distribution(draft, seeded):
    """Unseeded rows: rejection sampling; seeded rows (one seed each): matching against the
    token the target samples. Either way the emitted tokens follow the target's p."""
    torch.manual_seed(0)
    vocab, k, n = 8, 2, 20000
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(k + 1, vocab, generator=gen) * 1.5  # p_0, p_1, p_2 differ
    p = target.softmax(-1)
    if draft == "bad-q":
        # a deliberately bad draft: most mass where the target has little
        q = (-2.0 * target).softmax(-1)[:k]
        reqs = _toy_requests(n, k, q, None, gen, seeded)
    else:  # n-gram style: fixed tokens, no distribution
        reqs = _toy_requests(n, k, None, [int(p[0].argmin()), int(p[1].argmax())], gen,
                             seeded)
    logits = target.repeat(n, 1)
    out = verify(Sampler(), logits, reqs, torch.device("cpu"))
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) > 1])
    assert all(1 <= len(t) <= k + 1 for t in out.token_ids)
    assert second.numel() > 500
    for tokens, probs in ((first, p[0]), (second, p[1])):
        counts = torch.bincount(tokens, minlength=vocab).float()
        assert chi_square_p(counts, probs) > 1e-3
    # The test has power: the draft's own tokens are far from the target distribution.
    drafted = torch.tensor([r.draft_token_ids[0] for r in reqs])
    if draft == "bad-q":
        assert chi_square_p(torch.bincount(drafted, minlength=vocab).float(), p[0]) < 1e-6


def test_greedy_verification_accepts_the_matching_prefix():
    vocab = 10
    logits = torch.full((4, vocab), -5.0)
    for row, tok in enumerate([3, 7, 2, 9]):
        logits[row, tok] = 5.0
    params = SamplingParams(temperature=0)
    r1 = Request("a", [1], params, frozenset(), 10)
    r1.draft_token_ids = [3, 7, 4]  # two match, third does not
    r2 = Request("b", [1], params, frozenset(), 10)
    r2.draft_token_ids = [3, 7, 2]  # all match: the bonus token comes too
    out = verify(Sampler(), torch.cat([logits, logits]), [r1, r2], torch.device("cpu"))
    assert out.token_ids == [[3, 7, 2], [3, 7, 2, 9]]


# ------------------------------------------------------------------------ rollback, policy


def test_rollback_returns_blocks_held_only_for_drafts():
    from kvserve.config import SchedulerConfig
    from kvserve.sched.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    req = Request("r", list(range(2, 9)), SamplingParams(temperature=0), frozenset(), 20)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_after_step(out)
    req.append_token(50)  # 8 tokens, 7 computed: 2 blocks
    assert len(req.block_ids) == 2
    req.draft_token_ids = [51, 52, 53, 54, 55]
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 6 and out.scheduled[0].num_drafts == 5
    assert len(req.block_ids) == 4  # positions up to 12
    free_before = kv.num_free_blocks
    sched.update_after_step(out)
    req.append_token(51)  # one draft accepted, then the target's own token
    req.append_token(60)
    sched.rollback(req)
    assert req.num_computed_tokens == req.num_tokens - 1 == 9
    assert req.draft_token_ids == []
    assert len(req.block_ids) == 3 and kv.num_free_blocks == free_before + 1
    kv.check_integrity()
    # rejected drafts were never hashed: the cache knows exactly the two verified blocks
    assert len(kv.pool.cached) == 2


class _NoisyOracle(Drafter):
    """Knows each prompt's greedy continuation: drafts a random number of its next tokens,
    then random ones, so verification accepts a random prefix every step."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], rng: random.Random) -> None:
        self.truth, self.rng = truth, rng

    def propose(self, requests, num_drafts) -> None:
        for r, k in zip(requests, num_drafts, strict=True):
            want = self.truth[tuple(r.prompt_token_ids)][r.num_output_tokens:]
            good = self.rng.randrange(k + 1)
            r.draft_token_ids = want[:good] + [self.rng.randrange(2, 300)
                                               for _ in range(k - min(good, len(want)))]


@pytest.fixture(scope="module")
def oracle_setup(tiny_llama_dir):
    prompts = repetitive_prompts(6, seed=11)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = make_llm(tiny_llama_dir).generate(prompts, params)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)}
    return prompts, params, truth


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), num_blocks=st.integers(24, 80),
       budget=st.sampled_from([8, 16, 64]), k=st.integers(1, 5))
def test_rollback_integrity_under_random_acceptance(tiny_llama_dir, oracle_setup, seed,
                                                    num_blocks, budget, k):
    """Random accept/reject lengths, with chunking and preemption: outputs stay the greedy
    ones, no block leaks, and every hashed block holds verified tokens under the right hash."""
    prompts, params, truth = oracle_setup
    llm = make_llm(tiny_llama_dir, num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
                   speculative_config={"method": "ngram", "num_speculative_tokens": k})
    llm.engine.local_core.speculation.drafter = _NoisyOracle(truth, random.Random(seed))
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [truth[tuple(p)] for p in prompts]
    llm.engine.check_integrity()
    kv = llm.engine.local_core.kv
    assert kv.num_free_blocks == kv.num_blocks
    valid = set()
    for p in prompts:
        seq, parent = p + truth[tuple(p)], ROOT_HASH
        for i in range(len(seq) // kv.block_size):
            tokens = tuple(seq[i * kv.block_size:(i + 1) * kv.block_size])
            h = hash_block(parent, tokens)
            valid.add(BlockKey(h, parent, tokens))
            parent = h
    assert all(b.key in valid for b in kv.pool.cached.values())
    assert llm.engine.local_core.speculation.stats.num_drafts > 0


def test_ngram_lookup():
    d = NgramDrafter(1, 3)
    r = Request("r", [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7], SamplingParams(), frozenset(),
                10)
    d.propose([r], [3])
    assert r.draft_token_ids == [1, 2, 5]  # after the most recent earlier "5 6 7"
    r2 = Request("s", [1, 2, 3, 4], SamplingParams(), frozenset(), 10)
    d.propose([r2], [3])
    assert r2.draft_token_ids == []  # no earlier occurrence of any suffix
    r2.append_token(2)
    d.propose([r2], [3])
    assert r2.draft_token_ids == [3, 4, 2]


class _WrongDrafter(Drafter):
    """Drafts tokens the target never picks, and records how many it was allowed."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def propose(self, requests, num_drafts) -> None:
        self.calls.append(list(num_drafts))
        for r, k in zip(requests, num_drafts, strict=True):
            r.draft_token_ids = [(r.all_token_ids[-1] * 7 + 11 + i) % 300 for i in range(k)]


def test_adaptive_policy(tiny_llama_dir):
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 3,
           "max_draft_tokens": 6, "min_acceptance": 0.5, "acceptance_window": 8,
           "probe_interval": 4}
    llm = make_llm(tiny_llama_dir, speculative_config=cfg)
    drafter = llm.engine.local_core.speculation.drafter = _WrongDrafter()
    base = make_llm(tiny_llama_dir)
    prompts = repetitive_prompts(4, seed=8)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    # Four requests > max_batch_size: no drafts until one finishes.
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.local_core.speculation.stats.num_steps_off > 0
    # With three running, at most max_draft_tokens drafts per step in all.
    assert all(sum(ks) <= 6 for ks in drafter.calls)
    # Alone, after all those rejections: the request starts from everyone's acceptance, so
    # it drafts nothing but a one-token probe every probe_interval steps.
    drafter.calls.clear()
    out = llm.generate([prompts[0]], GREEDY)[0]
    assert out.outputs[0].token_ids == want[0]
    ks = [c[0] for c in drafter.calls]
    assert ks and set(ks) == {1}
    assert len(ks) < GREEDY.max_tokens // 2  # most steps drafted nothing
    # On a fresh engine the first request drafts in full before its rejections stop it.
    fresh = make_llm(tiny_llama_dir, speculative_config=cfg)
    drafter = fresh.engine.local_core.speculation.drafter = _WrongDrafter()
    out = fresh.generate([prompts[0]], GREEDY)[0]
    ks = [c[0] for c in drafter.calls]
    assert ks[0] == 4 and ks[-1] == 1
    assert len(ks) < GREEDY.max_tokens // 2
    assert out.metrics.num_draft_tokens == sum(ks) and out.metrics.num_accepted_tokens == 0


def test_spec_config_errors():
    assert SpecConfig.parse(None) is None
    assert SpecConfig.parse('{"method": "ngram"}').num_speculative_tokens == 3
    for bad, msg in [('{"method": "eagle"}', "must be one of"),
                     ('{"method": "ngram", "k": 3}', "unknown speculative-config field"),
                     ("{not json", "not valid JSON"),
                     ('{"num_speculative_tokens": 2}', "needs \"method\""),
                     ('{"method": "mtp"}', "needs \"model\""),
                     ('{"method": "ngram", "num_speculative_tokens": 0}', "in [1, 16]"),
                     ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
                      "prompt_lookup_min"),
                     ('{"method": "draft_model", "quantization": "fp8"}', "auto, none"),
                     ('{"method": "draft_model", "draft_vocab_size": -1}', "draft_vocab_size"),
                     ('{"method": "ngram", "draft_vocab_size": 10}', "for method"),
                     ("[1, 2]", "JSON object")]:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[")):
            SpecConfig.parse(bad)


def test_draft_quantization_follows_the_device():
    """auto: int4 where the CPU kernels run the draft, none on a GPU; int4/int8 asked for on
    a GPU are refused by name (before any weight reaches a CPU kernel)."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert SpecConfig.parse('{"method": "draft_model"}').quantization == "auto"
    # A draft model drafts for one stream only, unless asked; the others up to 8 requests.
    assert SpecConfig.parse('{"method": "draft_model"}').max_batch_size == 1
    assert SpecConfig.parse('{"method": "ngram"}').max_batch_size == 8
    assert SpecConfig.parse('{"method": "draft_model", "max_batch_size": 4}').max_batch_size == 4
    assert draft_quantization("auto", cpu) == "int4"
    assert draft_quantization("auto", gpu) == "none"
    assert draft_quantization("none", gpu) == "none" and draft_quantization("int8", cpu) == "int8"
    for method in ("int4", "int8"):
        with pytest.raises(ValueError, match=f"quantization {method} runs on CPU kernels only"):
            draft_quantization(method, gpu)


def test_mtp_file_errors(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="not found"):
        make_llm(tiny_llama_dir, speculative_config={"method": "mtp",
                                                     "model": str(tmp_path / "none")})
    wrong = tmp_path / "wrong.safetensors"
    save_mtp(MTPModule(32, 64, 1e-5), wrong, {})
    with pytest.raises(ValueError, match="hidden size 32"):
        make_llm(tiny_llama_dir, speculative_config={"method": "mtp", "model": str(wrong)})


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_mtp_on_the_vnni_kernels_keeps_greedy_output(tiny_llama_dir, tmp_path, draft_vocab):
    """bf16 with int4 copies: the target and the MTP drafter (its head over a draft
    vocabulary or the whole one) run kvserve's int4/int8 VNNI kernel, whose rows do not
    depend on the batch, so one request's greedy output is the same with and without
    speculation."""
    from kvserve import kernels

    if kernels.quant_kernels(torch.bfloat16, "cpu", 16, 32) is None:
        pytest.skip("quant_linear needs a C++ compiler and AVX512-VNNI/BF16")
    torch.manual_seed(0)
    random_mtp = tmp_path / "mtp.safetensors"
    save_mtp(MTPModule(64, 128, 1e-5, torch.arange(0, 320, 2) if draft_vocab else None),
             random_mtp, {})
    kw = dict(dtype="bfloat16", quantization="int4")
    prompt = repetitive_prompts(1)[0]
    plain = make_llm(tiny_llama_dir, **kw).generate([prompt], GREEDY)[0].outputs[0].token_ids
    llm = make_llm(tiny_llama_dir, speculative_config={
        "method": "mtp", "model": str(random_mtp), "num_speculative_tokens": 2,
        "min_acceptance": 0.0}, **kw)
    drafter = llm.engine.local_core.speculation.drafter
    assert drafter.module.gate_up.packed is not None  # the module runs int8 on VNNI
    assert (drafter.head_q is not None) == draft_vocab
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == plain
    assert llm.engine.local_core.speculation.stats.num_drafts > 0


# ----------------------------------------------------------------------- adaptive depth


def expected_rate(p: list[float], depths: list[int], step: float, cost: float,
                  draft: float = 0.0) -> float:
    """Expected tokens per second of a step where request i drafts depths[i] tokens, each
    costing `cost`, in max(depths) draft steps of `draft` each."""
    tokens = sum(sum(pi ** j for j in range(k + 1)) for pi, k in zip(p, depths, strict=True))
    return tokens / (step + draft * max(depths) + cost * sum(depths))


@settings(max_examples=200, deadline=None)
@given(p=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), k=st.integers(1, 5),
       step=st.floats(0.005, 0.05), row=st.floats(0.0, 0.01), draft=st.floats(0.0, 0.02),
       draft_row=st.floats(0.0, 0.005), budget=st.integers(1, 12))
def test_choose_depths_takes_the_best_drafts_only(p, k, step, row, draft, draft_row, budget):
    """The depths choose_depths picks give the step the highest expected tokens per second
    of any choice that, for some depth L, takes the drafts of depth at most L in order of
    their acceptance probability (the best of every such prefix, no drafts included); none
    is taken that lowers it. A draft step is paid once per depth, whoever drafts."""
    from kvserve.spec_decode.coordinator import choose_depths

    limits = [k] * len(p)
    got = choose_depths(p, limits, step, row, draft, budget, draft_row)
    assert all(0 <= d <= k for d in got) and sum(got) <= budget
    cost = row + draft_row
    best = expected_rate(p, got, step, cost, draft)
    for depth in range(1, k + 1):
        offers = sorted(((p[i] ** j, i) for i in range(len(p)) for j in range(1, depth + 1)),
                        key=lambda o: -o[0])
        for n in range(min(len(offers), budget) + 1):
            depths = [0] * len(p)
            for _, i in offers[:n]:
                depths[i] += 1
            assert best >= expected_rate(p, depths, step, cost, draft) * (1 - 1e-9)


def test_choose_depths_drafts_only_for_more_than_its_margin():
    """min_gain: no drafts unless the best step beats the step without drafts by that
    fraction; above it, the same depths as without a margin."""
    from kvserve.spec_decode.coordinator import choose_depths

    # 8 streams of ~54 ms a step, 3.6 ms a verify row, a nearly free drafter, p = 0.57:
    # one draft each expects 12.6 tokens in 82.8 ms, 2.4% more tokens a second than 8 in 54
    args = ([0.57] * 8, [3] * 8, 0.054, 0.0036, 0.0, 12)
    assert choose_depths(*args) == [1] * 8
    assert choose_depths(*args, min_gain=0.02) == [1] * 8
    assert choose_depths(*args, min_gain=0.05) == [0] * 8
    # one stream whose text the drafter reads well gains far more than any margin
    assert choose_depths([0.95], [4], 0.022, 0.003, 0.008, 12, min_gain=0.1) == \
        choose_depths([0.95], [4], 0.022, 0.003, 0.008, 12) == [4]


def test_choose_depths_follows_acceptance_and_cost():
    from kvserve.spec_decode.coordinator import choose_depths

    # One stream of the 1.5B (~22 ms a step, 3 ms a verify row) with a 0.5B drafter (~8 ms
    # a token): a well-read text drafts deep, a poorly read one not at all.
    assert choose_depths([0.95], [4], 0.022, 0.003, 0.008, 12) == [4]
    assert choose_depths([0.8], [4], 0.022, 0.003, 0.008, 12) == [2]
    assert choose_depths([0.4], [4], 0.022, 0.003, 0.008, 12) == [0]
    # A drafter as slow as the target: never worth it, even at full acceptance.
    assert choose_depths([1.0], [4], 0.022, 0.003, 0.022, 12) == [0]
    # A free drafter (n-gram): only verify rows cost, so even a half-read text drafts 3.
    assert choose_depths([0.5], [4], 0.022, 0.001, 0.0, 12) == [3]
    # Eight streams share each draft step: each drafts one token (226 expected tokens a
    # second against 200 without, and 217 with a second draft step for four of them), where
    # a draft token charged a whole draft step would have given none.
    assert choose_depths([0.9] * 8, [4] * 8, 0.040, 0.002, 0.008, 12, 0.0004) == [1] * 8
    assert choose_depths([0.9] * 8, [4] * 8, 0.040, 0.002, 0.008 * 8, 12) == [0] * 8
    # A draft model that must first catch up on what was verified while it paused pays for
    # it with its first draft: 0.5 s of catch-up is not worth one step's drafts, 1 ms is; a
    # request whose first draft does not pay takes none, while another still drafts.
    assert choose_depths([0.9], [3], 0.022, 0.003, 0.008, 12, 0.0, [0.5]) == [0]
    assert choose_depths([0.9], [3], 0.022, 0.003, 0.008, 12, 0.0, [0.001]) == \
        choose_depths([0.9], [3], 0.022, 0.003, 0.008, 12) != [0]
    assert choose_depths([0.9, 0.9], [3, 3], 0.025, 0.003, 0.008, 12, 0.0, [0.5, 0.0])[0] == 0
    # Many rows already in the step and a poorly read text: drafts must beat the step's
    # tokens per second, and do not.
    assert choose_depths([0.5] * 8, [4] * 8, 0.040, 0.003, 0.008, 12, 0.0006) == [0] * 8


class _TimedDrafter(Drafter):
    """Drafts k copies of token 1 per request and records what it was asked for."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def propose(self, requests, num_drafts):
        self.asked.append(list(num_drafts))
        for r, k in zip(requests, num_drafts, strict=True):
            r.draft_token_ids = [1] * k


def test_the_coordinator_drafts_as_far_as_measured_costs_say(tiny_llama_dir):
    """SpecCoordinator with adaptive_depth: the first step drafts in full (no draft time is
    known yet); then a request's depth follows its acceptance under the step cost model,
    and one left without drafts probes with one token every probe_interval steps."""
    from kvserve.spec_decode.coordinator import SpecCoordinator

    llm = make_llm(tiny_llama_dir)
    core = llm.engine.local_core
    drafter = _TimedDrafter()
    cfg = SpecConfig(method="ngram", num_speculative_tokens=4, probe_interval=3,
                     adaptive_depth=True)
    coord = SpecCoordinator(cfg, drafter, core.kv, lambda rows: 0.020 + 0.003 * rows)
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=100), frozenset(), 100)
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens - 1
    coord.propose([req])
    assert drafter.asked == [[4]]
    coord.draft_steps.append((1, 0.008))  # as measured for a 0.5B drafting for a 1.5B
    for _ in range(40):
        coord.verified(req, 4, 4)  # read well: p near 1
    coord.propose([req])
    assert drafter.asked[-1] == [4]
    for _ in range(60):
        coord.verified(req, 4, 0)  # read badly: p near 0
    asked_before = len(drafter.asked)
    for _ in range(6):
        coord.propose([req])
    assert drafter.asked[asked_before:] == [[1], [1]]  # probes only, every 3rd step
    off = SpecCoordinator(SpecConfig(method="ngram", num_speculative_tokens=4,
                                     adaptive_depth=False, min_acceptance=0.0),
                          drafter, core.kv, lambda rows: 0.020 + 0.003 * rows)
    off.draft_steps.append((1, 0.008))
    for _ in range(60):
        off.verified(req, 4, 0)
    off.propose([req])
    assert drafter.asked[-1] == [4]  # without adaptive_depth: always in full


def test_the_step_cost_is_fitted_to_observed_decode_steps(tiny_llama_dir):
    from kvserve.spec_decode.coordinator import SpecCoordinator

    core = make_llm(tiny_llama_dir).engine.local_core
    coord = SpecCoordinator(SpecConfig(method="ngram", adaptive_depth=True), _TimedDrafter(),
                            core.kv)
    coord.observe_step(1, 0.020)
    assert coord.step_cost() is None  # one size of step: a row's cost is not known
    for rows, seconds in [(4, 0.029), (1, 0.020), (2, 0.023)]:
        coord.observe_step(rows, seconds)
    step, row = coord.step_cost()
    assert step == pytest.approx(0.017) and row == pytest.approx(0.003)


def _decoding(prefix: str, n: int) -> list[Request]:
    """n requests that decode in the next step."""
    reqs = []
    for i in range(n):
        r = Request(f"{prefix}{i}", [5, 6, 7], SamplingParams(max_tokens=100), frozenset(), 100)
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = r.num_tokens - 1
        reqs.append(r)
    return reqs


def test_the_draft_steps_cost_is_fitted_and_shared(tiny_llama_dir):
    """A draft step's cost is fitted to the draft steps timed so far, fixed and per request;
    while they are of one size a request is charged the share a row has of a one-row target
    step. Whole proposals timed by the coordinator count as their mean draft step."""
    from kvserve.spec_decode.coordinator import SpecCoordinator

    core = make_llm(tiny_llama_dir).engine.local_core
    drafter = _TimedDrafter()
    coord = SpecCoordinator(SpecConfig(method="ngram", adaptive_depth=True), drafter, core.kv)
    assert coord.draft_cost(0.1) is None
    coord.draft_steps.append((1, 0.011))
    fixed, per = coord.draft_cost(0.1)
    assert fixed == pytest.approx(0.010) and per == pytest.approx(0.001)
    coord.draft_steps.extend([(8, 0.018), (4, 0.014)])
    fixed, per = coord.draft_cost(0.1)
    assert fixed == pytest.approx(0.010) and per == pytest.approx(0.001)
    reqs = _decoding("r", 2)
    coord.draft_steps.clear()
    coord.propose(reqs)  # no cost known yet: both draft in full (3 each, 6 in 3 steps)
    assert drafter.asked == [[3, 3]]
    rows, seconds = coord.draft_steps[-1]
    assert rows == pytest.approx(2.0) and seconds > 0


def test_a_new_request_starts_from_everyones_acceptance(tiny_llama_dir):
    """A request never verified starts from all requests' recent acceptance, not from 1: on
    traffic the drafter reads badly a batch of newcomers does not draft in full."""
    from kvserve.spec_decode.coordinator import PRIOR_WEIGHT, SpecCoordinator

    core = make_llm(tiny_llama_dir).engine.local_core
    coord = SpecCoordinator(SpecConfig(method="ngram", adaptive_depth=True), _TimedDrafter(),
                            core.kv)
    first = Request("a", [5, 6, 7], SamplingParams(max_tokens=100), frozenset(), 100)
    assert coord._new_state().p == 1.0  # nothing verified yet
    for _ in range(50):
        coord.verified(first, 3, 0)  # every draft rejected
    newcomer = coord._new_state()
    assert newcomer.p < 0.05 and newcomer.hits + newcomer.misses == pytest.approx(PRIOR_WEIGHT)
    assert newcomer.acceptance < 0.05
    # with the costs of the 1.5B at 32 requests, newcomers at that acceptance draft nothing
    for rows, seconds in [(32, 0.114), (40, 0.138)]:
        coord.observe_step(rows, seconds)
    coord.draft_steps.append((1, 0.001))
    batch = _decoding("n", 32)
    depths, probe_every = coord._depths(batch, {r.request_id: coord._new_state()
                                                for r in batch})
    assert set(depths.values()) == {0}
    assert probe_every is None  # nor do they probe: a sure token would not pay for its row
    # Alone in a step a request still probes, whatever its acceptance.
    one = batch[:1]
    _, probe_every = coord._depths(one, {r.request_id: coord._new_state() for r in one})
    assert probe_every == SpecConfig(method="ngram").probe_interval
