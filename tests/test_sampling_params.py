from __future__ import annotations

import math

import pytest

from kvserve.sample.sampling_params import SamplingParams, SamplingType

NAN = float("nan")
INF = float("inf")

# (field, bad value) pairs; each must raise ValueError whose message names the field.
BAD_VALUES = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("temperature", -1.0),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", "1"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", NAN),
    ("top_k", -2),
    ("top_k", "3"),
    ("top_k", 2.0),
    ("top_k", False),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", NAN),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("presence_penalty", INF),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", -2.1),
    ("frequency_penalty", NAN),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", INF),
    ("logit_bias", {1: 101.0}),
    ("logit_bias", {1: -100.5}),
    ("logit_bias", {1: NAN}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"abc": 1.0}),
    ("logit_bias", {1.5: 1.0}),
    ("logit_bias", {True: 1.0}),
    ("logit_bias", {1: "x"}),
    ("logit_bias", {"5": 1.0, 5: 2.0}),
    ("logit_bias", [(1, 1.0)]),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", True),
    ("seed", 2**63),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 3),
    ("include_stop_str_in_output", 1),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", None),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.0),
    ("max_tokens", False),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
    ("logprobs", True),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_values_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_error_message_shows_bad_value() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1\.0"):
        SamplingParams(temperature=-1.0)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


def test_defaults_are_valid_and_normalised() -> None:
    p = SamplingParams()
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy
    assert not p.has_penalties


def test_int_values_accepted_for_float_fields() -> None:
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=-2, repetition_penalty=2)
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert isinstance(p.presence_penalty, float) and p.presence_penalty == -2.0
    assert p.has_penalties


def test_stop_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_logit_bias_string_keys_become_ints() -> None:
    p = SamplingParams(logit_bias={"5": 10, " 7 ": -100.0, 9: 0.5})
    assert p.logit_bias == {5: 10.0, 7: -100.0, 9: 0.5}
    assert all(type(k) is int for k in p.logit_bias)
    assert all(type(v) is float for v in p.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert not SamplingParams(top_k=0).top_k_enabled
    assert SamplingParams(top_k=1).top_k_enabled


def test_greedy_threshold_and_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(temperature=0.0, seed=3).sampling_type is SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_validate_vocab() -> None:
    SamplingParams(logit_bias={"9": 1.0}, stop_token_ids=[9]).validate_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).validate_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).validate_vocab(10)


def test_clone_is_independent() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={1: 1.0})
    c = p.clone()
    assert c == p
    c.stop.append("y")
    c.stop_token_ids.append(2)
    c.logit_bias[2] = 2.0
    assert p.stop == ["x"] and p.stop_token_ids == [1] and p.logit_bias == {1: 1.0}


def test_with_seed_validates() -> None:
    assert SamplingParams().with_seed(5).seed == 5
    assert SamplingParams(seed=5).with_seed(None).seed is None
    with pytest.raises(ValueError, match="seed"):
        SamplingParams().with_seed(2**70)


def test_child_seeds() -> None:
    p = SamplingParams(n=3, seed=10)
    children = [p.child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 for c in children)
    assert SamplingParams(n=2).child(1).seed is None
    top = SamplingParams(n=2, seed=2**63 - 1).child(1)
    assert top.seed == -(2**63)
    SamplingParams(seed=top.seed)  # still valid


def test_nan_message_is_readable() -> None:
    with pytest.raises(ValueError, match="top_p must be finite, got nan"):
        SamplingParams(top_p=math.nan)
