"""Verification of drafted tokens: greedy matching and exact rejection sampling.

A request with drafts d_1..d_k gets k+1 rows of target logits: row j is the target's
distribution for the token after the verified tokens and d_1..d_j. Each row is processed
exactly as the sampler would process it if d_1..d_j were already output (penalties and
min_tokens see them), so the target distribution p_j is the one plain decoding would sample.

- Greedy requests accept d_{j+1} while it equals argmax p_j, then take argmax p_j at the
  first mismatch (or argmax p_k when all match): the same tokens as greedy decoding.
- Seeded random requests do the same with the token the sampler would draw from p_j (with
  the request's uniform number for that position, `seeded_uniform`): the tokens are those of
  decoding without speculation, so a seed gives the same output with or without it, with
  any acceptance. For a drafter that proposes tokens only (n-gram), d is accepted with
  probability p_j(d), as rejection sampling would; a draft model samples its drafts with the
  same uniform numbers, so where q is close to p its draft tends to be the target's token.
- Unseeded random requests accept d_{j+1} with probability min(1, p_j(d)/q_j(d)), where q_j
  is the distribution the drafter sampled d_{j+1} from (one-hot when it gives tokens only).
  At the first rejection the token is drawn from max(0, p_j - q_j), normalised; when all k
  are accepted a bonus token is drawn from p_k. Every emitted token is then distributed
  exactly as p (Leviathan et al., 2023; Chen et al., 2023), with the best acceptance a
  draft distribution allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.outputs import TokenLogprobs
from kvserve.request import Request
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import (
    Sampler,
    apply_processors,
    apply_truncation,
    draw_uniforms,
    inverse_cdf,
)
from kvserve.sample.sampling_params import SamplingParams


@dataclass
class Row:
    """A request as the sampler sees it at one draft position (the SamplingRow protocol)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: accepted drafts, then one target token
    logprobs: list[list[TokenLogprobs | None]]


def plain_greedy(req: Request) -> bool:
    """Greedy on the raw logits: no grammar, no bias, no penalties, no min_tokens bans
    pending, no logprobs to compute."""
    p = req.sampling_params
    return (p.is_greedy and req.grammar is None and not p.logit_bias and not p.has_penalties
            and p.logprobs is None and (p.min_tokens == 0 or req.num_output_tokens >= p.min_tokens))


def process_rows(logits: torch.Tensor, rows: list[Row], device: torch.device,
                 allowed: tuple[list[int], torch.Tensor] | None = None
                 ) -> tuple[SamplingMetadata, torch.Tensor, torch.Tensor | None,
                            torch.Tensor | None]:
    """Rows of logits processed as the sampler processes them (`allowed`: the grammar masks
    of constrained rows): (metadata, the greedy token of each row, and when any row samples,
    the distribution of each row and the token the sampler draws from it, else None and
    None)."""
    meta = SamplingMetadata.build(rows, logits.shape[-1], device, allowed)
    processed = apply_processors(logits.to(torch.float32, copy=True), meta)
    greedy = processed.argmax(dim=-1)
    if meta.all_greedy:
        return meta, greedy, None, None
    probs = apply_truncation(processed, meta).softmax(dim=-1)
    return meta, greedy, probs, inverse_cdf(probs, draw_uniforms(meta, device).unsqueeze(1))


def _accept_matching(drafts: list[int], target: list[int], row: int) -> list[int]:
    """The drafts that match the target's tokens (rows row, row+1, ...), then the target's
    token where they stop matching."""
    a = 0
    while a < len(drafts) and drafts[a] == target[row + a]:
        a += 1
    return drafts[:a] + [target[row + a]]


def verify(sampler: Sampler, logits: torch.Tensor, requests: list[Request],
           device: torch.device, allowed: tuple[list[int], torch.Tensor] | None = None
           ) -> VerifyOutput:
    """`logits` [sum(k_i + 1), V]: per request, in order, one row per draft and one more.
    `allowed`: the grammar masks of constrained rows (structured.fill_bitmasks), under which
    a draft its grammar forbids has probability 0 and is rejected."""
    if all(plain_greedy(r) for r in requests):  # the common case, without the machinery
        greedy_h = logits.argmax(dim=-1).tolist()
        tokens, o = [], 0
        for req in requests:
            tokens.append(_accept_matching(req.draft_token_ids, greedy_h, o))
            o += len(req.draft_token_ids) + 1
        return VerifyOutput(tokens, [[None] * len(t) for t in tokens])
    rows: list[Row] = []
    for req in requests:
        out = req.output_token_ids
        for j in range(len(req.draft_token_ids) + 1):
            rows.append(Row(req.sampling_params, req.prompt_token_ids,
                             out + req.draft_token_ids[:j], req.eos_token_ids))
    if logits.shape[0] != len(rows):
        raise ValueError(f"expected {len(rows)} rows of logits, got {logits.shape[0]}")
    meta, greedy, probs, sampled = process_rows(logits, rows, device, allowed)

    # Host copies of what the decisions need: greedy argmaxes, and p(d) of each draft.
    draft_rows: list[int] = []
    draft_ids: list[int] = []
    offsets = []
    o = 0
    for req in requests:
        offsets.append(o)
        k = len(req.draft_token_ids)
        if _rejection_sampled(req):
            draft_rows.extend(range(o, o + k))
            draft_ids.extend(req.draft_token_ids)
        o += k + 1
    greedy_h = greedy.tolist()
    sampled_h = sampled.tolist() if sampled is not None else []
    p_draft: list[float] = []
    if draft_rows:
        assert probs is not None
        p_draft = probs[torch.tensor(draft_rows), torch.tensor(draft_ids)].tolist()

    tokens: list[list[int]] = []
    final: list[tuple[int, int, Request, int]] = []  # (request index, row, request, j)
    pi = 0
    for i, (req, o) in enumerate(zip(requests, offsets, strict=True)):
        drafts = req.draft_token_ids
        k = len(drafts)
        if req.sampling_params.is_greedy:
            tokens.append(_accept_matching(drafts, greedy_h, o))
            continue
        if not _rejection_sampled(req):
            tokens.append(_accept_matching(drafts, sampled_h, o))
            continue
        u = torch.rand(k, device=device).tolist()
        q = req.draft_probs
        q_draft = ([1.0] * k if q is None else
                   q[torch.arange(k), torch.tensor(drafts)].tolist())
        a = 0
        while a < k and u[a] * q_draft[a] < p_draft[pi + a]:
            a += 1
        pi += k
        tokens.append(list(drafts[:a]))
        final.append((i, o + a, req, a))

    if final:
        assert probs is not None
        for (i, _, _, _), t in zip(final, _draw_last(final, probs, device), strict=True):
            tokens[i].append(t)

    # Logprobs (raw model logprobs of each emitted token), through the sampler's own path.
    chosen = torch.zeros(len(rows), dtype=torch.long)
    for toks, o in zip(tokens, offsets, strict=True):
        chosen[o:o + len(toks)] = torch.tensor(toks)
    out = sampler.to_output(logits, chosen.to(device), meta)
    logprobs = [out.logprobs[o:o + len(toks)] for toks, o in zip(tokens, offsets, strict=True)]
    return VerifyOutput(tokens, logprobs)


def _draw_last(final: list[tuple[int, int, Request, int]], probs: torch.Tensor,
               device: torch.device) -> list[int]:
    """The token after each rejection-sampled request's accepted drafts, in one batched
    draw (after the acceptance draws, so the generator's sequence is fixed): from the
    residual max(0, p - q) where a draft was rejected, from p where all were accepted."""
    dist = []
    for _, row, req, a in final:
        p = probs[row]
        if a < len(req.draft_token_ids):  # rejected at a: sample max(0, p - q)
            if req.draft_probs is None:
                residual = p.clone()
                residual[req.draft_token_ids[a]] = 0.0
            else:
                residual = (p - req.draft_probs[a].to(p.device, torch.float32)).clamp_(min=0)
            p = residual if residual.sum() > 0 else p
        dist.append(p)
    u = torch.rand(len(final), 1, device=device)
    return inverse_cdf(torch.stack(dist), u).tolist()


def _rejection_sampled(req: Request) -> bool:
    """Random and unseeded: verified by rejection sampling (seeded: by matching)."""
    return not req.sampling_params.is_greedy and req.sampling_params.seed is None
