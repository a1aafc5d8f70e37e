"""Sampling of draft tokens, processed as the target will process them."""

from __future__ import annotations

import torch

from kvserve.request import Request
from kvserve.sample.rejection_sampler import Row, plain_greedy, process_rows


def sample_drafts(logits: torch.Tensor, requests: list[Request],
                  drafts: dict[str, list[int]], device: torch.device
                  ) -> tuple[list[int], torch.Tensor | None]:
    """One draft token per request from draft-model `logits` [B, V], each row processed
    with the request's own sampling settings (as if its drafts so far were output).
    Greedy requests take the argmax; others sample, seeded ones with the uniform number the
    target will use at that position. Returns the tokens and, when any request samples, the
    distributions q [B, V] they were drawn from."""
    if all(plain_greedy(r) for r in requests):
        return logits.argmax(dim=-1).tolist(), None
    rows = [Row(r.sampling_params, r.prompt_token_ids,
                r.output_token_ids + drafts[r.request_id], r.eos_token_ids)
            for r in requests]
    meta, greedy, q, drawn = process_rows(logits, rows, device)
    if q is None or drawn is None:
        return greedy.tolist(), None
    if meta.greedy_mask is not None:
        drawn = torch.where(meta.greedy_mask, greedy, drawn)
    return drawn.tolist(), q
