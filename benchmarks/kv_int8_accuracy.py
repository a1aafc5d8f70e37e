"""Accuracy of the int8 KV cache against the unquantized one, on the default model.

    python benchmarks/kv_int8_accuracy.py [--model ...] [--tokens 256] [--baseline]

For each compute dtype (float32, bfloat16) and each prompt, the unquantized cache generates a
greedy continuation (EOS banned, so every prompt runs the full length). The int8 cache is fed
the same tokens (teacher forcing) and compared at every step: max |logit difference| and
whether its argmax is the same token. Then the int8 cache generates greedily on its own and
we count how many leading tokens are identical. Prints figures; not a test.

`--baseline` adds the same comparison for an unquantized bfloat16 model against float32, to
put the int8 figures beside the error bfloat16 compute already makes.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.attention.backend import AttentionBatch
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.config import CacheConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.paths import resolve_model
from kvserve.tokenizer import Tokenizer
from kvserve.worker.model_runner import ModelRunner

CHATS = [
    "What is the capital of France? Answer in one sentence, then tell me about its history.",
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works, with an example in Python.",
]
TEXTS = [
    "The history of the Roman Empire begins",
    "def quicksort(items):\n    ",
    "Photosynthesis is the process by which",
]


class PagedBatch:
    """A few sequences decoded in lockstep through one paged KV cache: a minimal runner with
    no scheduler, where sequence i owns a fixed range of blocks."""

    def __init__(self, model: LlamaForCausalLM, num_seqs: int, max_len: int,
                 block_size: int = 16) -> None:
        self.model, self.bs = model, block_size
        per_seq = -(-max_len // block_size)
        num_blocks = per_seq * num_seqs
        kv = model.layers[0].self_attn.backend.kv_cache_dtype
        self.runner = ModelRunner(model, CacheConfig(block_size, num_blocks=num_blocks,
                                                     kv_cache_dtype=kv),
                                  num_blocks, model.embed_tokens.weight.dtype, torch.device("cpu"))
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
        self.lens = [0] * num_seqs

    @torch.inference_mode()
    def step(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """Append each sequence's new tokens; float32 logits [num_seqs, vocab] after each."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        for i, toks in enumerate(new_tokens):
            span = range(self.lens[i], self.lens[i] + len(toks))
            slots += [self.tables[i][p // self.bs] * self.bs + p % self.bs for p in span]
            ids += toks
            pos += span
            self.lens[i] += len(toks)
            last.append(len(ids) - 1)
        meta = self.runner.backend.build_metadata(AttentionBatch(
            [len(t) for t in new_tokens], list(self.lens), self.tables, torch.tensor(slots),
            self.bs))
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.runner.kv_caches, meta)
        return self.model.compute_logits(hidden[torch.tensor(last)])


def greedy(logits: torch.Tensor, banned: list[int]) -> list[int]:
    logits = logits.clone()
    logits[:, banned] = float("-inf")
    return logits.argmax(-1).tolist()


@dataclass
class Comparison:
    max_diff: list[list[float]] = field(default_factory=list)  # [seq][step]
    agree: list[list[bool]] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # identical free-running greedy tokens


def compare(ref: LlamaForCausalLM, cand: LlamaForCausalLM, prompts: list[list[int]],
            n: int, banned: list[int]) -> Comparison:
    """`cand` against `ref`: teacher-forced on ref's greedy continuation, then free-running."""
    max_len = max(map(len, prompts)) + n
    a, b = PagedBatch(ref, len(prompts), max_len), PagedBatch(cand, len(prompts), max_len)
    la, lb = a.step(prompts), b.step(prompts)
    out = Comparison([[] for _ in prompts], [[] for _ in prompts])
    ref_tokens: list[list[int]] = [[] for _ in prompts]
    for t in range(n):
        diff = (la - lb).abs().amax(-1).tolist()
        nxt, picks = greedy(la, banned), greedy(lb, banned)
        for i in range(len(prompts)):
            out.max_diff[i].append(diff[i])
            out.agree[i].append(picks[i] == nxt[i])
            ref_tokens[i].append(nxt[i])
        if t < n - 1:
            feed = [[x] for x in nxt]
            la, lb = a.step(feed), b.step(feed)
    free = PagedBatch(cand, len(prompts), max_len)
    logits = free.step(prompts)
    own: list[list[int]] = [[] for _ in prompts]
    for t in range(n):
        nxt = greedy(logits, banned)
        for i, x in enumerate(nxt):
            own[i].append(x)
        if t < n - 1:
            logits = free.step([[x] for x in nxt])
    for r, o in zip(ref_tokens, own, strict=True):
        out.prefix.append(next((i for i, (x, y) in enumerate(zip(r, o, strict=True)) if x != y), n))
    return out


def report(label: str, names: list[str], c: Comparison, n: int) -> None:
    print(f"\n{label}")
    print(f"  {'prompt':<42}{'max|dlogit|':>12}{'mean step max':>15}{'argmax agree':>14}"
          f"{'identical greedy':>18}")
    for name, d, a, p in zip(names, c.max_diff, c.agree, c.prefix, strict=True):
        print(f"  {name:<42}{max(d):>12.4f}{sum(d) / len(d):>15.4f}"
              f"{100 * sum(a) / len(a):>13.1f}%{f'{p}/{n}':>18}")
    flat_d = [x for d in c.max_diff for x in d]
    flat_a = [x for a in c.agree for x in a]
    print(f"  {'all':<42}{max(flat_d):>12.4f}{sum(flat_d) / len(flat_d):>15.4f}"
          f"{100 * sum(flat_a) / len(flat_a):>13.1f}%"
          f"{f'{sum(c.prefix)}/{n * len(c.prefix)}':>18}")


def prompt_set(path: Path) -> tuple[list[list[int]], list[str], list[int]]:
    """The CHATS (chat-templated) and TEXTS prompts as token ids, their short display names,
    and the EOS ids to ban so that every continuation runs its full length."""
    tok = Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_dir(path)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}],
                                                  add_generation_prompt=True),
                          add_special_tokens=False) for c in CHATS]
    prompts += [tok.encode(t) for t in TEXTS]
    names = [repr(c[:38]) for c in CHATS + TEXTS]
    return prompts, names, sorted(tok.eos_token_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=256, help="generated tokens per prompt")
    p.add_argument("--baseline", action="store_true",
                   help="also compare unquantized bfloat16 against float32")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    prompts, names, banned = prompt_set(path)
    print(f"model {path.name}; {len(prompts)} prompts ({min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens) x {args.tokens} greedy tokens, EOS banned; "
          f"threads {torch.get_num_threads()}")

    def load(kv: str, dtype: torch.dtype) -> LlamaForCausalLM:
        return load_model(path, dtype, torch.device("cpu"), lambda c: TorchPagedAttention(
            c.num_heads, c.num_kv_heads, c.head_dim, kv)).model

    exact = {}
    for dtype in (torch.float32, torch.bfloat16):
        t0 = time.perf_counter()
        exact[dtype] = load("auto", dtype)
        c = compare(exact[dtype], load("int8", dtype), prompts, args.tokens, banned)
        name = str(dtype).removeprefix("torch.")
        report(f"int8 KV vs {name} KV, both computing in {name} "
               f"({time.perf_counter() - t0:.0f}s)", names, c, args.tokens)
    if args.baseline:
        c = compare(exact[torch.float32], exact[torch.bfloat16], prompts, args.tokens, banned)
        report("for scale: unquantized bfloat16 (compute and KV) vs float32", names, c,
               args.tokens)


if __name__ == "__main__":
    main()
