"""A batch's sampling settings as tensors (SamplingMetadata), built once per step from each
row's SamplingParams, and the seeded uniforms that make a seeded row's draws its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.sample.sampling_params import SamplingParams

_MASK64 = 2**64 - 1


class SamplingRow(Protocol):
    """What the sampler needs to know about one request (the engine's Request satisfies it)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # a row samples output token len(output_token_ids)
    # Ids that end the request (model eos/eot); banned while len(output) < min_tokens.
    eos_token_ids: frozenset[int]


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that spreads every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) (24 bits, exact in float32) with which a request seeded
    with `seed` samples its output token `index`."""
    return (_mix64((_mix64(seed & _MASK64) + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64)
            >> 40) / 2**24


@dataclass
class Penalties:
    """Penalty inputs for the subset of rows that use any penalty (P of the B rows)."""

    rows: torch.Tensor  # [P] int64, indices into the batch
    repetition: torch.Tensor | None  # [P, 1] float32
    frequency: torch.Tensor | None  # [P, 1] float32
    presence: torch.Tensor | None  # [P, 1] float32
    seen_mask: torch.Tensor | None  # [P, V] bool, token in prompt or output
    output_counts: torch.Tensor | None  # [P, V] float32, occurrences in the output


@dataclass
class SamplingMetadata:
    """Per-step tensors for the rows being sampled, in batch order.

    Fields that no row needs are ``None`` so that the sampler skips the matching work;
    ``needs_processing`` is False when logits can be sampled without modification
    (no bias, no penalties, no min_tokens bans), which together with ``all_greedy``
    selects the plain-argmax fast path.
    """

    batch_size: int
    vocab_size: int
    all_greedy: bool
    needs_processing: bool
    greedy_mask: torch.Tensor | None  # [B] bool; None when all rows are greedy or all random
    temperature: torch.Tensor | None  # [B, 1] float32, 1.0 on greedy rows
    min_p: torch.Tensor | None  # [B, 1] float32
    top_k: torch.Tensor | None  # [B] int64, clamped to V; V on rows without top-k
    max_top_k: int  # largest top_k of any random row; 0 when none
    top_p: torch.Tensor | None  # [B, 1] float32
    # Sparse additions: (row, token) index pairs and the values to add.
    bias_index: tuple[torch.Tensor, torch.Tensor] | None
    bias_values: torch.Tensor | None
    ban_index: tuple[torch.Tensor, torch.Tensor] | None
    penalties: Penalties | None
    # Seeded random rows and their uniform numbers (seeded_uniform of the token they sample).
    seeded: list[tuple[int, float]]
    any_unseeded_random: bool
    # Logprobs: which rows asked, and how many top entries each wants (clamped to V).
    logprob_rows: list[int]
    num_logprobs: list[int]
    # Structured outputs: the constrained rows and their allowed-token bitmasks [R, V/32].
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str,
        allowed: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """Gather per-row settings into tensors on ``device``. ``allowed`` gives the
        constrained rows and their bitmasks (kvserve.sample.structured.fill_bitmasks).

        Cost: O(B) Python work plus O(bias entries + banned ids); rows with penalties also
        upload their prompt and output ids and materialise [P, V] tensors, so penalties cost
        O(P * V) memory and O(prompt + output) transfer per step for those rows only.
        """
        device = torch.device(device)
        params = [r.sampling_params for r in rows]
        greedy = [p.is_greedy for p in params]
        all_greedy, any_greedy = all(greedy), any(greedy)
        constrained = set(allowed[0]) if allowed is not None else set()
        bias, bans = _bias_and_bans(rows, vocab_size, constrained)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        penalties = _build_penalties(rows, vocab_size, device)
        knobs = _RandomKnobs.of(rows, greedy, vocab_size, device)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            batch_size=len(rows),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            needs_processing=bool(bias or bans or penalties is not None or constrained),
            greedy_mask=(torch.tensor(greedy, dtype=torch.bool, device=device)
                         if any_greedy and not all_greedy else None),
            temperature=knobs.temperature,
            min_p=knobs.min_p,
            top_k=knobs.top_k,
            max_top_k=knobs.max_top_k,
            top_p=knobs.top_p,
            bias_index=(ints([r for r, _, _ in bias]), ints([t for _, t, _ in bias]))
            if bias else None,
            bias_values=torch.tensor([v for _, _, v in bias], device=device) if bias else None,
            ban_index=(ints([r for r, _ in bans]), ints([t for _, t in bans])) if bans else None,
            penalties=penalties,
            seeded=knobs.seeded,
            any_unseeded_random=knobs.any_unseeded_random,
            logprob_rows=logprob_rows,
            num_logprobs=[min(params[i].logprobs or 0, vocab_size) for i in logprob_rows],
            grammar_rows=ints(allowed[0]) if constrained else None,
            grammar_bitmask=allowed[1] if constrained else None,
        )


def _bias_and_bans(rows: Sequence[SamplingRow], vocab_size: int, constrained: set[int]
                   ) -> tuple[list[tuple[int, int, float]], list[tuple[int, int]]]:
    """(row, token, value) of every logit bias, and (row, token) of every token banned
    until a row has its min_tokens: its EOS and stop tokens (not in grammar rows, whose
    grammar decides when they may end)."""
    bias: list[tuple[int, int, float]] = []
    bans: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        p = row.sampling_params
        for token, value in (p.logit_bias or {}).items():
            _check_token(token, vocab_size, "logit_bias")
            bias.append((i, token, value))
        if len(row.output_token_ids) < p.min_tokens and i not in constrained:
            for token in sorted(set(row.eos_token_ids).union(p.stop_token_ids or ())):
                _check_token(token, vocab_size, "min_tokens banned")
                bans.append((i, token))
    return bias, bans


@dataclass
class _RandomKnobs:
    """The settings only random rows use, as columns over the batch (greedy rows get
    neutral values), each None when no random row needs it."""

    temperature: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    seeded: list[tuple[int, float]] = field(default_factory=list)  # (row, its uniform)
    any_unseeded_random: bool = False

    @classmethod
    def of(cls, rows: Sequence[SamplingRow], greedy: list[bool], vocab_size: int,
           device: torch.device) -> _RandomKnobs:
        params = [r.sampling_params for r in rows]
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        knobs = cls()
        if not random_params:
            return knobs

        def column(name: str, neutral: float) -> torch.Tensor:
            values = [neutral if g else getattr(p, name)
                      for p, g in zip(params, greedy, strict=True)]
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        knobs.temperature = column("temperature", 1.0)
        if any(p.min_p > 0 for p in random_params):
            knobs.min_p = column("min_p", 0.0)
        if any(p.top_p < 1.0 for p in random_params):
            knobs.top_p = column("top_p", 1.0)
        # k = V means "no top-k" for that row; both truncation paths treat it as a no-op.
        ks = [vocab_size if g or not p.top_k_enabled else min(p.top_k, vocab_size)
              for p, g in zip(params, greedy, strict=True)]
        if any(k < vocab_size for k in ks):
            knobs.top_k = torch.tensor(ks, dtype=torch.int64, device=device)
            knobs.max_top_k = max(k for k in ks if k < vocab_size)
        for i, (row, p, g) in enumerate(zip(rows, params, greedy, strict=True)):
            if g:
                continue
            if p.seed is not None:
                knobs.seeded.append((i, seeded_uniform(p.seed, len(row.output_token_ids))))
            else:
                knobs.any_unseeded_random = True
        return knobs


def _check_token(token: int, vocab_size: int, what: str) -> None:
    # An out-of-range index would be a device-side assert on GPU; fail loudly on the host.
    if not 0 <= token < vocab_size:
        raise ValueError(f"{what} token id {token} is out of range for vocab size {vocab_size}")


def _build_penalties(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> Penalties | None:
    pen_rows = [i for i, r in enumerate(rows) if r.sampling_params.has_penalties]
    if not pen_rows:
        return None
    params = [rows[i].sampling_params for i in pen_rows]
    n = len(pen_rows)

    def flat_index(token_lists: list[list[int]]) -> torch.Tensor:
        # Row-major offsets into a flattened [n, V] tensor, so one scatter covers all rows.
        offsets = [j * vocab_size + t for j, ids in enumerate(token_lists) for t in ids]
        return torch.tensor(offsets, dtype=torch.int64, device=device)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    outputs = [rows[i].output_token_ids for i in pen_rows]
    repetition = frequency = presence = seen_mask = output_counts = None
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        idx = flat_index(outputs)
        output_counts = torch.zeros(n * vocab_size, dtype=torch.float32, device=device)
        output_counts.scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))
        output_counts = output_counts.view(n, vocab_size)
        frequency = column([p.frequency_penalty for p in params])
        presence = column([p.presence_penalty for p in params])
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [rows[i].prompt_token_ids for i in pen_rows]
        idx = flat_index([list(a) + list(b) for a, b in zip(prompts, outputs, strict=True)])
        seen_mask = torch.zeros(n * vocab_size, dtype=torch.bool, device=device)
        seen_mask[idx] = True
        seen_mask = seen_mask.view(n, vocab_size)
        repetition = column([p.repetition_penalty for p in params])
    return Penalties(
        rows=torch.tensor(pen_rows, dtype=torch.int64, device=device),
        repetition=repetition,
        frequency=frequency,
        presence=presence,
        seen_mask=seen_mask,
        output_counts=output_counts,
    )
