"""Drafting with a smaller (or cheaper) model that shares the target's tokenizer.

The draft model keeps its own paged KV cache, indexed by the target's block tables: slot s
of the draft cache holds the draft's K/V for the token the target keeps in slot s. So it
needs no block accounting of its own, is preempted and freed with the target's blocks, and
its rollback is the target's: the draft K/V of a request is valid for a prefix of its
tokens, which shrinks to what verification kept. A request whose blocks changed
(preemption) or that is new starts from position 0; a long gap is caught up in chunks of
at most `max_catchup_tokens` per step before the request drafts again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.planner import kv_bytes_per_token
from kvserve.layers.linear import ParallelLMHead
from kvserve.models.llama import LlamaForCausalLM
from kvserve.request import Request
from kvserve.spec_decode.base import Drafter
from kvserve.spec_decode.sampling import sample_drafts
from kvserve.worker.forward import ForwardItem
from kvserve.worker.model_runner import allocate_kv_caches, run_forward

# Draft steps kept for the coordinator's fit of their cost, and the most tokens a request a
# step may run to count (the newest verified token and a few accepted drafts' neighbours).
DRAFT_STEP_WINDOW = 64
DECODE_LIKE = 4


@dataclass
class _State:
    preemptions: int  # the request's count when this state was made
    base: int = 0  # draft K/V valid for all_token_ids[:base] ...
    chain: list[int] = field(default_factory=list)  # ... and for these tokens after it

    def valid(self, req: Request) -> int:
        n = self.base
        for t in self.chain:
            if n >= req.num_tokens - 1 or req.all_token_ids[n] != t:
                break
            n += 1
        return min(n, req.num_tokens - 1)


def draft_head(model: LlamaForCausalLM, rows: int, quantization: str) -> ParallelLMHead:
    """The first `rows` rows of `model`'s LM head as a head of their own, packed as the whole
    head is for the draft's `quantization` (int8, or none under none): drafts from the first
    token ids only. Much of a small model's step is its head (for Qwen2.5-Coder-0.5B's
    152k-token vocabulary, 3.2 of 11.5 ms), and BPE vocabularies number their tokens in merge
    order, so the first ids are the common ones."""
    head = ParallelLMHead(model.config.hidden_size, rows)
    weight = model.lm_head.full_weight()[:rows]
    head.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    head.pack_("none" if quantization == "none" else "int8")
    return head


class DraftModelDrafter(Drafter):
    def __init__(self, model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device,
                 max_catchup_tokens: int, head: ParallelLMHead | None = None) -> None:
        self.model = model
        # Drafts from a reduced vocabulary (draft_head), or None: from the model's own head.
        self.head = head
        self.dtype = dtype
        self.device = device
        self.max_catchup = max_catchup_tokens
        self.kv: KVCacheManager | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self._state: dict[str, _State] = {}
        self.draft_steps = deque(maxlen=DRAFT_STEP_WINDOW)

    def catchup_tokens(self, req: Request) -> int:
        st = self._state.get(req.request_id)
        if st is None or st.preemptions != req.timeline.num_preemptions:
            return req.num_tokens - 1  # nothing of it run yet
        return req.num_tokens - 1 - st.valid(req)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model.config, "auto", self.dtype)

    def allocate(self, kv: KVCacheManager) -> None:
        self.kv, self.block_size = kv, kv.block_size
        self.kv_caches = allocate_kv_caches(self.model, kv.num_blocks * kv.block_size,
                                            self.dtype, self.device)

    def forget(self, req: Request) -> None:
        self._state.pop(req.request_id, None)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the whole vocabulary; with a reduced head, -inf past its rows
        (so a sampled draft's q is 0 there, and exact rejection sampling still holds)."""
        if self.head is None:
            return self.model.compute_logits(hidden)
        small = self.head(hidden).float()
        full = small.new_full((small.shape[0], self.model.config.vocab_size), float("-inf"))
        full[:, :small.shape[1]] = small
        return full

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> None:
        assert self.kv is not None, "allocate() first"
        budget = self.max_catchup
        catchup: list[ForwardItem] = []
        items: list[ForwardItem] = []
        live: list[tuple[Request, int]] = []
        for req, k in zip(requests, num_drafts, strict=True):
            req.clear_drafts()
            st = self._state.get(req.request_id)
            if st is None or st.preemptions != req.timeline.num_preemptions:
                st = self._state[req.request_id] = _State(req.timeline.num_preemptions)
            valid = st.valid(req)
            st.base, st.chain = valid, []
            gap = req.num_tokens - valid  # tokens to run, the newest included
            if gap > budget:
                # Catch up on verified tokens (their slots exist) and draft in a later step.
                n = min(budget, req.num_tokens - 1 - valid)
                if n > 0:
                    catchup.append(ForwardItem(req.all_token_ids[valid:valid + n], valid,
                                               req.block_ids, 0))
                    budget -= n
                    st.base = valid + n
                continue
            if k < 1 or not self.kv.reserve(req, req.num_tokens + k - 1):
                continue
            budget -= gap
            items.append(ForwardItem(req.all_token_ids[valid:], valid, req.block_ids, 1))
            live.append((req, k))
            st.base = req.num_tokens
        if catchup and not items:
            run_forward(self.model, self.kv_caches, self.block_size, catchup, self.device)
        if not items:
            return
        items = catchup + items
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in live}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in live}
        for step in range(max(k for _, k in live)):
            t0 = time.perf_counter()
            hidden = run_forward(self.model, self.kv_caches, self.block_size, items,
                                 self.device)
            logits = self._logits(hidden)
            tokens, q = sample_drafts(logits, [r for r, _ in live], drafts, self.device)
            nxt: list[tuple[Request, int]] = []
            ran, items = items, []
            for i, ((req, k), t) in enumerate(zip(live, tokens, strict=True)):
                drafts[req.request_id].append(t)
                if q is not None:
                    probs[req.request_id].append(q[i])
                if step + 1 < k:
                    pos = req.num_tokens + step
                    items.append(ForwardItem([t], pos, req.block_ids, 1))
                    self._state[req.request_id].chain.append(t)
                    nxt.append((req, k))
            ran_tokens = sum(len(it.token_ids) for it in ran)
            if ran_tokens <= DECODE_LIKE * len(ran):
                # Decode-like steps only: a catch-up after a pause runs as a prompt does, at
                # another cost per token, and is paid once, not per draft.
                self.draft_steps.append((ran_tokens, time.perf_counter() - t0))
            live = nxt
            if not live:
                break
        for req in requests:
            d = drafts.get(req.request_id)
            if d:
                req.draft_token_ids = d
                p = probs[req.request_id]
                req.draft_probs = torch.stack(p) if p and not req.sampling_params.is_greedy \
                    else None
