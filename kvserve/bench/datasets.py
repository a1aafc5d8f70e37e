"""Prompt sets for the serving benchmark.

  random         prompts of random tokens with a target length (and an optional prefix shared by
                 all of them), each asking for a target number of output tokens
  shared-prefix  groups of prompts; each group shares one random system prompt, each prompt adds
                 its own random question (exercises prefix caching)
  jsonl          a file with one JSON object per line: {"prompt": str, "output_len": int?}

Random text is made from random token ids of the model's tokenizer, decoded to text. Decoding then
re-encoding does not always give back the same number of tokens (BPE merges across token
boundaries), so the text is re-encoded and trimmed or extended until it has the requested length.
A few rounds almost always hit it exactly; when they do not, the closest text is kept, which in
practice is within one token. Lengths count the text only, without BOS or chat-template tokens
(the server's own `usage.prompt_tokens` includes those and is what the report uses when sent).
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvserve.tokenizer import Tokenizer

DATASETS = ("random", "shared-prefix", "jsonl")
DEFAULT_NUM_PROMPTS = 64

# Rounds of re-encode-and-adjust before settling for the closest length.
_FIT_ROUNDS = 8


class DatasetError(ValueError):
    """Bad dataset options or file contents; the CLI prints the message and exits with 2."""


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark prompt and the number of tokens to generate for it.

    `system` is a system prompt (shared-prefix dataset, "" otherwise): the chat endpoint sends it
    as a system message, the completions endpoint puts it in front of `prompt`. `prompt_len` is the
    token count of system + prompt under the benchmark's tokenizer, or None when no tokenizer was
    used (a JSONL file without --tokenizer); the server's usage figure replaces it when available.
    """

    prompt: str
    output_len: int
    prompt_len: int | None = None
    system: str = ""

    @property
    def text(self) -> str:
        """The whole prompt as one string, as the completions endpoint receives it."""
        return self.system + self.prompt


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    num_prompts: int | None = None  # None: DEFAULT_NUM_PROMPTS, or groups x prompts-per-group
    seed: int = 0
    tokenizer: str | None = None  # .gguf, HF directory, or None for the default model
    random_input_len: int = 256
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    shared_prefix_groups: int = 4
    prompts_per_group: int = 16
    system_prompt_len: int = 512
    question_len: int = 64
    output_len: int = 128  # shared-prefix, and JSONL lines that do not say
    dataset_path: str | None = None

    @property
    def needs_tokenizer(self) -> bool:
        return self.name != "jsonl" or self.tokenizer is not None

    def validate(self) -> None:
        """Raise DatasetError for options that cannot make a dataset (before any slow work)."""
        if self.name not in DATASETS:
            raise DatasetError(f"unknown dataset {self.name!r} (choose from {', '.join(DATASETS)})")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise DatasetError("--num-prompts must be at least 1")
        if self.name == "random":
            _positive(random_input_len=self.random_input_len,
                      random_output_len=self.random_output_len)
            if self.random_prefix_len < 0:
                raise DatasetError("--random-prefix-len must be >= 0")
            if not 0.0 <= self.random_range_ratio < 1.0:
                raise DatasetError("--random-range-ratio must be in [0, 1)")
        elif self.name == "shared-prefix":
            _positive(shared_prefix_groups=self.shared_prefix_groups,
                      prompts_per_group=self.prompts_per_group,
                      system_prompt_len=self.system_prompt_len, question_len=self.question_len,
                      output_len=self.output_len)
            total = self.shared_prefix_groups * self.prompts_per_group
            if self.num_prompts is not None and self.num_prompts != total:
                raise DatasetError(
                    f"for shared-prefix the number of prompts is --shared-prefix-groups x "
                    f"--prompts-per-group = {total}; drop --num-prompts or make them agree")
        else:
            _positive(output_len=self.output_len)
            if not self.dataset_path:
                raise DatasetError("the jsonl dataset needs --dataset-path FILE")
            if not Path(self.dataset_path).expanduser().is_file():
                raise DatasetError(f"dataset file not found: {self.dataset_path}")


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise DatasetError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")


def load_tokenizer(spec: str | None) -> Tokenizer:
    """The tokenizer named by --tokenizer: a .gguf file, a directory with tokenizer.json, a model
    short name, or None for the kvserve default model."""
    from kvserve.tokenizer import Tokenizer

    if spec is not None:
        path = Path(spec).expanduser()
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return Tokenizer.from_dir(path)
        if path.is_file() and path.name == "tokenizer.json":
            return Tokenizer.from_dir(path.parent)
    # Imports torch (the loader builds models), which is why it is only imported here.
    from kvserve.models.paths import resolve_model

    try:
        resolved = resolve_model(spec)
    except ValueError as exc:
        raise DatasetError(f"--tokenizer: {exc}") from exc
    if resolved.is_dir():
        return Tokenizer.from_dir(resolved)
    return Tokenizer.from_gguf(resolved)


def load_requests(cfg: DatasetConfig, tokenizer: Tokenizer | None = None) -> list[SampleRequest]:
    """Build the prompts `cfg` describes. `tokenizer` is required unless cfg is a JSONL dataset
    without --tokenizer (load one with `load_tokenizer(cfg.tokenizer)`)."""
    cfg.validate()
    if cfg.needs_tokenizer and tokenizer is None:
        raise DatasetError(f"the {cfg.name} dataset needs a tokenizer")
    rng = np.random.default_rng(cfg.seed)
    if cfg.name == "random":
        assert tokenizer is not None
        return random_requests(cfg, tokenizer, rng)
    if cfg.name == "shared-prefix":
        assert tokenizer is not None
        return shared_prefix_requests(cfg, tokenizer, rng)
    return jsonl_requests(cfg, tokenizer)


# ------------------------------------------------------------------------------- random text


class RandomText:
    """Random text with a given number of tokens under one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.pool = plain_token_ids(tokenizer)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def make(self, num_tokens: int, head: str = "") -> tuple[str, int]:
        """Text t to follow `head` such that head + t has count(head) + num_tokens tokens.

        Returns (t, count(head + t)). The count is exact almost always and otherwise the closest
        reached in a few rounds (in practice one token off): merges across the boundary between
        head and t, or between adjacent random tokens, can make the exact length hard to hit.
        """
        if num_tokens <= 0:
            return "", self.count(head)
        target = self.count(head) + num_tokens
        ids = [int(i) for i in self.rng.choice(self.pool, num_tokens)]
        best: tuple[str, int] | None = None
        for _ in range(_FIT_ROUNDS):
            text = self.tokenizer.decode(ids)
            total = self.count(head + text)
            if best is None or abs(total - target) < abs(best[1] - target):
                best = (text, total)
            if total == target:
                break
            # Adjust the text's own canonical ids, so the next decode changes only at the end.
            own = self.tokenizer.encode(text, add_special_tokens=False)
            if total > target:
                ids = own[: max(len(own) - (total - target), 1)]
            else:
                extra = self.rng.choice(self.pool, target - total)
                ids = own + [int(i) for i in extra]
        assert best is not None
        return best


def plain_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Ids that decode to ordinary text on their own: not special, whole UTF-8 characters, no
    control characters other than whitespace. Random prompts are drawn from these so they never
    contain special tokens or broken characters."""
    keep = []
    for i in range(tokenizer.vocab_size):
        if tokenizer.is_special(i):
            continue
        raw = tokenizer.token_bytes(i)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text and all(c in "\n\t " or unicodedata.category(c)[0] != "C" for c in text):
            keep.append(i)
    if not keep:
        raise DatasetError("the tokenizer has no plain-text tokens to build random prompts from")
    return np.asarray(keep, dtype=np.int64)


def _uniform_lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    """n integers drawn uniformly from [mean*(1-ratio), mean*(1+ratio)], at least 1."""
    low = max(int(mean * (1.0 - ratio)), 1)
    high = max(int(mean * (1.0 + ratio)), low)
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_requests(
    cfg: DatasetConfig, tokenizer: Tokenizer, rng: np.random.Generator
) -> list[SampleRequest]:
    """`num_prompts` prompts of random_prefix_len shared tokens + a random part of about
    random_input_len tokens (± the range ratio)."""
    n = cfg.num_prompts or DEFAULT_NUM_PROMPTS
    maker = RandomText(tokenizer, rng)
    prefix, _ = maker.make(cfg.random_prefix_len)
    input_lens = _uniform_lengths(rng, cfg.random_input_len, cfg.random_range_ratio, n)
    output_lens = _uniform_lengths(rng, cfg.random_output_len, cfg.random_range_ratio, n)
    out = []
    for in_len, out_len in zip(input_lens, output_lens, strict=True):
        body, total = maker.make(in_len, head=prefix)
        out.append(SampleRequest(prompt=prefix + body, output_len=out_len, prompt_len=total))
    return out


def shared_prefix_requests(
    cfg: DatasetConfig, tokenizer: Tokenizer, rng: np.random.Generator
) -> list[SampleRequest]:
    """groups x prompts-per-group prompts: group g's prompts all start with the same system
    prompt. The order is shuffled (seeded) so that groups interleave, as real traffic would."""
    maker = RandomText(tokenizer, rng)
    out = []
    for _ in range(cfg.shared_prefix_groups):
        system, _ = maker.make(cfg.system_prompt_len)
        for _ in range(cfg.prompts_per_group):
            question, total = maker.make(cfg.question_len, head=system)
            out.append(SampleRequest(prompt=question, output_len=cfg.output_len,
                                     prompt_len=total, system=system))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


# ------------------------------------------------------------------------------------- jsonl


def jsonl_requests(cfg: DatasetConfig, tokenizer: Tokenizer | None = None) -> list[SampleRequest]:
    """The first num_prompts (default 64) prompts of a JSONL file; all of them if it has fewer.

    Each non-blank line is an object with "prompt" (string) and optionally "output_len" or
    "max_tokens" (positive int; default cfg.output_len). Prompt lengths are counted only when a
    tokenizer is given.
    """
    assert cfg.dataset_path is not None
    path = Path(cfg.dataset_path).expanduser()
    limit = cfg.num_prompts or DEFAULT_NUM_PROMPTS
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as exc:
        raise DatasetError(f"dataset file not found: {path}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc}") from exc
    out: list[SampleRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if len(out) == limit:
            break
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{where}: \"prompt\" must be a non-empty string")
        output_len = obj.get("output_len", obj.get("max_tokens", cfg.output_len))
        if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
            raise DatasetError(f"{where}: \"output_len\" must be a positive integer")
        prompt_len = (len(tokenizer.encode(prompt, add_special_tokens=False))
                      if tokenizer is not None else None)
        out.append(SampleRequest(prompt=prompt, output_len=output_len, prompt_len=prompt_len))
    if not out:
        raise DatasetError(f"{path}: no prompts in the file")
    return out
