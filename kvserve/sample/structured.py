"""Structured outputs: grammars compiled by llguidance, enforced with a token mask per step.

A constrained request holds a `Grammar`: llguidance's matcher for its constraint, advanced by
every token the request is given (Request.append_token) and nothing else, so its mask depends
only on the request's own output, whatever its batch, chunking or preemption. Each step the
runner asks every constrained row for the set of tokens the grammar allows next
(`fill_bitmasks`); the sampler sets every other logit to -inf before any other processing,
so greedy, random and seeded rows (and rejection sampling of drafts) draw only allowed tokens.
A row that verifies drafts gets one mask per draft position: the matcher advances over the
drafts the grammar allows, fills each position's mask, and is rolled back; a draft the grammar
forbids has probability 0 under its row's mask and is rejected there.

When the grammar is complete and allows nothing more (a JSON object closed), the request
stops (finish_reason "stop") without spending a step on an end-of-sequence token.

`GrammarCompiler` owns llguidance's view of the tokenizer (built once, on a background thread
at start-up) and an LRU cache of compiled grammars keyed by the constraint; a request's
matcher is a copy of the cached one, so a repeated schema costs microseconds.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance
import torch

from kvserve.sample.sampling_params import JSON_OPTIONS, StructuredOutputs, ThinkingBudget

# Parser limits (llguidance's fuel): they bound the work of compiling a grammar and of each
# mask, so a pathological schema is refused rather than stalling every step.
_LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=2_000_000,  # ~40 ms of regex analysis at ~50k/ms
    step_lexer_fuel=400_000,  # ~30 ms for one mask at worst
    max_grammar_size=200_000,
)
COMPILE_CACHE_SIZE = 256


class StructuredOutputError(ValueError):
    """The constraint cannot be enforced: invalid, unsupported, or over the limits."""


def _schema(spec: StructuredOutputs) -> dict | bool:
    if spec.json_object:
        return {"type": "object"}
    assert spec.json is not None
    try:
        schema = json.loads(spec.json)
    except json.JSONDecodeError as e:
        raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise StructuredOutputError("a JSON schema must be an object or a boolean")
    return schema


def _choice_lark(choices: tuple[str, ...]) -> str:
    # Lark string literals read JSON escapes, so any choice text is written exactly.
    return " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _after_reasoning(spec: StructuredOutputs) -> str:
    """A Lark grammar: anything up to the end of thinking, optional whitespace, then the
    constraint."""
    if spec.json is not None or spec.json_object:
        schema = _schema(spec)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
        answer = "%json " + json.dumps(schema)
    elif spec.regex is not None:
        answer = "/" + spec.regex.replace("/", "\\/") + "/"
    else:
        assert spec.choice is not None
        answer = _choice_lark(spec.choice)
    return (f"start: thinking SPACE answer\n"
            # suffix=, not stop=: llguidance cannot roll a stop= lexeme back, which
            # checking a step's drafts does
            f"thinking[suffix={json.dumps(spec.reasoning_end)}]: /(?s:.*)/\n"
            f"SPACE: /[ \\t\\r\\n]*/\nanswer: {answer}\n")


def grammar_text(spec: StructuredOutputs) -> str:
    """The constraint as an llguidance grammar. Raises StructuredOutputError when the JSON
    schema is not JSON."""
    if spec.reasoning_end is not None:
        return llguidance.LLMatcher.grammar_from_lark(_after_reasoning(spec))
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=JSON_OPTIONS)
    if spec.json is not None:
        schema = _schema(spec)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise StructuredOutputError(f"invalid JSON schema: {e}") from None
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + _choice_lark(spec.choice))
    assert spec.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


class BudgetState:
    """Where a request stands against its thinking budget (sampling_params.ThinkingBudget):
    tokens thought so far, whether the end of thinking has appeared in the output's bytes
    (the model wrote it, or it was forced), and, once the budget is spent without it, how
    many of the end's forced tokens have been given. A function of the output's tokens
    alone; small enough to copy per draft position."""

    def __init__(self, budget: ThinkingBudget, end_ids: Sequence[int],
                 decode: Callable[[int], bytes]) -> None:
        self.limit = budget.tokens
        self.end = budget.end.encode()
        self.end_ids = list(end_ids)
        self._decode = decode
        self.count = 0
        self.tail = b""  # the output's last bytes, up to len(end) - 1 of them
        self.forcing: int | None = 0 if self.limit == 0 else None
        self.done = False

    def copy(self) -> BudgetState:
        return copy.copy(self)

    def forced(self) -> int | None:
        """The one token the next position allows, or None: no constraint."""
        return None if self.done or self.forcing is None else self.end_ids[self.forcing]

    def advance(self, token: int) -> None:
        if self.done:
            return
        if self.forcing is not None:
            self.forcing += 1
            self.done = self.forcing == len(self.end_ids)
            return
        self.count += 1
        text = self.tail + self._decode(token)
        if self.end in text:
            self.done = True
            return
        self.tail = text[len(text) - len(self.end) + 1:] if len(text) >= len(self.end) else text
        if self.count >= self.limit:
            self.forcing = 0


class Grammar:
    """One request's mask: llguidance's matcher for its constraint, and/or its thinking
    budget (None for either when the request has none; never both None). `accept` advances
    both by a generated token; `terminated` is True once the grammar allows no further
    token."""

    def __init__(self, matcher: llguidance.LLMatcher | None,
                 budget: BudgetState | None = None) -> None:
        assert matcher is not None or budget is not None
        self.matcher = matcher
        self.budget = budget

    def accept(self, token: int) -> None:
        if self.budget is not None:
            forced = self.budget.forced()
            if forced is not None and token != forced:
                raise RuntimeError(f"the thinking budget forces token {forced}, got {token}")
            self.budget.advance(token)
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: "
                               f"{self.matcher.get_error() or 'not allowed'}")

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_stopped()

    @property
    def spent(self) -> bool:
        """A thinking budget alone whose thinking has ended: it allows every token from
        here on, so the request needs no mask."""
        return self.matcher is None and self.budget is not None and self.budget.done

    def fill(self, row: torch.Tensor) -> None:
        """The allowed next tokens as a bitmask into `row` (int32, contiguous, CPU)."""
        if self.matcher is None:
            row.fill_(-1)
        else:
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            self.check()
        if self.budget is not None:
            self.restrict(row)

    def restrict(self, row: torch.Tensor) -> None:
        """Apply the thinking budget to the matcher's mask in `row`: where it forces a
        token, that token alone."""
        token = self.budget.forced() if self.budget is not None else None
        if token is None:
            return
        word, bit = divmod(token, 32)
        if not (int(row[word]) >> bit) & 1:
            raise RuntimeError(f"the constraint forbids token {token}, which the thinking "
                               "budget forces (the end of thinking)")
        row.zero_()
        row[word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # as int32

    def check(self) -> None:
        """Raise if the matcher failed (after a mask was computed for it)."""
        if self.matcher is not None and self.matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")

    def fill_drafts(self, rows: torch.Tensor, drafts: Sequence[int]) -> None:
        """Masks for len(drafts) + 1 positions: position j allows what may follow the drafts
        before it. Positions after a draft the mask forbids allow everything (their drafts
        are rejected before them). The matcher and the budget end where they started."""
        valid = len(drafts) if self.matcher is None else self.matcher.validate_tokens(
            list(drafts))
        budget = self.budget
        if budget is not None:
            self.budget = budget.copy()  # advanced over the drafts, then put back
        consumed = 0
        try:
            self.fill(rows[0])
            for j in range(valid):
                forced = self.budget.forced() if self.budget is not None else None
                if forced is not None and drafts[j] != forced:
                    valid = j  # the budget rejects this draft
                    break
                self.accept(drafts[j])
                consumed += 1
                self.fill(rows[j + 1])
        finally:
            self.budget = budget
            if consumed and self.matcher is not None and not self.matcher.rollback(consumed):
                raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")
        rows[valid + 1:].fill_(-1)


class GrammarCompiler:
    """Compiles constraints for one tokenizer (its tokenizer.json text, or a function that
    makes it when first needed, the model's vocab size and end-of-sequence ids); safe to call
    from one thread at a time."""

    def __init__(self, tokenizer_json: str | Callable[[], str], vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0
        self.compile_seconds = 0.0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built on first use: ~0.3 s for a 49k vocabulary, during
        which it holds the GIL (measured), so building it on a thread at load time would
        only have delayed the load."""
        if self._tokenizer is None:
            try:
                text = self._tokenizer_json
                self._tokenizer = llguidance.LLTokenizer(
                    text if isinstance(text, str) else text(), n_vocab=self.vocab_size,
                    eos_token=self._eos)
            except Exception as e:
                raise StructuredOutputError(f"structured outputs are unavailable for this "
                                            f"tokenizer: {e}") from e
            self._tokenizer_json = ""  # the text is not needed again
        return self._tokenizer

    def compile(self, spec: StructuredOutputs | None,
                budget: ThinkingBudget | None = None) -> Grammar:
        """A fresh mask for `spec` and `budget` (at least one given); raises
        StructuredOutputError naming the problem."""
        matcher = self._compiled(spec).deep_copy() if spec is not None else None
        state = None
        if budget is not None:
            tok = self.tokenizer
            end_ids = tok.tokenize_str(budget.end)
            if not end_ids:
                raise StructuredOutputError(f"{budget.end!r} is no tokens in this vocabulary")
            state = BudgetState(budget, end_ids, lambda t: tok.decode_bytes([t]))
        return Grammar(matcher, state)

    def check(self, spec: StructuredOutputs) -> None:
        """Raise StructuredOutputError if `spec` cannot be enforced (compiling it into the
        cache, for the request's compile that follows)."""
        self._compiled(spec)

    def _compiled(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """The cached matcher of `spec`, compiled on first use (never handed out: copy)."""
        matcher = self._cache.get(spec)
        if matcher is not None:
            self._cache.move_to_end(spec)
            return matcher
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0,
                                       limits=_LIMITS)
        if matcher.is_error():
            raise StructuredOutputError(f"invalid {_what(spec)}: {matcher.get_error()}")
        first = new_bitmask(1, self.vocab_size)
        try:
            Grammar(matcher.deep_copy()).fill(first[0])
        except RuntimeError:
            first.zero_()
        if not first.any():  # nothing the tokenizer can write starts a match
            raise StructuredOutputError(f"the {_what(spec)} allows no output this model's "
                                        "tokens can write")
        self.compile_seconds += time.perf_counter() - t0
        self.num_compiled += 1
        self._cache[spec] = matcher
        while len(self._cache) > COMPILE_CACHE_SIZE:
            self._cache.popitem(last=False)
        return matcher


def _what(spec: StructuredOutputs) -> str:
    return {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[spec.kind]


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask for `rows` rows, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# Byte b of a bitmask -> an additive bias for its 8 tokens (0 allowed, -inf forbidden).
# Expanding a mask by lookup and adding it is about ten times faster than shifting every
# 32-bit word 32 times and a boolean masked_fill.
_BIAS = torch.zeros(256, 8).masked_fill_(
    ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0, float("-inf"))


# A step's masks with at most this many words holding a forbidden token, a row, are applied
# token by token: tool_choice auto's lazy grammar forbids almost nothing before a call (a
# raw 0xFF byte), and a bias expanded over the whole vocabulary for each of its rows is most
# of the work a constrained greedy row adds (with the float32 copy the sampler then makes).
SPARSE_WORDS = 8


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in rows `rows` of `logits` [B, V] (float32), every token whose bit in
    `bitmask` [len(rows), ceil(V / 32)] is 0 (bit i of word w is token 32 w + i)."""
    vocab = logits.shape[-1]
    holes = (bitmask != -1).nonzero()  # (mask row, word) of every word with a 0 bit
    if holes.shape[0] <= SPARSE_WORDS * bitmask.shape[0]:
        words = bitmask[holes[:, 0], holes[:, 1]].to(torch.int64)
        hole, bit = (((words.unsqueeze(1) >> torch.arange(32)) & 1) == 0).nonzero(
            as_tuple=True)
        tokens = holes[hole, 1] * 32 + bit
        inside = tokens < vocab
        at = rows.to(torch.int64)[holes[hole, 0]]
        logits[at[inside].to(logits.device), tokens[inside].to(logits.device)] = float("-inf")
        return
    # Little-endian bytes: byte j of a row holds the bits of tokens 8 j .. 8 j + 7.
    codes = bitmask.contiguous().view(torch.uint8).view(-1).to(logits.device, torch.int32)
    bias = _BIAS.to(logits.device).index_select(0, codes).view(bitmask.shape[0], -1)
    bias = bias[:, :vocab]
    if rows.numel() == logits.shape[0] and bool((rows == torch.arange(
            rows.numel(), device=rows.device)).all()):
        logits.add_(bias)
    else:
        logits[rows] += bias


_executor: llguidance.LLExecutor | None = None


def _spare_cores() -> bool:
    """Whether cores are left beside torch's threads for llguidance's pool. Where there are
    none, the pool's threads fight the forward's (still spinning at the end of their
    parallel regions): on the 2-core Zen 5 of benchmarks/RESULTS.md, 32 masks a step took
    0.92 ms in the pool against 0.45 ms one after the other (tool_choice auto's lazy
    grammar), and 2.5 against 1.6 ms for a JSON schema."""
    return (os.cpu_count() or 1) > torch.get_num_threads() + 1


def fill_bitmasks(items: Sequence[tuple[int, Grammar, Sequence[int]]], vocab_size: int
                  ) -> tuple[list[int], torch.Tensor]:
    """The masks of a step's constrained rows: `items` holds, per constrained request, the
    index of its first row of logits, its grammar and its drafts (a row per draft and one
    more). Returns the row indices and their bitmasks, in that order. Rows without drafts
    are filled in parallel by llguidance's thread pool where cores are spare (_spare_cores),
    else one after the other."""
    global _executor
    rows: list[int] = []
    for offset, _, drafts in items:
        rows.extend(range(offset, offset + len(drafts) + 1))
    bitmask = new_bitmask(len(rows), vocab_size)
    plain: list[tuple[Grammar, int]] = []  # rows without drafts whose matcher fills them
    i = 0
    for _, grammar, drafts in items:
        if drafts or grammar.matcher is None:
            grammar.fill_drafts(bitmask[i:i + len(drafts) + 1], drafts)
        else:
            plain.append((grammar, i))
        i += len(drafts) + 1
    if len(plain) == 1 or not _spare_cores():
        for grammar, i in plain:
            grammar.fill(bitmask[i])
    elif plain:
        if _executor is None:
            _executor = llguidance.LLExecutor(min(4, os.cpu_count() or 1))
        _executor.unsafe_compute_mask_ptr([(g.matcher, i) for g, i in plain],
                                          bitmask.data_ptr(), bitmask.shape[1] * 4,
                                          bitmask.shape[0])
        for grammar, i in plain:
            grammar.check()
            grammar.restrict(bitmask[i])
    return rows, bitmask
