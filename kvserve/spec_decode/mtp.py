"""Multi-token prediction (MTP) drafting, in the style of DeepSeek-V3's MTP module.

The module takes the target's final hidden state h_t at the row that predicted token t+1,
and the embedding of token t+1, and predicts token t+2 through the target's own final norm
and LM head (shared, frozen):

    x = W_proj [hnorm(h_t); enorm(E[t+1])]          (2H -> H)
    x = x + down(silu(gate(n(x))) * up(n(x)))        (a SwiGLU block)
    logits = lm_head(final_norm(x))

Drafting chains it: x becomes the hidden state for the next depth, with the embedding of
the token just drafted. Unlike DeepSeek-V3's module this one has no attention block: it
needs no KV cache of its own. Its head scores only a draft vocabulary, the tokens the target
writes most often in the training data (8192 of 49152 by default, as FR-Spec does): on this
CPU the full LM head costs ~0.9 ms a row, more than the rest of a draft step, and the rare
tokens it drops are rarely drafted right anyway. Drafts stay exact to verify: q is zero
outside the draft vocabulary.

`kvserve.tools.train_mtp` trains the module (by self-distillation from the target); this module
only serves it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.layers.linear import ReplicatedLinear
from kvserve.layers.quant import QuantizedWeight
from kvserve.models.llama import LlamaForCausalLM
from kvserve.request import Request
from kvserve.sample.rejection_sampler import plain_greedy
from kvserve.spec_decode.base import Drafter
from kvserve.spec_decode.sampling import sample_drafts

log = logging.getLogger(__name__)

FORMAT = "kvserve-mtp-v1"


class MTPModule(nn.Module):
    def __init__(self, hidden: int, intermediate: int, eps: float,
                 vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.hidden, self.intermediate, self.eps = hidden, intermediate, eps
        # Token ids the head scores (the draft vocabulary); empty = the whole vocabulary.
        self.register_buffer("vocab_ids", torch.empty(0, dtype=torch.long) if vocab_ids is None
                             else vocab_ids.to(torch.long))
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """h [B, H] (a target or MTP hidden state), emb [B, H] (next token's embedding) ->
        the hidden state that predicts the token after it."""
        x = self.proj(torch.cat([self.hnorm(h), self.enorm(emb)], dim=-1))
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def save_mtp(module: MTPModule, path: Path, info: dict) -> None:
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "hidden_size": str(module.hidden),
            "intermediate_size": str(module.intermediate), "eps": repr(module.eps),
            "info": json.dumps(info)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tensors = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def load_mtp(path: str | Path, hidden_size: int) -> MTPModule:
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"MTP file not found: {path} (write one with `kvserve train-mtp`)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not an MTP module written by `kvserve train-mtp`")
    if int(meta["hidden_size"]) != hidden_size:
        raise ValueError(f"{path}: MTP module for hidden size {meta['hidden_size']}, the "
                         f"target has {hidden_size}")
    module = MTPModule(hidden_size, int(meta["intermediate_size"]), float(meta["eps"]),
                       tensors.get("vocab_ids"))
    module.load_state_dict(tensors)
    return module


class MTPDrafter(Drafter):
    needs_hidden = True

    def __init__(self, module: MTPModule, target: LlamaForCausalLM, device: torch.device
                 ) -> None:
        self.target = target
        self.device = device
        self.dtype = dtype = target.embed_tokens.weight.dtype
        self.module = module.to(device=device, dtype=dtype).eval()
        vocab = target.config.vocab_size
        ids = module.vocab_ids.to(device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"MTP draft vocabulary has ids outside the target's {vocab}")
        self.vocab_ids = ids if ids.numel() else None
        # The draft vocabulary's rows of the LM head, copied once (9 MB for 8192 x 576 bf16),
        # and only those dequantized from GGUF blocks: a whole 152k-row head is 0.9 GB of
        # float32 (a tied head's rows are the embedding's, looked up).
        self.head: torch.Tensor | None = None
        if self.vocab_ids is not None:
            self.head = (target.embed_tokens(ids).to(dtype)
                         if target.config.tie_word_embeddings
                         else target.lm_head.weight_rows(ids).to(dtype))
        self.head_q: QuantizedWeight | None = None
        self._hidden: dict[str, torch.Tensor] = {}  # per request: see take_hidden
        if kernels.quant_kernels(dtype, device, module.hidden, 2 * module.hidden):
            # A draft step is one row through ~9 MB of bf16 weights and as much head: int8
            # on the VNNI kernel halves the bytes and skips torch's slow bf16 GEMV (about
            # twice as fast a draft step). Drafts only propose; verification stays exact.
            for name in ("proj", "gate_up", "down"):
                old = getattr(self.module, name)
                new = ReplicatedLinear(old.in_features, old.out_features).to(dtype)
                new.load(old.weight.data)
                new.pack_("int8")
                setattr(self.module, name, new)
            if self.head is not None and kernels.quant_kernels(dtype, device, *self.head.shape):
                self.head_q = QuantizedWeight(self.head, "int8")
                self.head = None

    @classmethod
    def load(cls, path: str, target: LlamaForCausalLM, device: torch.device) -> MTPDrafter:
        return cls(load_mtp(path, target.config.hidden_size), target, device)

    def _sub_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the draft vocabulary (None without one)."""
        normed = self.target.norm(h)
        if self.head_q is not None:
            return self.head_q.matmul(normed).float()
        return F.linear(normed, self.head).float() if self.head is not None else None

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits; -inf outside the draft vocabulary."""
        sub = self._sub_logits(h)
        if sub is None:
            return self.target.compute_logits(self.target.norm(h))
        full = sub.new_full((sub.shape[0], self.target.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.vocab_ids, sub)

    def _draw(self, h: torch.Tensor, reqs: list[Request], drafts: dict[str, list[int]]
              ) -> tuple[list[int], torch.Tensor | None]:
        if self.vocab_ids is not None and all(plain_greedy(r) for r in reqs):
            # Greedy: the argmax of the draft vocabulary's logits, no full-vocabulary row.
            sub = self._sub_logits(h)
            assert sub is not None
            return self.vocab_ids[sub.argmax(dim=-1)].tolist(), None
        return sample_drafts(self._logits(h), reqs, drafts, self.device)

    def take_hidden(self, req: Request, hidden: torch.Tensor) -> None:
        self._hidden[req.request_id] = hidden

    def forget(self, req: Request) -> None:
        self._hidden.pop(req.request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> None:
        live = [(r, k) for r, k in zip(requests, num_drafts, strict=True)
                if r.request_id in self._hidden and k >= 1]
        for r in requests:
            r.clear_drafts()
        if not live:
            return
        reqs = [r for r, _ in live]
        h = torch.stack([self._hidden[r.request_id] for r in reqs]).to(self.dtype)
        tokens = torch.tensor([r.all_token_ids[-1] for r in reqs], device=self.device)
        drafts: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
        for depth in range(max(k for _, k in live)):
            h = self.module(h, self.target.embed_tokens(tokens))
            drawn, q = self._draw(h, reqs, drafts)
            for i, (r, k) in enumerate(live):
                if depth < k:
                    drafts[r.request_id].append(drawn[i])
                    if q is not None:
                        probs[r.request_id].append(q[i])
            tokens = torch.tensor(drawn, device=self.device)
        for r, k in live:
            r.draft_token_ids = drafts[r.request_id][:k]
            if not r.sampling_params.is_greedy and probs[r.request_id]:
                r.draft_probs = torch.stack(probs[r.request_id][:k])
