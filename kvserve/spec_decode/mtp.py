"""Multi-token prediction (MTP) drafting, in the style of DeepSeek-V3's MTP module.

The module takes the target's final hidden state h_t at the row that predicted token t+1,
and the embedding of token t+1, and predicts token t+2 through the target's own final norm
and LM head (shared, frozen):

    x = W_proj [hnorm(h_t); enorm(E[t+1])]          (2H -> H)
    x = x + down(silu(gate(n(x))) * up(n(x)))        (a SwiGLU block)
    logits = lm_head(final_norm(x))

Drafting chains it: x becomes the hidden state for the next depth, with the embedding of
the token just drafted. Unlike DeepSeek-V3's module this one has no attention block: it
needs no KV cache of its own and a draft step costs one small MLP and the LM head.

`train_mtp` trains it by self-distillation: the target writes answers to a generated set of
prompts, and the module learns to predict, from h_t and the token at t+1, the target's own
greedy choice at t+2 (depth 1) and, chained once, at t+3 (depth 2).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.models.llama import LlamaForCausalLM
from kvserve.request import Request
from kvserve.spec_decode.base import Drafter
from kvserve.spec_decode.sampling import sample_drafts

log = logging.getLogger(__name__)

FORMAT = "kvserve-mtp-v1"


class MTPModule(nn.Module):
    def __init__(self, hidden: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.hidden, self.intermediate, self.eps = hidden, intermediate, eps
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
    save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()}, str(tmp),
              metadata=meta)
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
    module = MTPModule(hidden_size, int(meta["intermediate_size"]), float(meta["eps"]))
    module.load_state_dict(tensors)
    return module


class MTPDrafter(Drafter):
    needs_hidden = True

    def __init__(self, module: MTPModule, target: LlamaForCausalLM, device: torch.device
                 ) -> None:
        self.target = target
        self.device = device
        dtype = target.embed_tokens.weight.dtype
        self.module = module.to(device=device, dtype=dtype).eval()

    @classmethod
    def load(cls, path: str, target: LlamaForCausalLM, device: torch.device) -> MTPDrafter:
        return cls(load_mtp(path, target.config.hidden_size), target, device)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> None:
        live = [(r, k) for r, k in zip(requests, num_drafts, strict=True)
                if r.spec_hidden is not None and k >= 1]
        for r in requests:
            r.clear_drafts()
        if not live:
            return
        reqs = [r for r, _ in live]
        h = torch.stack([r.spec_hidden for r in reqs]).to(self.module.proj.weight.dtype)
        tokens = torch.tensor([r.all_token_ids[-1] for r in reqs], device=self.device)
        drafts: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
        for depth in range(max(k for _, k in live)):
            h = self.module(h, self.target.embed_tokens(tokens))
            logits = self.target.compute_logits(self.target.norm(h))
            drawn, q = sample_drafts(logits, reqs, drafts, self.device)
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


# --------------------------------------------------------------------------------- training

_TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes",
    "machine learning", "the human heart", "climate change", "the Roman Empire", "bees",
    "electric cars", "the internet", "vaccines", "the Moon", "chess", "coffee", "rainbows",
    "earthquakes", "the stock market", "dinosaurs", "recycling", "the Olympic Games",
    "solar panels", "sleep", "the Great Wall of China", "honey", "gravity", "octopuses",
    "the printing press", "jazz music", "glaciers", "bicycles", "the immune system",
    "democracy", "the periodic table", "rain forests", "submarines", "tea", "mathematics",
    "the Sahara desert", "robots", "friendship", "volunteering", "a healthy breakfast",
]
_TEMPLATES = [
    "Explain {t} in simple terms.", "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?", "Why is {t} important?",
    "Give me a brief history of {t}.", "Write a short poem about {t}.",
    "How would you describe {t} to a child?", "What are the pros and cons of {t}?",
]


def training_prompts(n: int, seed: int) -> list[str]:
    """`n` questions from topic x template combinations, shuffled with `seed`."""
    all_prompts = [tpl.format(t=t) for t in _TOPICS for tpl in _TEMPLATES]
    random.Random(seed).shuffle(all_prompts)
    return [all_prompts[i % len(all_prompts)] for i in range(n)]


@torch.inference_mode()
def _hidden_and_labels(model: LlamaForCausalLM, seqs: list[list[int]], device: torch.device,
                       batch_tokens: int = 2048) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: the target's final hidden states [L, H] (float32) and its greedy next
    token at every position [L]."""
    from kvserve.worker.model_runner import ForwardItem, allocate_kv_caches, run_forward

    bs = 16
    longest = max(len(s) for s in seqs)
    slots = max(batch_tokens, longest) + bs * len(seqs)
    kv = allocate_kv_caches(model, slots, model.embed_tokens.weight.dtype, device)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    i = 0
    while i < len(seqs):
        items, used = [], 0
        while i < len(seqs) and (not items or used + len(seqs[i]) <= batch_tokens):
            first = used // bs
            nblocks = -(-len(seqs[i]) // bs)
            items.append(ForwardItem(seqs[i], 0, list(range(first, first + nblocks)),
                                     len(seqs[i])))
            used += nblocks * bs
            i += 1
        hidden = run_forward(model, kv, bs, items, device)
        labels = torch.cat([model.compute_logits(c).argmax(-1) for c in hidden.split(512)])
        start = 0
        for it in items:
            n = len(it.token_ids)
            out.append((hidden[start:start + n].float(), labels[start:start + n]))
            start += n
    return out


def train_mtp(model: str | None, output: Path, num_prompts: int = 320,
              max_tokens: int = 128, epochs: int = 6, batch_size: int = 256,
              lr: float = 2e-3, intermediate: int | None = None, seed: int = 0,
              progress: bool = True) -> dict:
    """Self-distil an MTP module for `model` and save it to `output`; returns a report
    (data size, losses, held-out agreement with the target at depth 1 and 2, time)."""
    from tqdm import tqdm

    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    llm = LLM(model, seed=seed)
    engine = llm.engine
    target = engine.runner.model
    device = engine.config.device
    cfg = target.config

    # 1. The target answers the prompts (sampled, so the data is not one greedy path).
    prompts = [llm.render_chat([{"role": "user", "content": p}])
               for p in training_prompts(num_prompts, seed)]
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=seed)
    seqs: list[list[int]] = []
    chunk = 64
    with tqdm(total=len(prompts), desc="generating", unit="prompt", disable=not progress) as bar:
        for j in range(0, len(prompts), chunk):
            for o in llm.generate(prompts[j:j + chunk], params):
                seqs.append(list(o.prompt_token_ids) + list(o.outputs[0].token_ids))
            bar.update(len(prompts[j:j + chunk]))
    t_gen = time.perf_counter() - t0

    # 2. Hidden states and the target's greedy choices along every sequence.
    data = [(h, lab, seq) for (h, lab), seq in zip(_hidden_and_labels(target, seqs, device),
                                                  seqs, strict=True)]
    random.Random(seed).shuffle(data)
    n_val = max(1, len(data) // 10)

    def examples(part) -> list[torch.Tensor]:
        """(h_t, x_{t+1}, x_{t+2}, target's greedy token at t+1 and at t+2) for every t."""
        cols: list[list[torch.Tensor]] = [[], [], [], [], []]
        for h, lab, seq in part:
            n = len(seq)
            if n < 4:
                continue
            ids = torch.tensor(seq)
            for col, t in zip(cols, (h[:n - 3], ids[1:n - 2], ids[2:n - 1], lab[1:n - 2],
                                     lab[2:n - 1]), strict=True):
                col.append(t)
        return [torch.cat(c) for c in cols]

    va, tr = examples(data[:n_val]), examples(data[n_val:])

    # 3. Train the module; the embedding, final norm and LM head are the target's, frozen.
    module = MTPModule(cfg.hidden_size, intermediate or 2 * cfg.hidden_size, cfg.rms_norm_eps)
    emb_w = target.embed_tokens.weight.detach().float()
    norm_w = target.norm.weight.detach().float()
    head_w = emb_w if cfg.tie_word_embeddings else target.lm_head.weight.detach().float()

    def logits_of(x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(x, (cfg.hidden_size,), norm_w, cfg.rms_norm_eps), head_w)

    def losses(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        h, x1, x2, y1, y2 = batch
        z1 = module(h, emb_w[x1])
        z2 = module(z1, emb_w[x2])
        l1, l2 = logits_of(z1), logits_of(z2)
        return (F.cross_entropy(l1, y1), F.cross_entropy(l2, y2),
                (l1.argmax(-1) == y1).float().mean(), (l2.argmax(-1) == y2).float().mean())

    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    n_train = tr[0].shape[0]
    steps = epochs * math.ceil(n_train / batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps,
                                                pct_start=0.1)
    bar = tqdm(total=steps, desc="training", unit="step", disable=not progress)
    history = []
    for epoch in range(epochs):
        order = torch.randperm(n_train)
        for j in range(0, n_train, batch_size):
            idx = order[j:j + batch_size]
            l1, l2, _, _ = losses([t[idx] for t in tr])
            loss = l1 + 0.5 * l2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(loss=f"{l1.item():.3f}/{l2.item():.3f}")
        with torch.no_grad():
            stats = [losses([t[j:j + 1024] for t in va]) for j in range(0, va[0].shape[0], 1024)]
            w = [min(1024, va[0].shape[0] - j) for j in range(0, va[0].shape[0], 1024)]
            avg = [sum(s[i].item() * n for s, n in zip(stats, w, strict=True)) / sum(w)
                   for i in range(4)]
        history.append({"epoch": epoch + 1, "val_loss_depth1": avg[0], "val_loss_depth2": avg[1],
                        "val_agree_depth1": avg[2], "val_agree_depth2": avg[3]})
        log.info("epoch %d: %s", epoch + 1, history[-1])
    bar.close()
    report = {"model": str(engine.config.model), "sequences": len(seqs),
              "train_positions": n_train, "val_positions": int(va[0].shape[0]),
              "generate_seconds": round(t_gen, 1),
              "total_seconds": round(time.perf_counter() - t0, 1), "history": history}
    save_mtp(module, output, report)
    return report

