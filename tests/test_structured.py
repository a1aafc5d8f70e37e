"""Structured outputs on a tiny random model: every output matches its constraint (whatever
the sampling, batch, chunking or speculation), the grammar ends the request, compiled
grammars are cached, and bad constraints are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from kvserve.sample.sampling_params import SamplingParams, StructuredOutputs, ThinkingBudget
from kvserve.sample.structured import (
    GrammarCompiler,
    StructuredOutputError,
    apply_bitmask,
    fill_bitmasks,
    new_bitmask,
)
from tests.conftest import byte_level_tokenizer_json, make_llm

# Compact JSON (no space at all), so a random model's outputs stay short.
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -50, "maximum": 50},
        "tag": {"enum": ["red", "green", "blue"]},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": 1, "maxItems": 3},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "maybe": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0,
                                               "maximum": 99}]},
    },
    "required": ["ok", "n", "tag", "items", "name", "maybe"],
    "additionalProperties": False,
    "x-guidance": COMPACT,
}


_BYTES = Tokenizer.from_str(byte_level_tokenizer_json())


def ids(text: str) -> list[int]:
    return _BYTES.encode(text, add_special_tokens=False).ids


def schema_spec(schema: dict = SCHEMA) -> StructuredOutputs:
    return StructuredOutputs(json=json.dumps(schema))


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(byte_level_tokenizer_json(), 320, [1])


def test_compiled_grammars_are_cached(compiler):
    before = compiler.num_compiled
    a = compiler.compile(schema_spec())
    b = compiler.compile(schema_spec())
    assert compiler.num_compiled == before + 1
    assert a.matcher is not b.matcher  # each request gets its own copy
    for t in ids('{"ok":true'):
        a.accept(t)
    assert not b.matcher.is_error() and b.matcher.validate_tokens(ids("{")) == 1


@pytest.mark.parametrize("spec, match", [
    (StructuredOutputs(json='{"type": "nope"}'), "JSON schema"),
    (StructuredOutputs(json="{not json"), "not valid JSON"),
    (StructuredOutputs(regex="(unclosed"), "regex"),
    (StructuredOutputs(grammar="start: missing_rule"), "grammar"),
    (StructuredOutputs(regex="[^\\x00-\\U0010FFFF]"), "allows no output"),
    (StructuredOutputs(json='{"not": {"type": "string"}}'), "JSON schema"),
])
def test_bad_constraints_are_refused_by_name(compiler, spec, match):
    with pytest.raises(StructuredOutputError, match=match):
        compiler.compile(spec)


def test_constraint_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", grammar="start: \"a\"")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=())


def test_masks_allow_only_what_the_grammar_allows(compiler):
    g = compiler.compile(StructuredOutputs(choice=("ab", "ac")))
    rows, bitmask = fill_bitmasks([(1, g, [])], 320)
    logits = torch.zeros(3, 320)
    apply_bitmask(logits, torch.tensor(rows), bitmask)
    assert rows == [1]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == ids("a")
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    # Drafts: a mask per position, the matcher where it was afterwards; after a forbidden
    # draft every token is allowed (that position is never reached).
    a, b, c, z = (ids(ch)[0] for ch in "abcz")
    rows, bitmask = fill_bitmasks([(0, g, [a, z, b])], 320)
    logits = torch.zeros(4, 320)
    apply_bitmask(logits, torch.tensor(rows), bitmask)
    allowed = [torch.isfinite(r).nonzero().flatten().tolist() for r in logits]
    assert allowed[0] == [a] and allowed[1] == sorted([b, c])
    assert len(allowed[2]) == 320 and len(allowed[3]) == 320
    assert g.matcher.validate_tokens([a]) == 1  # rolled back to the start


def _texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def test_every_sample_matches_its_schema(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    params = SamplingParams(temperature=0.9, n=3, seed=3, max_tokens=200,
                            structured_outputs=schema_spec())
    outs = llm.generate([[5, 6, 7], [40, 41, 42, 43]], params)
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    llm.engine.check_integrity()


def test_regex_choice_and_grammar(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    specs = [StructuredOutputs(regex=r"[0-9]{3}-[a-c]{2}"),
             StructuredOutputs(choice=("alpha", "beta", "gamma delta")),
             StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[xy]{1,3}/')]
    outs = llm.generate([[9, 10, 11]] * 3, [SamplingParams(temperature=1.0, max_tokens=60,
                                                           structured_outputs=s)
                                            for s in specs])
    regex, choice, grammar = _texts(outs)
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", regex)
    assert choice in ("alpha", "beta", "gamma delta")
    assert re.fullmatch(r"\([xy]{1,3}(,[xy]{1,3})*\)", grammar), grammar
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:2])


def test_running_out_of_tokens_says_length(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    (out,) = llm.generate([[5, 6]], SamplingParams(
        temperature=0, max_tokens=3, structured_outputs=schema_spec()))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_constrained_tokens_do_not_depend_on_batch_chunking_or_speculation(tiny_llama_dir):
    """A seeded constrained request gives the same tokens alone, among others with small
    steps, and with n-gram speculation (whose drafts the grammar checks)."""
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=120,
                            structured_outputs=schema_spec())
    greedy = SamplingParams(temperature=0, max_tokens=120, structured_outputs=schema_spec())
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    alone = make_llm(tiny_llama_dir).generate([prompt, prompt], [params, greedy])
    others = [[i, i + 1, i + 2] * 5 for i in range(20, 26)]
    busy = make_llm(tiny_llama_dir, max_num_batched_tokens=16).generate(
        [*others[:3], prompt, prompt, *others[3:]],
        [SamplingParams(temperature=1.0, max_tokens=30)] * 3 + [params, greedy]
        + [SamplingParams(temperature=1.0, max_tokens=30)] * 3)
    spec = make_llm(tiny_llama_dir, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    speculated = spec.generate([prompt, prompt], [params, greedy])
    want = [o.outputs[0].token_ids for o in alone]
    assert [o.outputs[0].token_ids for o in busy[3:5]] == want
    assert [o.outputs[0].token_ids for o in speculated] == want
    for o in alone:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    spec.engine.check_integrity()


def test_bad_schema_is_refused_before_queueing(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    with pytest.raises(StructuredOutputError, match="JSON schema"):
        llm.generate([[1, 2], [3, 4]], SamplingParams(
            structured_outputs=StructuredOutputs(json='{"type": "nope"}')))
    assert not llm.engine.has_unfinished_requests()


def test_grammar_time_is_its_own_step_phase(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8,
                                             structured_outputs=schema_spec()))
    assert any(r.grammar > 0 for r in llm.engine.local_core.steps)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))
    assert llm.engine.local_core.steps[-1].grammar == 0


@pytest.mark.parametrize("spec", [
    StructuredOutputs(json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"]}), reasoning_end="</think>"),
    StructuredOutputs(regex="[0-9]{2}/[0-9]{2}", reasoning_end="</think>"),
    StructuredOutputs(choice=("yes", "no"), reasoning_end="</think>"),
])
def test_a_constraint_can_start_after_the_thinking(compiler, spec):
    answer = {"json": '{"a": 5}', "regex": "12/31", "choice": "no"}[spec.kind]
    g = compiler.compile(spec)
    for t in ids("Let me see: {not json} 1/2 </think>\n"):
        a = g.matcher.validate_tokens([t])
        assert a == 1
        g.accept(t)
    assert g.matcher.validate_tokens(ids("x")) == 0  # thinking is over: the constraint rules
    for t in ids(answer):
        g.accept(t)
    assert g.terminated
    with pytest.raises(ValueError, match="grammar cannot follow"):
        StructuredOutputs(grammar='start: "a"', reasoning_end="</think>")


def _allowed(g, row=None) -> list[int]:
    if row is None:
        row = new_bitmask(1, 320)[0]
        g.fill(row)
    return [i for i in range(320) if (int(row[i // 32]) >> (i % 32)) & 1]


def _run(g, text: str) -> str:
    """Feed `text` a token at a time while the mask lets it through, then take every forced
    token (a mask of one); return what was generated."""
    out: list[int] = []
    for t in ids(text):
        if t not in _allowed(g):
            break
        g.accept(t)
        out.append(t)
    while len(a := _allowed(g)) == 1:
        g.accept(a[0])
        out.append(a[0])
    return _BYTES.decode(out)


@pytest.mark.parametrize("budget, text, want", [
    (5, "abcdefgh", "abcde</think>"),        # spent: the end tag is forced
    (20, "ab</think>cd", "ab</think>cd"),    # the model ended it within the budget
    (12, "ab</think>" + "x" * 20, "ab</think>" + "x" * 20),  # and the answer runs past it
    (8, "abcde</th", "abcde</t</think>"),    # a partial tag at the limit is left as it is
    (0, "abc", "</think>"),                  # no thinking at all
])
def test_a_thinking_budget_forces_the_end_of_thinking(compiler, budget, text, want):
    g = compiler.compile(None, ThinkingBudget("</think>", budget))
    assert _run(g, text) == want
    assert len(_allowed(g)) == 320 and not g.terminated  # the answer is free
    assert g.spent  # so the request drops it (Request.append_token)


def test_a_thinking_budget_with_a_constraint_after_it(compiler):
    g = compiler.compile(StructuredOutputs(regex="[0-9]+", reasoning_end="</think>"),
                         ThinkingBudget("</think>", 3))
    assert _run(g, "xyz!") == "xyz</think>"
    assert not g.spent  # the constraint still masks the answer
    assert {_BYTES.decode([t]) for t in _allowed(g)} == set("0123456789 \t\r\n")


@pytest.mark.parametrize("budget, spec, prefix, drafts", [
    (None, StructuredOutputs(regex="[0-9]+", reasoning_end="</think>"), "hm", "m.</think> 42"),
    (4, None, "ab", "cdef"),
    (4, None, "a", "b</think>"),
    (6, StructuredOutputs(choice=("yes", "no"), reasoning_end="</think>"), "", "abcdef</th"),
])
def test_draft_masks_are_the_masks_of_the_tokens_in_turn(compiler, budget, spec, prefix,
                                                         drafts):
    """A step's masks for a row's drafts (each position's mask as if the drafts before it
    had been generated) equal the masks met generating them one by one, and leave the
    request's state where it was: with a thinking budget, and after a constraint's thinking
    (llguidance cannot roll back a stop= lexeme; the thinking is a suffix= one)."""
    budget = None if budget is None else ThinkingBudget("</think>", budget)
    g, step = compiler.compile(spec, budget), compiler.compile(spec, budget)
    for t in ids(prefix):
        g.accept(t)
        step.accept(t)
    d = ids(drafts)
    rows = new_bitmask(len(d) + 1, 320)
    g.fill_drafts(rows, d)
    for j, t in enumerate(d):
        mask = _allowed(step)
        assert _allowed(None, rows[j]) == mask, j
        if t not in mask:  # rejected here: the positions after it allow everything
            assert all(len(_allowed(None, r)) == 320 for r in rows[j + 1:])
            break
        step.accept(t)
    for t in d:  # the real tokens arrive after the masks: g is where it started
        if t not in _allowed(g):
            break
        g.accept(t)


def test_a_thinking_budget_in_the_engine(tiny_llama_dir):
    """The first `budget` tokens are the model's own, then the end tag; the same tokens
    alone, among others with small steps, and with n-gram speculation (whose drafts the
    budget checks)."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    budget = ThinkingBudget("</think>", 6)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            thinking_budget=budget)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True,
                            thinking_budget=budget, structured_outputs=StructuredOutputs(
                                regex="[a-z ]+", reasoning_end="</think>"))
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = make_llm(tiny_llama_dir).generate([prompt] * 3, [greedy, seeded, free])
    first = alone[2].outputs[0]
    out = alone[0].outputs[0]
    assert out.token_ids[:6] == first.token_ids and "</think>" not in first.text
    assert out.text.startswith(first.text + "</think>")
    assert re.fullmatch(r"(?s)[^<]*.*?</think>[a-z ]*", alone[1].outputs[0].text)
    busy = make_llm(tiny_llama_dir, max_num_batched_tokens=16).generate(
        [[20, 21, 22] * 5, prompt, prompt],
        [SamplingParams(temperature=1.0, max_tokens=30), greedy, seeded])
    spec = make_llm(tiny_llama_dir, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    speculated = spec.generate([prompt, prompt], [greedy, seeded])
    want = [o.outputs[0].token_ids for o in alone[:2]]
    assert [o.outputs[0].token_ids for o in busy[1:]] == want
    assert [o.outputs[0].token_ids for o in speculated] == want
    spec.engine.check_integrity()
