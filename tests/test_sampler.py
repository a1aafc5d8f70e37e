from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sample.metadata import SamplingMetadata, seeded_uniform
from kvserve.sample.sampler import (
    Sampler,
    SamplerOutput,
    apply_processors,
    apply_truncation,
)
from kvserve.sample.sampling_params import SamplingParams

CPU = torch.device("cpu")


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()


def row(prompt: Sequence[int] = (), output: Sequence[int] = (), eos=(), **kw) -> Row:
    return Row(SamplingParams(**kw), list(prompt), list(output), frozenset(eos))


def sample(logits: torch.Tensor, rows: Sequence[Row]) -> SamplerOutput:
    meta = SamplingMetadata.build(rows, logits.shape[-1], CPU)
    return Sampler()(logits, meta)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def processed(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    meta = SamplingMetadata.build(rows, logits.shape[-1], CPU)
    return apply_processors(logits.float().clone(), meta)


def truncated(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    meta = SamplingMetadata.build(rows, logits.shape[-1], CPU)
    return apply_truncation(apply_processors(logits.float().clone(), meta), meta)


# --- greedy -------------------------------------------------------------------------------


def test_greedy_is_argmax_fast_path() -> None:
    logits = randn(5, 11)
    rows = [row(temperature=0.0) for _ in range(5)]
    meta = SamplingMetadata.build(rows, 11, CPU)
    assert meta.all_greedy and not meta.needs_processing
    assert meta.temperature is None and meta.greedy_mask is None
    out = Sampler()(logits, meta)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_fast_and_slow_paths_agree() -> None:
    logits = randn(6, 17, seed=1)
    fast = sample(logits, [row(temperature=0.0) for _ in range(6)])
    # A zero bias changes nothing but forces the processing path.
    slow_rows = [row(temperature=0.0, logit_bias={0: 0.0}) for _ in range(6)]
    assert SamplingMetadata.build(slow_rows, 17, CPU).needs_processing
    assert sample(logits, slow_rows).token_ids == fast.token_ids
    # Greedy rows mixed with random rows go through the mixed path.
    mixed = [row(temperature=0.0) if i % 2 else row(temperature=1.0) for i in range(6)]
    out = sample(logits, mixed)
    assert out.token_ids[1::2] == fast.token_ids[1::2]


def test_input_logits_not_modified() -> None:
    logits = randn(3, 9)
    before = logits.clone()
    sample(
        logits, [row(logit_bias={1: 50.0}, repetition_penalty=2.0, prompt=[0, 1]) for _ in "abc"]
    )
    assert torch.equal(logits, before)


def test_low_precision_logits() -> None:
    logits = randn(4, 13).to(torch.bfloat16)
    out = sample(logits, [row(temperature=0.0, logprobs=2) for _ in range(4)])
    assert out.token_ids == logits.float().argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = randn(8, 33, seed=2)
    expected = logits.argmax(-1).tolist()
    assert sample(logits, [row(top_k=1) for _ in range(8)]).token_ids == expected
    assert sample(logits, [row(top_p=1e-9) for _ in range(8)]).token_ids == expected
    assert sample(logits, [row(top_p=1e-9, top_k=5) for _ in range(8)]).token_ids == expected
    assert sample(logits, [row(min_p=1.0) for _ in range(8)]).token_ids == expected


def test_shape_mismatch_rejected() -> None:
    meta = SamplingMetadata.build([row()], 10, CPU)
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.zeros(1, 11), meta)


# --- bias, min_tokens and penalties -------------------------------------------------------


def test_logit_bias_forces_and_bans() -> None:
    logits = randn(64, 20, seed=3)
    out = sample(logits, [row(logit_bias={"7": 100}) for _ in range(64)])
    assert out.token_ids == [7] * 64
    # Ban every row's favourite token with -100; it never comes up even at high temperature.
    favourite = logits.argmax(-1)
    rows = [row(temperature=2.0, logit_bias={int(t): -100.0}) for t in favourite]
    for _ in range(20):
        out = sample(logits, rows)
        assert all(tok != int(t) for tok, t in zip(out.token_ids, favourite, strict=True))


def test_logit_bias_is_additive_and_per_row() -> None:
    logits = randn(2, 6)
    got = processed(logits, [row(logit_bias={1: 2.5, 4: -1.0}), row()])
    expected = logits.clone()
    expected[0, 1] += 2.5
    expected[0, 4] -= 1.0
    torch.testing.assert_close(got, expected)


def test_logit_bias_out_of_vocab_rejected_at_build() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingMetadata.build([row(logit_bias={10: 1.0})], 10, CPU)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_and_stop_ids(temperature: float) -> None:
    v = 8
    logits = torch.zeros(1, v)
    logits[0, 2] = 20.0  # eos
    logits[0, 5] = 19.0  # stop token id
    logits[0, 6] = 15.0  # the clear winner once 2 and 5 are banned
    kw = dict(eos=[2], stop_token_ids=[5], min_tokens=3, temperature=temperature, seed=0)
    for n_out in range(3):
        r = row(output=[0] * n_out, **kw)
        assert sample(logits, [r]).token_ids == [6]
        assert processed(logits, [r])[0, [2, 5]].isneginf().all()
    assert sample(logits, [row(output=[0, 0, 0], **kw)]).token_ids[0] in {2, 5}
    # ignore_eos does not lift the min_tokens ban.
    r = row(output=[0], ignore_eos=True, **kw)
    assert sample(logits, [r]).token_ids == [6]


def reference_penalties(logits: torch.Tensor, r: Row) -> torch.Tensor:
    """Per-element reference written directly from the spec."""
    p = r.sampling_params
    out = logits.clone()
    seen = set(r.prompt_token_ids) | set(r.output_token_ids)
    for t in range(out.shape[0]):
        x = out[t].item()
        if t in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = r.output_token_ids.count(t)
        x -= p.frequency_penalty * count
        if count > 0:
            x -= p.presence_penalty
        out[t] = x
    return out


def test_penalties_match_reference() -> None:
    v = 12
    logits = randn(5, v, seed=4) * 3
    rows = [
        row(prompt=[0, 1, 1, 2], output=[3, 3, 3, 1], repetition_penalty=1.5),
        row(prompt=[4], output=[5, 5, 6], frequency_penalty=0.7),
        row(prompt=[4], output=[5, 5, 6], presence_penalty=-1.3),
        row(
            prompt=[0, 7, 9],
            output=[7, 7, 8, 11],
            repetition_penalty=0.6,
            frequency_penalty=-0.4,
            presence_penalty=1.1,
        ),
        row(prompt=[1, 2, 3], output=[1, 2]),  # no penalties: untouched
    ]
    got = processed(logits, rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], r))
    assert torch.equal(got[4], logits[4])


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, -1.0, -1.2]])
    assert sample(logits, [row(temperature=0.0, output=[0])]).token_ids == [0]
    assert sample(logits, [row(temperature=0.0, output=[0], repetition_penalty=2.0)]).token_ids == [
        1
    ]
    # Negative logits get multiplied, pushing them further down.
    got = processed(logits, [row(prompt=[2], repetition_penalty=2.0)])
    assert got[0, 2].item() == -2.0


# --- temperature and truncation -----------------------------------------------------------


def test_temperature_scaling() -> None:
    logits = randn(3, 7)
    rows = [row(temperature=0.5), row(temperature=2.0), row(temperature=0.0)]
    got = truncated(logits, rows)
    torch.testing.assert_close(got[0], logits[0] / 0.5)
    torch.testing.assert_close(got[1], logits[1] / 2.0)
    torch.testing.assert_close(got[2], logits[2])  # greedy row: neutral temperature


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    got = truncated(logits, [row(min_p=0.15)])  # threshold 0.075
    assert got[0].isfinite().tolist() == [True, True, True, False, False]
    # min_p compares probabilities after temperature: T=0.5 squares the ratios.
    got = truncated(logits, [row(min_p=0.15, temperature=0.5)])  # 0.04/0.25 < 0.15
    assert got[0].isfinite().tolist() == [True, True, False, False, False]
    for _ in range(10):
        tokens = sample(logits.expand(200, 5), [row(min_p=0.15)] * 200).token_ids
        assert set(tokens) <= {0, 1, 2}


def test_top_k_ties_at_boundary_are_kept() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    assert truncated(logits, [row(top_k=2)])[0].isfinite().tolist() == [
        False,
        True,
        True,
        True,
        False,
    ]


def test_top_k_only_rows_without_top_k_untouched() -> None:
    logits = randn(3, 10)
    got = truncated(logits, [row(top_k=3), row(), row(top_k=50)])
    assert got[0].isfinite().sum() == 3
    assert got[1].isfinite().all() and got[2].isfinite().all()


def nucleus_bounds(logits: list[float], top_k: int, top_p: float) -> tuple[set[int], set[int]]:
    """(tokens top-k/top-p must keep, tokens it may keep), lenient at rounding boundaries."""
    x = torch.tensor(logits, dtype=torch.float64)
    v = len(logits)
    if 0 < top_k < v:
        kth = x.sort(descending=True).values[top_k - 1]
        x = torch.where(x >= kth, x, -math.inf)  # ties with the k-th logit are kept
    probs = x.softmax(-1)
    must, may = set(), set()
    for t in range(v):
        if x[t] == -math.inf:
            continue
        # Tied tokens may be sorted either way round, so t has between `ahead_min` and
        # `ahead_max` probability mass ranked ahead of it.
        ahead_min = probs[x > x[t]].sum().item()
        ahead_max = probs[x >= x[t]].sum().item() - probs[t].item()
        if top_p >= 1.0 or ahead_max < top_p - 1e-4:
            must.add(t)
        if top_p >= 1.0 or ahead_min < top_p + 1e-4:
            may.add(t)
    return must, may


logit_lists = st.integers(2, 24).flatmap(
    lambda v: st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=v, max_size=v)
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    logits=logit_lists,
    top_k=st.integers(0, 30),
    top_p=st.floats(0.01, 1.0),
    temperature=st.floats(0.1, 3.0),
    seed=st.integers(0, 2**32),
)
def test_top_k_top_p_never_sample_outside_allowed_set(
    logits: list[float], top_k: int, top_p: float, temperature: float, seed: int
) -> None:
    v = len(logits)
    t = torch.tensor([logits])
    must, allowed = nucleus_bounds([x / temperature for x in logits], top_k, top_p)
    # Seeded, unseeded and greedy rows together, so all paths share one batch.
    rows = [row(top_k=top_k, top_p=top_p, temperature=temperature, seed=seed + i) for i in range(8)]
    rows += [row(top_k=top_k, top_p=top_p, temperature=temperature) for _ in range(8)]
    rows.append(row(temperature=0.0))
    out = sample(t.expand(len(rows), v), rows)
    assert set(out.token_ids[:-1]) <= allowed
    assert out.token_ids[-1] == int(t.argmax())
    kept = truncated(t, rows[:1])[0].isfinite()
    assert kept[int(t.argmax())]  # the top token always survives
    assert must <= {i for i in range(v) if kept[i]} <= allowed


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    mask = expected > 0
    assert counts[~mask].sum() == 0, "sampled a token with zero probability"
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


# With 7 categories (6 degrees of freedom) a chi-square above 30 has p < 5e-5; the seeds
# are fixed so the test is deterministic, the bound just documents how good the fit is.
CHI2_BOUND = 30.0


def test_empirical_frequencies_match_softmax() -> None:
    torch.manual_seed(1234)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3])
    temperature = 0.8
    n = 20_000
    out = sample(logits.expand(n, 7), [row(temperature=temperature)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=7).double()
    probs = (logits.double() / temperature).softmax(-1)
    assert chi_square(counts, probs) < CHI2_BOUND


def test_seeded_row_frequencies_match_softmax() -> None:
    """Over positions of one seed, and over seeds at one position, seeded draws follow the
    distribution (the hash behind seeded_uniform spreads both)."""
    logits = torch.tensor([0.2, -0.3, 1.1, 0.0, -2.0, 0.7, 0.4])
    probs = (logits.double() / 1.3).softmax(-1)
    rows = [row(temperature=1.3, seed=99, output=[0] * i) for i in range(3000)]
    by_position = sample(logits.expand(3000, 7), rows).token_ids
    rows = [row(temperature=1.3, seed=s, output=[0] * 5) for s in range(3000)]
    by_seed = sample(logits.expand(3000, 7), rows).token_ids
    for tokens in (by_position, by_seed):
        counts = torch.bincount(torch.tensor(tokens), minlength=7).double()
        assert chi_square(counts, probs) < CHI2_BOUND


def test_seeded_uniform_is_a_function_of_seed_and_position() -> None:
    u = [seeded_uniform(7, i) for i in range(1000)]
    assert u == [seeded_uniform(7, i) for i in range(1000)]
    assert all(0.0 <= x < 1.0 for x in u) and len(set(u)) > 990
    assert seeded_uniform(7, 3) != seeded_uniform(8, 3)
    assert seeded_uniform(-1, 0) == seeded_uniform(2**64 - 1, 0)  # seeds are taken mod 2**64


def test_top_p_frequencies_match_renormalised_nucleus() -> None:
    torch.manual_seed(7)
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0])
    logits = probs.log()
    n = 20_000
    out = sample(logits.expand(n, 7), [row(top_p=0.75)] * n)  # keeps 0.4 + 0.25 + 0.15
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=7).double()
    nucleus = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0, 0], dtype=torch.float64)
    assert chi_square(counts, nucleus / nucleus.sum()) < CHI2_BOUND


# --- seeded determinism -------------------------------------------------------------------


def run_seeded(seed: int, position: int, batch: int, steps: int = 40) -> list[int]:
    """Sample ``steps`` tokens for a seeded row placed at ``position`` in a noisy batch."""
    v = 50
    kw = dict(temperature=0.9, top_p=0.95, top_k=30, repetition_penalty=1.1)
    target = row(seed=seed, prompt=[1, 2, 3], **kw)
    noise = torch.Generator().manual_seed(1000 + batch + position)
    others = [
        row(temperature=1.0),
        row(temperature=0.0),
        row(seed=seed + 1, min_p=0.05),
        row(top_k=3, frequency_penalty=0.5, output=[1, 1]),
        row(logit_bias={4: 5.0}, logprobs=3),
    ]
    rows = [others[i % len(others)] for i in range(batch - 1)]
    rows.insert(position, target)
    tokens = []
    for step in range(steps):
        target_logits = randn(v, seed=step)
        logits = torch.randn(batch, v, generator=noise)
        logits[position] = target_logits
        tok = sample(logits, rows).token_ids[position]
        target.output_token_ids.append(tok)
        tokens.append(tok)
    return tokens


def test_seeded_row_independent_of_batch() -> None:
    alone = run_seeded(seed=5, position=0, batch=1)
    assert run_seeded(seed=5, position=0, batch=4) == alone
    assert run_seeded(seed=5, position=3, batch=4) == alone
    assert run_seeded(seed=5, position=6, batch=9) == alone
    assert run_seeded(seed=6, position=0, batch=1) != alone


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = randn(1, 100).expand(4, 100)
    rows = [row(seed=1), row(seed=1), row(seed=2), row(seed=3)]
    seqs: list[list[int]] = [[], [], [], []]
    for _ in range(20):
        for i, t in enumerate(sample(logits, rows).token_ids):
            seqs[i].append(t)
            rows[i].output_token_ids.append(t)
    assert seqs[0] == seqs[1]
    assert seqs[0] != seqs[2] and seqs[2] != seqs[3]


def test_child_seeds_differ() -> None:
    parent = SamplingParams(n=2, seed=11)
    rows = [Row(parent.child(i)) for i in range(2)]
    logits = randn(1, 100).expand(2, 100)
    seqs = [[], []]
    for _ in range(10):
        for i, t in enumerate(sample(logits, rows).token_ids):
            seqs[i].append(t)
            rows[i].output_token_ids.append(t)
    assert seqs[0] != seqs[1]


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_raw_with_rank_and_top() -> None:
    v = 16
    logits = randn(3, v, seed=8) * 2
    rows = [
        row(logprobs=5, temperature=0.7, logit_bias={3: 100.0}),
        row(logprobs=0, temperature=0.0, repetition_penalty=1.5, prompt=[0, 1]),
        row(),
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits.double(), -1)

    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == out.token_ids[0] == 3
    assert lp.logprob == pytest.approx(raw[0, 3].item(), abs=1e-5)  # bias not reflected
    assert lp.rank == 1 + int((raw[0] > raw[0, 3]).sum())
    assert len(lp.top) == 5
    ids = [t for t, _ in lp.top]
    assert ids == raw[0].argsort(descending=True)[:5].tolist()
    assert [x for _, x in lp.top] == sorted((x for _, x in lp.top), reverse=True)
    for t, x in lp.top:
        assert x == pytest.approx(raw[0, t].item(), abs=1e-5)
        assert isinstance(t, int) and isinstance(x, float)

    lp = out.logprobs[1]
    assert lp is not None and lp.top == [] and lp.token_id == out.token_ids[1]
    assert lp.logprob == pytest.approx(raw[1, lp.token_id].item(), abs=1e-5)
    assert out.logprobs[2] is None


def test_logprobs_with_no_top_lists_in_the_whole_batch() -> None:
    """Every row asks for the chosen token's logprob only (the API's `logprobs: true`
    without top_logprobs): no top lists are computed at all."""
    logits = randn(2, 12, seed=3)
    out = sample(logits, [row(logprobs=0, temperature=0.0), row(logprobs=0, temperature=0.9)])
    raw = torch.log_softmax(logits.double(), -1)
    for i, lp in enumerate(out.logprobs):
        assert lp is not None and lp.top == [] and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, lp.token_id]).sum())


def test_greedy_logprob_rank_is_one() -> None:
    logits = randn(4, 10)
    out = sample(logits, [row(temperature=0.0, logprobs=1) for _ in range(4)])
    for i, lp in enumerate(out.logprobs):
        assert lp is not None and lp.rank == 1
        assert lp.top == [(lp.token_id, lp.logprob)]
        assert lp.token_id == int(logits[i].argmax())


def test_logprobs_clamped_to_vocab() -> None:
    out = sample(randn(1, 4), [row(logprobs=20)])
    assert out.logprobs[0] is not None and len(out.logprobs[0].top) == 4


@pytest.mark.slow
@settings(max_examples=120, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0, float("-inf")]),
                     min_size=40, max_size=40),
            st.sampled_from([0.05, 0.3, 0.7, 0.95, 1.0]),
            st.sampled_from([40, 3, 10])),
        min_size=1, max_size=5),
    candidates=st.sampled_from([2, 5, 16]))
def test_top_p_candidate_search_equals_full_sort(rows, candidates):
    """The partial-topk path keeps exactly what the full stable sort keeps, ties included."""
    import kvserve.sample.sampler as sampler_mod

    logits = torch.tensor([r[0] for r in rows])
    logits[:, 0] = 5.0  # at least one finite logit per row
    top_p = torch.tensor([[r[1]] for r in rows])
    top_k = torch.tensor([r[2] for r in rows])
    max_top_k = int(top_k[top_k < 40].max()) if (top_k < 40).any() else 0
    k_arg = top_k if max_top_k else None
    expected = sampler_mod._top_k_top_p_sorted(logits.clone(), k_arg, top_p)
    saved, sampler_mod.TOP_P_CANDIDATES = sampler_mod.TOP_P_CANDIDATES, candidates
    try:
        got = sampler_mod._top_k_top_p(logits.clone(), k_arg, max_top_k, top_p)
    finally:
        sampler_mod.TOP_P_CANDIDATES = saved
    assert torch.equal(got.isinf(), expected.isinf())
    assert torch.equal(got[~got.isinf()], expected[~expected.isinf()])


# --- grammar masks --------------------------------------------------------------------------


def _reference_mask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
                    ) -> torch.Tensor:
    """Every forbidden token set to -inf, one at a time."""
    out = logits.clone()
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 100), batch=st.integers(1, 6), holes=st.integers(0, 400),
       seed=st.integers(0, 2**16), greedy=st.booleans())
def test_grammar_masks_sparse_or_dense_and_greedy_agree(vocab, batch, holes, seed, greedy):
    """apply_bitmask gives the token-by-token result whether it sets the few forbidden tokens
    (a lazy grammar before its call) or adds a bias to whole rows; greedy rows whose only
    processing is a mask take the argmax and remask only rows whose choice is forbidden:
    the same tokens as masking a float32 copy of every row."""
    from kvserve.sample.sampler import refused_on_device, refused_on_host
    from kvserve.sample.structured import apply_bitmask, new_bitmask

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen)
    logits[:, : vocab // 3] = logits[:, : vocab // 3].round()  # ties between tokens
    rows = sorted(torch.randperm(batch, generator=gen)[: max(1, batch // 2)].tolist())
    bitmask = new_bitmask(len(rows), vocab)
    for _ in range(holes):
        i = int(torch.randint(len(rows), (1,), generator=gen))
        t = int(torch.randint(vocab, (1,), generator=gen))
        bitmask[i, t // 32] &= ~(1 << (t % 32))
    for i in range(len(rows)):  # at least one token allowed a row
        if all(not (int(bitmask[i, t // 32]) >> (t % 32)) & 1 for t in range(vocab)):
            bitmask[i, 0] |= 1
    want = _reference_mask(logits, rows, bitmask)
    got = logits.clone()
    apply_bitmask(got, torch.tensor(rows), bitmask)
    assert torch.equal(got, want)
    sampled = [row(temperature=0.0 if greedy else 0.7, seed=seed) for _ in range(batch)]
    meta = SamplingMetadata.build(sampled, vocab, CPU, (rows, bitmask))
    # The host test of forbidden choices and the device one (GPUs') agree.
    argmax = logits.argmax(-1)
    host, device = refused_on_host(argmax, meta), refused_on_device(argmax, meta)
    assert (host is None and device is None) or torch.equal(host, device)
    out = Sampler()(logits, meta).token_ids
    if greedy:
        assert out == want.argmax(-1).tolist()
    for i, r in enumerate(rows):
        assert (int(bitmask[i, out[r] // 32]) >> (out[r] % 32)) & 1
