"""Batched token sampling: logits [B, V] -> one token (and optional logprobs) per row.

The engine builds a ``SamplingMetadata`` once per step from the rows being sampled and calls
``Sampler()(logits, meta)``. Everything runs on the logits' device; the only device->host
transfer is the final copy of the results.

Processing order for a row (the same for greedy and random rows up to the temperature step):

0. A constrained row (structured outputs) keeps only the tokens its grammar allows; the others
   are set to -inf (kvserve.sample.structured).
1. ``logit_bias`` is added.
2. While ``len(output) < min_tokens`` the row's ``eos_token_ids`` and ``stop_token_ids`` are set
   to -inf (regardless of ``ignore_eos``, which only affects the engine's stop check); not on
   constrained rows, whose grammar decides where they may end.
3. Repetition penalty on tokens seen in prompt or output (logit > 0 -> logit / p, else * p),
   then frequency (-f * count) and presence (-p * [count > 0]) penalties on output tokens.
4. Greedy rows take the argmax here. Random rows continue: divide by temperature, drop tokens
   with prob < min_p * max_prob, apply top-k then top-p (top-p renormalises over what top-k
   kept), and draw by inverse transform: one uniform number per row, located in the row's
   cumulative distribution. (An exponential race needs V random numbers per row; on the CPU
   drawing them cost ~44 ms for 64 x 49152 logits against ~1 ms for cumsum + searchsorted.)

A seeded row's uniform number for its output token i is a hash of (seed, i)
(`seeded_uniform`), not the next number of a stream: its tokens then depend only on its
seed and its own distributions, whatever its batch, however often it was preempted, and
however many numbers speculative decoding drew for it before (see kvserve.sample.rejection_sampler).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.outputs import TokenLogprobs
from kvserve.sample.sampling_params import SamplingParams
from kvserve.sample.structured import apply_bitmask

# Top-p first looks for the nucleus among this many most likely tokens (a partial topk),
# falling back to a full sort only for rows where that cannot decide it exactly: on 64 x
# 49152 logits the partial topk took about a ninth of the stable sort's time.
TOP_P_CANDIDATES = 1024


class SamplingRow(Protocol):
    """What the sampler needs to know about one request (the engine's Request satisfies it)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # a row samples output token len(output_token_ids)
    # Ids that end the request (model eos/eot); banned while len(output) < min_tokens.
    eos_token_ids: frozenset[int]


_MASK64 = 2**64 - 1


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
class _Penalties:
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
    penalties: _Penalties | None
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
) -> _Penalties | None:
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
    return _Penalties(
        rows=torch.tensor(pen_rows, dtype=torch.int64, device=device),
        repetition=repetition,
        frequency=frequency,
        presence=presence,
        seen_mask=seen_mask,
        output_counts=output_counts,
    )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one sampled id per row
    logprobs: list[TokenLogprobs | None]  # per row; None when the row did not ask


class Sampler:
    """Sample one token per row of ``logits`` according to ``meta``.

    Logprobs are *raw*: ``log_softmax`` of the model's logits before bias, bans, penalties,
    temperature and truncation (vLLM's default ``raw_logprobs``), so they describe the model,
    not the sampling distribution.

    Random rows are drawn by inverse transform (a uniform ``u`` located in the row's cumulative
    distribution), which picks token i with probability ``probs[i]`` without a host round
    trip. A seeded row's ``u`` is `seeded_uniform(seed, index of the token)`, so its tokens
    do not depend on the rest of the batch or its position in it; unseeded rows share one
    batched draw from torch's generator.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (meta.batch_size, meta.vocab_size):
            raise ValueError(
                f"logits must have shape {(meta.batch_size, meta.vocab_size)}, "
                f"got {tuple(logits.shape)}"
            )
        if meta.all_greedy and not meta.needs_processing:
            # Upcasting is exact, so the argmax in the model's own dtype is the same token.
            tokens = logits.argmax(dim=-1)
        else:
            # A private float32 copy: the caller's logits are never modified.
            tokens = self._sample(logits.to(torch.float32, copy=True), meta)
        return self.to_output(logits, tokens, meta)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Sample from ``logits`` (a private float32 copy, modified in place); ids [B]."""
        apply_processors(logits, meta)
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        # Temperature and truncation never change the argmax, so greedy rows can stop here.
        greedy_tokens = logits.argmax(dim=-1) if meta.greedy_mask is not None else None

        probs = apply_truncation(logits, meta).softmax(dim=-1)
        random_tokens = inverse_cdf(probs, draw_uniforms(meta, probs.device).unsqueeze(1))

        if greedy_tokens is None:
            return random_tokens
        return torch.where(meta.greedy_mask, greedy_tokens, random_tokens)

    def to_output(
        self, logits: torch.Tensor, tokens: torch.Tensor, meta: SamplingMetadata
    ) -> SamplerOutput:
        """Chosen ``tokens`` [B] and, for rows that asked, their raw logprobs, on the host."""
        results = [tokens]
        if meta.logprob_rows:
            rows = torch.tensor(meta.logprob_rows, dtype=torch.int64, device=logits.device)
            results += _raw_logprobs(logits[rows], tokens[rows], max(meta.num_logprobs))

        host = _to_host(results)
        token_ids: list[int] = host[0]
        out_logprobs: list[TokenLogprobs | None] = [None] * meta.batch_size
        if meta.logprob_rows:
            chosen_h, ranks_h, *top_h = host[1:]  # no top lists when every row asked for 0
            for j, (row, k) in enumerate(zip(meta.logprob_rows, meta.num_logprobs, strict=True)):
                out_logprobs[row] = TokenLogprobs(
                    token_id=token_ids[row],
                    logprob=chosen_h[j],
                    rank=ranks_h[j],
                    top=list(zip(top_h[1][j][:k], top_h[0][j][:k], strict=True)) if k else [],
                )
        return SamplerOutput(token_ids=token_ids, logprobs=out_logprobs)


# Prompt logprobs are computed this many rows at a time, so a long prompt chunk never holds
# more than a slice of float32 log-softmax at once (128 x 49152 x 4 bytes = 24 MiB).
PROMPT_LOGPROB_ROWS = 128


def _raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                  ) -> list[torch.Tensor]:
    """Per row of `logits`: the raw logprob of `tokens[row]`, its 1-based rank, and (k > 0)
    the k largest logprobs and their ids: [chosen, ranks(, top values, top ids)]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # raw: the model's logits
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if not k:
        return [chosen.squeeze(1), ranks]
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    return [chosen.squeeze(1), ranks, top_vals, top_ids]


def token_logprobs(logits: torch.Tensor, targets: list[int], num_top: int
                   ) -> list[TokenLogprobs]:
    """Raw logprobs (as `Sampler.to_output` gives) of `targets[i]` under row i of `logits`,
    with each row's `num_top` most likely tokens: prompt logprobs."""
    out: list[TokenLogprobs] = []
    k = min(num_top, logits.shape[-1])
    for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        tgt = targets[lo:lo + PROMPT_LOGPROB_ROWS]
        host = _to_host(_raw_logprobs(
            logits[lo:lo + PROMPT_LOGPROB_ROWS],
            torch.tensor(tgt, dtype=torch.int64, device=logits.device), k))
        for j, t in enumerate(tgt):
            top = list(zip(host[3][j], host[2][j], strict=True)) if k else []
            out.append(TokenLogprobs(t, host[0][j], host[1][j], top))
    return out


def apply_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Steps 0-3 of the module docstring (grammar masks, bias, min_tokens bans, penalties),
    in place.

    ``logits`` must be a float32 tensor the caller owns; it is also returned for chaining.
    """
    if meta.grammar_rows is not None:
        assert meta.grammar_bitmask is not None
        apply_bitmask(logits, meta.grammar_rows, meta.grammar_bitmask)
    if meta.bias_index is not None:
        logits.index_put_(meta.bias_index, meta.bias_values, accumulate=True)
    if meta.ban_index is not None:
        logits[meta.ban_index] = float("-inf")
    if meta.penalties is not None:
        _apply_penalties(logits, meta.penalties)
    return logits


def apply_truncation(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, min_p, top-k and top-p for random rows; dropped tokens become -inf.

    Works in place where it can; use the returned tensor. Greedy rows pass through with
    neutral settings. Requires a batch with at least one random row.
    """
    assert meta.temperature is not None, "no random rows in this batch"
    logits.div_(meta.temperature)
    if meta.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p
        logits.masked_fill_(probs < threshold, float("-inf"))
    if meta.top_p is not None:
        logits = _top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
    elif meta.top_k is not None:
        _top_k_only(logits, meta.top_k, meta.max_top_k)
    return logits


def _apply_penalties(logits: torch.Tensor, pen: _Penalties) -> None:
    sub = logits[pen.rows]  # advanced indexing copies; written back below
    if pen.seen_mask is not None:
        penalised = torch.where(sub > 0, sub / pen.repetition, sub * pen.repetition)
        sub = torch.where(pen.seen_mask, penalised, sub)
    if pen.output_counts is not None:
        sub = sub - pen.frequency * pen.output_counts
        sub = sub - pen.presence * (pen.output_counts > 0).float()
    logits[pen.rows] = sub


def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep tokens whose logit is >= the row's k-th largest (ties at the boundary are kept).

    ``topk`` with the batch's largest k avoids a full sort; rows without top-k have k = V, so
    they are handled by skipping the mask rather than by asking for V values.
    """
    vocab = logits.shape[-1]
    enabled = top_k < vocab
    values = logits.topk(max_top_k, dim=-1).values
    kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    logits.masked_fill_((logits < kth) & enabled.unsqueeze(1), float("-inf"))


def _top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k then nucleus truncation with a single descending sort.

    A token survives top-p when the probability mass of the tokens ranked strictly above it
    is < top_p: the smallest prefix reaching top_p, and the top token always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    # top_p == 1 must be a no-op even when rounding pushes the cumulative sum to 1.0 early.
    sorted_logits.masked_fill_((mass_above >= top_p) & (top_p < 1.0), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor
) -> torch.Tensor:
    """Same result as `_top_k_top_p_sorted`, without sorting the whole vocabulary.

    The nucleus is searched among the `TOP_P_CANDIDATES` most likely tokens, ordered as the
    stable sort orders them (ties by token id). A row is decided there when the last candidate
    is already dropped (every token after it has even more mass above it) and no tie group
    straddles the candidate cut; other rows with top_p < 1 take the full sort.
    """
    vocab = logits.shape[-1]
    k = min(vocab, TOP_P_CANDIDATES)
    if k == vocab:
        return _top_k_top_p_sorted(logits, top_k, top_p)
    if top_k is not None:
        _top_k_only(logits, top_k, max_top_k)
    vals, ids = logits.topk(k, dim=-1)
    ids, perm = ids.sort(dim=-1)
    vals, order = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    probs = (vals - logits.logsumexp(dim=-1, keepdim=True)).exp()
    mass_above = probs.cumsum(dim=-1) - probs
    drop = (mass_above >= top_p) & (top_p < 1.0)
    exact = drop[:, -1] & ((logits >= vals[:, -1:]).sum(dim=-1) == k)
    rows = exact.nonzero().squeeze(1)
    if rows.numel():
        kept = vals[rows].masked_fill_(drop[rows], float("-inf"))
        logits[rows] = torch.full_like(logits[rows], float("-inf")).scatter_(1, ids[rows], kept)
    rest = ((top_p.squeeze(1) < 1.0) & ~exact).nonzero().squeeze(1)
    if rest.numel():
        logits[rest] = _top_k_top_p_sorted(logits[rest], None, top_p[rest])
    return logits


def draw_uniforms(meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One uniform number per row [B]: seeded rows their own (see `seeded_uniform`), the
    others from torch's generator (greedy rows' are unused)."""
    u = torch.empty(meta.batch_size, device=device)
    if meta.any_unseeded_random:
        u.uniform_()
    if meta.seeded:
        rows, values = zip(*meta.seeded, strict=True)
        u[list(rows)] = torch.tensor(values, dtype=u.dtype).to(u.device)
    return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token whose cumulative-probability interval holds u * total, per row. Tokens with zero
    probability have empty intervals and are never picked."""
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return picked.clamp_(max=probs.shape[-1] - 1).squeeze(1)


def _to_host(tensors: list[torch.Tensor]) -> list[list]:
    """Copy results to the host with a single synchronisation."""
    if tensors[0].device.type == "cuda":
        staged = [t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.current_stream(tensors[0].device).synchronize()
        return [t.tolist() for t in staged]
    return [t.tolist() for t in tensors]
