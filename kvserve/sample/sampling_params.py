"""Per-request sampling parameters, validated once at construction.

Every check lives in ``SamplingParams.__post_init__`` so that a request that reaches the
scheduler is known to be well formed; the only check left for later is
``validate_vocab``, because the vocabulary size is a property of the loaded model.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Temperatures below this are treated as greedy: dividing logits by ~0 would overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


# JSON is written as json.dumps writes it: ", " and ": ", no other whitespace. llguidance's
# own default allows any whitespace anywhere, and small models then fill max_tokens with
# newlines (measured here: 9 of 12 SmolLM2 outputs). A schema may still ask for more with its
# "x-guidance" options (e.g. {"whitespace_flexible": true}), which override these.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _check_int(name: str, value: Any) -> int:
    # bool is a subclass of int; `n=True` is almost certainly a client bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _token_id(name: str, value: Any) -> int:
    """Accept an int or (OpenAI JSON object keys are strings) a decimal string of one."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{name} token ids must be integers, got {value!r}") from None
    value = _check_int(f"{name} token id", value)
    if value < 0:
        raise ValueError(f"{name} token ids must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on what a request may generate (vLLM's structured outputs): exactly one
    of a JSON schema (as JSON text), any JSON object, a regular expression, a choice among
    strings, or a Lark grammar (as llguidance reads it). Enforced token by token with a mask
    (kvserve.sample.structured); checked against the tokenizer when the request is added."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # A reasoning model's end of thinking (e.g. "</think>"): the text up to and including it
    # is free, the constraint applies to what follows.
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                       else [])
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, "
                             f"choice and grammar, got {given or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string")
        if self.reasoning_end is not None and self.grammar is not None:
            raise ValueError("structured outputs: a grammar cannot follow reasoning (its start "
                             "rule is its own); use json, regex or choice")
        if self.choice is not None and (
                not isinstance(self.choice, tuple) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of "
                             "non-empty strings")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar")
                    if getattr(self, n) is not None) if not self.json_object else "json_object"


@dataclass(frozen=True)
class ThinkingBudget:
    """A cap on a reasoning model's thinking (vLLM's `thinking_token_budget`): once the
    output holds `tokens` tokens and `end` (the format's end of thinking, e.g. "</think>")
    has not appeared in its text, the next tokens are forced to be `end`'s own, and the
    model answers after it. Enforced with the structured outputs' mask
    (kvserve.sample.structured), so it depends only on the request's own tokens."""

    end: str
    tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.end, str) or not self.end:
            raise ValueError("a thinking budget needs the non-empty text that ends thinking")
        if _check_int("thinking_token_budget", self.tokens) < 0:
            raise ValueError(f"thinking_token_budget must be >= 0, got {self.tokens}")


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop it.

    Invariants after ``__post_init__``: numeric fields are plain ``int``/``float`` within their
    documented ranges, ``stop`` and ``stop_token_ids`` are lists (possibly empty),
    ``logit_bias`` is ``None`` or a ``dict[int, float]``, and ``top_k`` is 0 when disabled
    (``-1`` is accepted as an alias and normalised to 0).
    """

    n: int = 1
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 => disabled
    min_p: float = 0.0  # [0, 1]
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0, 1 = off
    logit_bias: dict[int, float] | None = None  # token id -> additive bias in [-100, 100]
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None => the engine fills up to the context limit
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs per sampled token; 0 => only the sampled one
    # top logprobs per prompt token (from the second; 0 => only the token's own). A request
    # asking for them computes its whole prompt: it reads no cached prefix.
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # An embedding request: instead of tokens, the prompt's final hidden states pooled
    # ("mean" over its positions, or the "last" one) and L2-normalised.
    pooling: str | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    thinking_budget: ThinkingBudget | None = None

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_outputs()

    def _check_sampling(self) -> None:
        """How tokens are picked: n, the sampling knobs, penalties, bias and seed."""
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")

        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        self.logit_bias = self._normalise_logit_bias(self.logit_bias)

        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
            if not _INT64_MIN <= self.seed <= _INT64_MAX:
                raise ValueError(f"seed must fit in a signed 64-bit int, got {self.seed}")

    def _check_outputs(self) -> None:
        """What comes out and when it stops: stops, lengths, logprobs, pooling, structure."""
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        self.include_stop_str_in_output = _check_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)

        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                 f"{self.prompt_logprobs}")

        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _check_int("truncate_prompt_tokens",
                                                     self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1:
                raise ValueError(f"truncate_prompt_tokens must be >= 1, got "
                                 f"{self.truncate_prompt_tokens}")

        if self.pooling is not None:
            if self.pooling not in ("mean", "last"):
                raise ValueError(f"pooling must be mean or last, got {self.pooling!r}")
            if self.n != 1 or self.prompt_logprobs is not None or self.structured_outputs:
                raise ValueError("an embedding request (pooling) takes no n, prompt_logprobs "
                                 "or structured outputs")

        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs")

        if self.thinking_budget is not None:
            if not isinstance(self.thinking_budget, ThinkingBudget):
                raise ValueError("thinking_budget must be a ThinkingBudget")
            if self.pooling is not None:
                raise ValueError("an embedding request (pooling) takes no thinking budget")
            rend = self.structured_outputs.reasoning_end if self.structured_outputs else None
            if rend is not None and rend != self.thinking_budget.end:
                raise ValueError("the thinking budget and the structured outputs must name "
                                 "the same end of thinking")

        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            token = _token_id("logit_bias", key)
            if token in out:
                # "5" and 5 both present: ambiguous, and silently picking one hides a bug.
                raise ValueError(f"logit_bias has duplicate token id {token}")
            value = _check_float(f"logit_bias[{token}]", value)
            if abs(value) > MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
            out[token] = value
        return out or None

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple):
            raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if not s:
                raise ValueError("stop must not contain empty strings, got ''")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of int, got {ids!r}")
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {t!r}")
            out.append(t)
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary (unknown at construction time)."""
        for token in self.logit_bias or ():
            if token >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {token} is out of range for vocab size {vocab_size}"
                )
        for token in self.stop_token_ids or ():
            if token >= vocab_size:
                raise ValueError(
                    f"stop_token_ids token id {token} is out of range for vocab size {vocab_size}"
                )

    def clone(self) -> SamplingParams:
        """Deep enough copy: the mutable containers (stop, stop_token_ids, logit_bias) are new."""
        return dataclasses.replace(
            self,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
        )

    def with_seed(self, seed: int | None) -> SamplingParams:
        new = self.clone()
        new.seed = seed
        new.__post_init__()
        return new

    def child(self, index: int) -> SamplingParams:
        """Params for child ``index`` of an ``n > 1`` request: ``n=1`` and seed ``seed + index``.

        Distinct seeds keep seeded siblings from producing identical completions. The seed wraps
        around within int64 so that a seed near the top of the range stays valid.
        """
        new = self.clone()
        new.n = 1
        if self.seed is not None:
            new.seed = (self.seed + index - _INT64_MIN) % 2**64 + _INT64_MIN
        return new
