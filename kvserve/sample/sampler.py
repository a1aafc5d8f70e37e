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

from dataclasses import dataclass

import torch

from kvserve.outputs import TokenLogprobs
from kvserve.sample.metadata import Penalties, SamplingMetadata
from kvserve.sample.structured import apply_bitmask

# Top-p first looks for the nucleus among this many most likely tokens (a partial topk),
# falling back to a full sort only for rows where that cannot decide it exactly: on 64 x
# 49152 logits the partial topk took about a ninth of the stable sort's time.
TOP_P_CANDIDATES = 1024


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
        elif meta.all_greedy and meta.bias_index is None and meta.ban_index is None and \
                meta.penalties is None:
            tokens = self._greedy_masked(logits, meta)
        else:
            # A private float32 copy: the caller's logits are never modified.
            tokens = self._sample(logits.to(torch.float32, copy=True), meta)
        return self.to_output(logits, tokens, meta)

    def _greedy_masked(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy rows whose only processing is a grammar mask: the argmax, and only for the
        rows whose argmax the mask forbids, the argmax of a masked float32 copy. The same
        tokens as masking every row (the first allowed maximum is the first maximum when
        that is allowed), without copying and masking a batch whose grammars forbid almost
        nothing: with tool_choice auto's lazy grammar at 32 rows (the default model, 128
        steps, Zen 5) the sample phase took 0.93 s, against 0.49 s this way and 0.45 s
        unconstrained."""
        assert meta.grammar_rows is not None and meta.grammar_bitmask is not None
        tokens = logits.argmax(dim=-1)
        rows = meta.grammar_rows.to(tokens.device)
        bad = refused_on_host(tokens, meta) if tokens.device.type == "cpu" else \
            refused_on_device(tokens, meta)
        if bad is not None:
            sub = logits.index_select(0, rows[bad]).to(torch.float32)
            apply_bitmask(sub, torch.arange(bad.numel(), device=sub.device),
                          meta.grammar_bitmask.to(sub.device).index_select(0, bad))
            tokens[rows[bad]] = sub.argmax(dim=-1)
        return tokens

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


def refused_on_host(tokens: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
    """Which grammar rows (indexes into meta.grammar_rows) forbid their row's token in
    `tokens` (a CPU tensor); None when none does. Host integers: at one row a step, the
    device form's ten small tensor ops were most of what a lazy grammar added to a decode
    step of the default model (c=1: 0.961 -> 0.988 of unconstrained, Zen 5)."""
    assert meta.grammar_rows is not None and meta.grammar_bitmask is not None
    words, chosen = meta.grammar_bitmask.numpy(), tokens.tolist()
    bad = [j for j, r in enumerate(meta.grammar_rows.tolist())
           if not (int(words[j, chosen[r] >> 5]) >> (chosen[r] & 31)) & 1]
    return torch.tensor(bad, dtype=torch.int64) if bad else None


def refused_on_device(tokens: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
    """refused_on_host's answer from tensor ops on `tokens`' device (no copy to the host
    but the final test)."""
    assert meta.grammar_rows is not None and meta.grammar_bitmask is not None
    chosen = tokens.index_select(0, meta.grammar_rows.to(tokens.device))
    words = meta.grammar_bitmask.to(tokens.device).gather(1, (chosen // 32).unsqueeze(1))
    refused = ((words.squeeze(1) >> (chosen % 32)) & 1) == 0
    return refused.nonzero().flatten() if bool(refused.any()) else None


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


def _apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
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
