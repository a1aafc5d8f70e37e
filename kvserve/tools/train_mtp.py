"""Training of the MTP drafter's module (`kvserve train-mtp`), outside the serving path.

`train_mtp` trains it by self-distillation: the target writes answers to a generated set of
prompts, and the module learns to predict, from h_t and the token at t+1, the target's own
greedy choice at t+2 (depth 1) and, chained once, at t+3 (depth 2). The module itself and
its drafter are in `kvserve.spec_decode.mtp`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvserve.config import supports_fast_bf16
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
    "Summarise the main ideas of {t} in five bullet points.",
]
# Programming tasks, for code models (and code answers from chat models): each is asked in
# the forms of _CODE_TEMPLATES.
_TASKS = [
    "reverses the words of a sentence", "counts the vowels in a string",
    "returns the n-th Fibonacci number", "merges two sorted lists", "flattens a nested list",
    "checks whether a number is prime", "removes duplicates from a list, keeping the order",
    "finds the largest element of a list without using max", "converts Celsius to Fahrenheit",
    "computes the factorial of a number", "parses a date string in ISO format",
    "returns the most common word in a text", "checks whether two strings are anagrams",
    "implements binary search", "sorts a list of dictionaries by a key",
    "reads a CSV file and returns its rows", "validates an email address",
    "computes the greatest common divisor of two numbers", "rotates a matrix by 90 degrees",
    "groups a list of words by their first letter", "converts a Roman numeral to an integer",
    "implements a queue with two stacks", "counts the lines of a text file",
    "returns the intersection of two lists", "capitalises the first letter of each word",
    "implements a simple LRU cache", "computes the average of a list of numbers",
    "checks whether brackets in a string are balanced", "generates all permutations of a list",
    "chunks a list into pieces of a given size", "computes the dot product of two vectors",
    "converts a number to its binary representation", "finds the longest word in a sentence",
    "implements a linked list with append and remove", "retries a function call on failure",
    "throttles calls to another function", "deep-copies a nested object",
    "computes the median of a list", "formats a number of bytes as KB, MB or GB",
    "checks whether a year is a leap year", "implements bubble sort",
    "counts the occurrences of each character in a string", "transposes a matrix",
    "finds all pairs in a list that sum to a target", "implements a binary tree insert",
    "memoizes another function", "splits a camelCase string into words",
    "removes the punctuation from a text", "computes the running total of a list",
]
_CODE_TEMPLATES = [
    "Write a Python function that {t}.", "Write a JavaScript function that {t}.",
    "Write a Python function that {t}, with a docstring and a short example.",
    "Write a TypeScript function that {t}.", "Write a Go function that {t}.",
    "Write a Python function that {t}, and a pytest test for it.",
]


def training_prompts(n: int, seed: int, held_out: bool = False) -> list[str]:
    """`n` questions from topic x template and task x code template combinations,
    shuffled with `seed`. Every tenth topic and task is held out: `held_out=True` draws only
    from those (for an honest validation)."""
    topics = [t for i, t in enumerate(_TOPICS) if (i % 10 == 9) == held_out]
    tasks = [t for i, t in enumerate(_TASKS) if (i % 10 == 9) == held_out]
    all_prompts = ([tpl.format(t=t) for t in topics for tpl in _TEMPLATES]
                   + [tpl.format(t=t) for t in tasks for tpl in _CODE_TEMPLATES])
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


def prompt_sets(num_prompts: int, seed: int, prompts: list[str] | None = None
                ) -> tuple[list[str], list[str]]:
    """The training prompts and the held-out ones: from the built-in set (`training_prompts`,
    `num_prompts` and a tenth as many, at least 8, about held-out topics), or from the
    user's `prompts`, shuffled with `seed`: a tenth of them (at least one) held out, and up
    to `num_prompts` of the rest."""
    if prompts is None:
        n_val = max(8, num_prompts // 10)
        return (training_prompts(num_prompts, seed),
                training_prompts(n_val, seed, held_out=True))
    if len(prompts) < 2:
        raise ValueError(f"a prompt file needs at least 2 prompts (one held out for "
                         f"validation), it has {len(prompts)}")
    shuffled = list(prompts)
    random.Random(seed).shuffle(shuffled)
    n_val = max(1, len(shuffled) // 10)
    return shuffled[n_val:][:num_prompts], shuffled[:n_val]


def read_prompts(path: Path) -> list[str]:
    """A prompt file: JSON Lines of {"prompt": ...} objects (or of strings) when it ends in
    .jsonl, else one prompt a line; blank lines are skipped."""
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line.strip())
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f'{path}:{n}: expected a string or {{"prompt": "..."}}')
        prompts.append(text)
    return prompts


def _generate(llm: LLM, texts: list[str], max_tokens: int, seed: int, progress: bool
              ) -> tuple[list[list[int]], list[int]]:
    """The target's sampled answers to `texts` (chat prompts): each sequence's ids (prompt
    and answer) and its prompt's length."""
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


def write_generations(path: Path, seqs: list[list[int]], prompt_lens: list[int],
                      n_train: int) -> None:
    """Save the target's answers (token ids, prompt lengths, how many are for training)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"format": "kvserve-mtp-generations-v1", "train": n_train,
                               "prompt_lens": prompt_lens, "sequences": seqs}))
    tmp.replace(path)


def read_generations(path: Path, vocab: int) -> tuple[list[list[int]], list[int], int]:
    """What `write_generations` saved, checked against the target's vocabulary."""
    bad = ValueError(f"{path}: not generations written by `kvserve train-mtp --generations` "
                     f"for this model")
    try:
        data = json.loads(path.read_text())
        seqs, lens, n_train = data["sequences"], data["prompt_lens"], data["train"]
    except (OSError, ValueError, KeyError, TypeError):
        raise bad from None
    if (data.get("format") != "kvserve-mtp-generations-v1" or len(seqs) != len(lens)
            or not isinstance(n_train, int) or not 0 < n_train < len(seqs)
            or not all(isinstance(t, int) and 0 <= t < vocab for q in seqs for t in q)):
        raise bad
    return seqs, lens, n_train


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
              seed: int = 0, progress: bool = True, prompts: list[str] | None = None,
              generations: Path | None = None) -> dict:
    """Self-distil an MTP module for `model` and save it to `output`; returns a report
    (data size, losses, agreement with the target at depth 1 and 2 on held-out prompts,
    time). `prompts`: the user's own (see `prompt_sets`), else the built-in set.
    `generations`: a JSON file of the target's answers, read when it exists (the prompts
    are then not asked again), else written, so that a second training skips the longest
    stage."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    llm = LLM(model, seed=seed, max_num_seqs=128)
    engine = llm.engine
    target = engine.local_core.runner.model
    device = engine.config.device
    cfg = target.config

    # 1. The target answers the prompts (sampled, so the data is not one greedy path).
    if generations is not None and generations.is_file():
        seqs, prompt_lens, n_train_seqs = read_generations(generations, cfg.vocab_size)
    else:
        train_texts, val_texts = prompt_sets(num_prompts, seed, prompts)
        seqs, prompt_lens = _generate(llm, train_texts + val_texts, max_tokens, seed, progress)
        n_train_seqs = len(train_texts)
        if generations is not None:
            write_generations(generations, seqs, prompt_lens, n_train_seqs)
    t_gen = time.perf_counter() - t0

    # 2. Hidden states and the target's greedy choices along every sequence.
    data = [(h, lab, seq, plen) for (h, lab), seq, plen
            in zip(_hidden_and_labels(target, seqs, device), seqs, prompt_lens, strict=True)]
    tr = _examples(data[:n_train_seqs], answers_only=False)
    va = _examples(data[n_train_seqs:], answers_only=True)
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

    # bf16 autocast where the CPU multiplies bf16 natively: ~3x faster steps at hidden size
    # 1536 (float32 master weights and losses; the module is saved in float32).
    amp = device.type == "cpu" and supports_fast_bf16()

    def losses(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        h, x1, x2, y1, y2 = batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            z1 = module(h, emb_w[x1])
            z2 = module(z1, emb_w[x2])
            l1, l2 = logits_of(z1).float(), logits_of(z2).float()
        t1, t2 = index[y1], index[y2]
        return (F.cross_entropy(l1, t1, ignore_index=-100),
                F.cross_entropy(l2, t2, ignore_index=-100),
                (l1.argmax(-1) == t1).float().mean(), (l2.argmax(-1) == t2).float().mean())

    n_train = tr[0].shape[0]
    with warnings.catch_warnings():
        # Under autocast torch's RMSNorm warns of bf16 rows against float32 weights.
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        history = _fit(module, losses, tr, va, epochs, batch_size, lr, progress)
    report = {"model": str(engine.config.model), "sequences": len(seqs), "train_positions":
              n_train, "val_positions": int(va[0].shape[0]), "draft_vocab": int(vocab_ids.numel()),
              "draft_vocab_coverage": coverage, "generate_seconds": round(t_gen, 1),
              "bf16_autocast": amp,
              "total_seconds": round(time.perf_counter() - t0, 1), "history": history}
    save_mtp(module, output, report)
    return report
