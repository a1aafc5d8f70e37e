"""Training of the MTP drafter's module (`kvserve train-mtp`), outside the serving path.

`train_mtp` trains it by self-distillation: the target writes answers to a generated set of
prompts, and the module learns to predict, from h_t and the token at t+1, the target's own
greedy choice at t+2 (depth 1) and, chained once, at t+3 (depth 2). The module itself and
its drafter are in `kvserve.spec_decode.mtp`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvserve.engine.llm import LLM
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sample.sampling_params import SamplingParams
from kvserve.spec_decode.mtp import MTPModule, save_mtp
from kvserve.worker.forward import ForwardItem
from kvserve.worker.model_runner import allocate_kv_caches, run_forward

log = logging.getLogger(__name__)


_TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes",
    "machine learning", "the human heart", "climate change", "the Roman Empire", "bees",
    "electric cars", "the internet", "vaccines", "the Moon", "chess", "coffee", "rainbows",
    "earthquakes", "the stock market", "dinosaurs", "recycling", "the Olympic Games",
    "solar panels", "sleep", "the Great Wall of China", "honey", "gravity", "octopuses",
    "the printing press", "jazz music", "glaciers", "bicycles", "the immune system",
    "democracy", "the periodic table", "rain forests", "submarines", "tea", "mathematics",
    "the Sahara desert", "robots", "friendship", "volunteering", "a healthy breakfast",
    "the Amazon river", "ancient Egypt", "the theory of evolution", "electricity", "tides",
    "the human brain", "penguins", "wind turbines", "the Renaissance", "bread baking",
    "public libraries", "smartphones", "the ocean floor", "mountain climbing", "tigers",
    "the Industrial Revolution", "clouds", "the solar system", "composting", "DNA",
    "airplanes", "the Eiffel Tower", "learning a new language", "meditation", "snow",
    "the Silk Road", "batteries", "coral reefs", "time management", "the violin", "deserts",
    "antibiotics", "social media", "the speed of light", "bridges", "elephants", "chocolate",
    "the United Nations", "trains", "photography", "the Arctic", "mushrooms", "video games",
    "the pyramids", "magnets", "water pollution", "first aid", "the Milky Way", "gardening",
    "cryptography", "owls", "the Moon landing", "football", "recycling plastic", "lightning",
    "the human skeleton", "hot air balloons", "saving money", "volcanic islands",
]
_TEMPLATES = [
    "Explain {t} in simple terms.", "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?", "Why is {t} important?",
    "Give me a brief history of {t}.", "Write a short poem about {t}.",
    "How would you describe {t} to a child?", "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.", "List five questions a student might ask "
    "about {t}, with short answers.", "What do most people get wrong about {t}?",
    "Describe {t} in one paragraph for a school report.",
    "How has {t} changed over the last hundred years?", "Write a haiku about {t}.",
]


def training_prompts(n: int, seed: int, held_out: bool = False) -> list[str]:
    """`n` questions from topic x template combinations, shuffled with `seed`. Every tenth
    topic is held out: `held_out=True` draws only from those (for an honest validation)."""
    topics = [t for i, t in enumerate(_TOPICS) if (i % 10 == 9) == held_out]
    all_prompts = [tpl.format(t=t) for t in topics for tpl in _TEMPLATES]
    random.Random(seed).shuffle(all_prompts)
    return [all_prompts[i % len(all_prompts)] for i in range(n)]


@torch.inference_mode()
def _hidden_and_labels(model: LlamaForCausalLM, seqs: list[list[int]], device: torch.device,
                       batch_tokens: int = 2048) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: the target's final hidden states [L, H] (float32) and its greedy next
    token at every position [L]."""
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


def _generate(llm: LLM, num_prompts: int, max_tokens: int, seed: int, progress: bool
              ) -> tuple[list[list[int]], list[int]]:
    """The target's sampled answers to the training prompts and then to the held-out ones:
    each sequence's ids (prompt and answer) and its prompt's length."""
    n_val = max(8, num_prompts // 10)
    texts = training_prompts(num_prompts, seed) + training_prompts(n_val, seed, held_out=True)
    prompts = [llm.render_chat([{"role": "user", "content": p}]) for p in texts]
    params = SamplingParams(temperature=0.5, top_p=0.95, max_tokens=max_tokens, seed=seed)
    seqs: list[list[int]] = []
    prompt_lens: list[int] = []
    chunk = 128
    with tqdm(total=len(prompts), desc="generating", unit="prompt", disable=not progress) as bar:
        for j in range(0, len(prompts), chunk):
            for o in llm.generate(prompts[j:j + chunk], params):
                seqs.append(list(o.prompt_token_ids) + list(o.outputs[0].token_ids))
                prompt_lens.append(len(o.prompt_token_ids))
            bar.update(len(prompts[j:j + chunk]))
    return seqs, prompt_lens


def _examples(part, answers_only: bool) -> list[torch.Tensor]:
    """(h_t, x_{t+1}, x_{t+2}, target's greedy token at t+1 and at t+2) for every t, or
    only where x_{t+1} is part of the answer (validation: what drafting will see)."""
    cols: list[list[torch.Tensor]] = [[], [], [], [], []]
    for h, lab, seq, plen in part:
        n = len(seq)
        a = plen - 1 if answers_only else 0
        if n - 3 <= a:
            continue
        ids = torch.tensor(seq)
        for col, t in zip(cols, (h[a:n - 3], ids[a + 1:n - 2], ids[a + 2:n - 1],
                                 lab[a + 1:n - 2], lab[a + 2:n - 1]), strict=True):
            col.append(t)
    return [torch.cat(c) for c in cols]


def _draft_vocab(tr: list[torch.Tensor], vocab: int, draft_vocab: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft head's vocabulary (the `draft_vocab` tokens the target chose most often in
    the training data, in id order; all of them with 0) and the map token -> head row
    (-100: not in it)."""
    if 0 < draft_vocab < vocab:
        counts = torch.bincount(torch.cat([tr[3], tr[4]]), minlength=vocab)
        vocab_ids = counts.topk(draft_vocab).indices.sort().values
    else:
        vocab_ids = torch.arange(vocab)
    index = torch.full((vocab,), -100, dtype=torch.long)  # token -> head row, -100 = none
    index[vocab_ids] = torch.arange(vocab_ids.numel())
    return vocab_ids, index


def _validate(losses, va: list[torch.Tensor]) -> list[float]:
    """The mean over the validation examples of what `losses` gives a batch (losses and
    agreement at depth 1 and 2), in batches of 1,024."""
    with torch.no_grad():
        n_va = va[0].shape[0]
        parts = [(losses([t[j:j + 1024] for t in va]), min(1024, n_va - j))
                 for j in range(0, n_va, 1024)]
        return [sum(s[i].item() * n for s, n in parts) / n_va for i in range(4)]


def _fit(module: MTPModule, losses, tr: list[torch.Tensor], va: list[torch.Tensor],
         epochs: int, batch_size: int, lr: float, progress: bool) -> list[dict]:
    """Train `module` on `tr` (loss: depth 1's plus half depth 2's; AdamW, one cycle of the
    learning rate), measuring it on `va` after every epoch. Returns those measurements."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.01)
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
        avg = _validate(losses, va)
        history.append({"epoch": epoch + 1, "val_loss_depth1": avg[0], "val_loss_depth2": avg[1],
                        "val_agree_depth1": avg[2], "val_agree_depth2": avg[3]})
        log.info("epoch %d: %s", epoch + 1, history[-1])
    bar.close()
    return history


def train_mtp(model: str | None, output: Path, num_prompts: int = 1024,
              max_tokens: int = 128, epochs: int = 6, batch_size: int = 256,
              lr: float = 2e-3, intermediate: int | None = None, draft_vocab: int = 8192,
              seed: int = 0, progress: bool = True) -> dict:
    """Self-distil an MTP module for `model` and save it to `output`; returns a report
    (data size, losses, agreement with the target at depth 1 and 2 on prompts about topics
    never seen in training, time)."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    llm = LLM(model, seed=seed, max_num_seqs=128)
    engine = llm.engine
    target = engine.local_core.runner.model
    device = engine.config.device
    cfg = target.config

    # 1. The target answers the prompts (sampled, so the data is not one greedy path).
    seqs, prompt_lens = _generate(llm, num_prompts, max_tokens, seed, progress)
    t_gen = time.perf_counter() - t0

    # 2. Hidden states and the target's greedy choices along every sequence.
    data = [(h, lab, seq, plen) for (h, lab), seq, plen
            in zip(_hidden_and_labels(target, seqs, device), seqs, prompt_lens, strict=True)]
    tr = _examples(data[:num_prompts], answers_only=False)
    va = _examples(data[num_prompts:], answers_only=True)
    del data

    # 3. The draft vocabulary: the tokens the target chose most often in the training data.
    vocab = cfg.vocab_size
    vocab_ids, index = _draft_vocab(tr, vocab, draft_vocab)
    coverage = float((index[tr[3]] >= 0).float().mean())

    # 4. Train the module; the embedding, final norm and LM head are the target's, frozen.
    module = MTPModule(cfg.hidden_size, intermediate or 4 * cfg.hidden_size, cfg.rms_norm_eps,
                       vocab_ids if vocab_ids.numel() < vocab else None)
    emb_w = target.embed_tokens.full_weight().detach().float()
    norm_w = target.norm.weight.detach().float()
    head_w = (emb_w if cfg.tie_word_embeddings else
              target.lm_head.full_weight().detach().float())
    head_w = head_w[vocab_ids].contiguous()

    def logits_of(x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(x, (cfg.hidden_size,), norm_w, cfg.rms_norm_eps), head_w)

    def losses(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        h, x1, x2, y1, y2 = batch
        z1 = module(h, emb_w[x1])
        z2 = module(z1, emb_w[x2])
        l1, l2 = logits_of(z1), logits_of(z2)
        t1, t2 = index[y1], index[y2]
        return (F.cross_entropy(l1, t1, ignore_index=-100),
                F.cross_entropy(l2, t2, ignore_index=-100),
                (l1.argmax(-1) == t1).float().mean(), (l2.argmax(-1) == t2).float().mean())

    n_train = tr[0].shape[0]
    history = _fit(module, losses, tr, va, epochs, batch_size, lr, progress)
    report = {"model": str(engine.config.model), "sequences": len(seqs), "train_positions":
              n_train, "val_positions": int(va[0].shape[0]), "draft_vocab": int(vocab_ids.numel()),
              "draft_vocab_coverage": coverage, "generate_seconds": round(t_gen, 1),
              "total_seconds": round(time.perf_counter() - t0, 1), "history": history}
    save_mtp(module, output, report)
    return report
