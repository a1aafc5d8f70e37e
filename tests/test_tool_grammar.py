"""tool_choice auto's lazy grammar (chat_tools.tool_call_grammar): the output is free until the
model opens a call, and a call once opened is always a call of a declared function whose
arguments fit its schema. Checked on a byte-level tokenizer by walking the grammar's masks at
random (any sampler's path is one such walk) with hypothesis-drawn tools, and on a tiny
random model: the free text is the unconstrained text, alone, batched and speculated."""

from __future__ import annotations

import json
import keyword
import random

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvserve.entrypoints.server import harmony
from kvserve.entrypoints.server.chat_tools import tool_call_grammar
from kvserve.entrypoints.server.protocol import FunctionDefinition, Tool
from kvserve.entrypoints.server.tool_parsers import (
    TOOL_PARSERS,
    GptOssToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
)
from kvserve.sample.sampling_params import SamplingParams, StructuredOutputs
from kvserve.sample.structured import Grammar, GrammarCompiler, new_bitmask
from tests.conftest import byte_level_tokenizer_json, make_llm

_BYTES = Tokenizer.from_str(byte_level_tokenizer_json())
EOS = 1
BYTE_FF = _BYTES.token_to_id("\u00ff")  # the byte-level alphabet's character for byte 0xFF


def ids(text: str) -> list[int]:
    return _BYTES.encode(text, add_special_tokens=False).ids


def text_of(tokens: list[int]) -> str:
    return _BYTES.decode(tokens)


def allowed(g: Grammar) -> list[int]:
    row = new_bitmask(1, 320)[0]
    g.fill(row)
    bits = (row.unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten()[:320].nonzero().flatten().tolist()


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(byte_level_tokenizer_json(), 320, [EOS])


def tools_of(declared: list[tuple[str, dict]]) -> list[Tool]:
    return [Tool(type="function", function=FunctionDefinition(name=n, parameters=s))
            for n, s in declared]


_VALUE = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 99)),
    st.lists(st.sampled_from(["red", "green", "a b", 'q"t']), min_size=1, max_size=3,
             unique=True).map(lambda e: {"enum": e}),
    st.integers(1, 5).map(lambda n: {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}),
)
_SCHEMA = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), _VALUE,
                          max_size=3).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props),
                   "additionalProperties": False})
_TOOLS = st.lists(st.tuples(st.from_regex(r"[a-z][a-z_]{0,9}", fullmatch=True), _SCHEMA),
                  min_size=1, max_size=3, unique_by=lambda t: t[0])
_PROSE = st.text(alphabet="abc xyz.,!\n", max_size=24)


def walk(g: Grammar, rng: random.Random, until: str, limit: int = 600) -> str:
    """Tokens drawn at random from what the grammar allows, until `until` is written or
    the grammar allows the end; the text generated."""
    out: list[int] = []
    for _ in range(limit):
        tok = rng.choice(allowed(g))
        if tok == EOS:
            break
        g.accept(tok)
        out.append(tok)
        if until in text_of(out):
            break
    return text_of(out)


@settings(max_examples=40, deadline=None)
@given(declared=_TOOLS, prose=_PROSE, fence=st.booleans(), seed=st.integers(0, 2**16))
def test_a_hermes_call_once_opened_is_always_valid(compiler, declared, prose, fence, seed):
    schemas = dict(declared)
    g = compiler.compile(StructuredOutputs(
        grammar=tool_call_grammar(HermesToolParser, tools_of(declared))))
    # free text first: every token, the end included, but <s> (no text) and byte 0xFF
    # (never in UTF-8; llguidance marks special tokens with it)
    assert set(allowed(g)) >= set(range(1, 320)) - {BYTE_FF}
    opening, closing = ("```json", "\n```") if fence else ("<tool_call>", "\n</tool_call>")
    for t in ids(prose + opening):
        g.accept(t)
    assert EOS not in allowed(g)  # an opened call must be finished
    text = walk(g, random.Random(seed), closing)
    assert text.startswith("\n") and text.endswith(closing), text
    call = json.loads(text[1:-len(closing)])
    assert call["name"] in schemas
    jsonschema.validate(call["arguments"], schemas[call["name"]])
    parsed = HermesToolParser(list(schemas)).parse(prose + opening + text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == \
        [(call["name"], call["arguments"])]


@settings(max_examples=25, deadline=None)
@given(declared=_TOOLS, seed=st.integers(0, 2**16))
def test_a_llama3_answer_that_opens_a_brace_is_a_valid_call(compiler, declared, seed):
    schemas = dict(declared)
    g = compiler.compile(StructuredOutputs(
        grammar=tool_call_grammar(Llama3JsonToolParser, tools_of(declared))))
    assert set(allowed(g)) >= set(range(1, 320)) - {BYTE_FF}
    g.accept(ids("{")[0])
    rng = random.Random(seed)
    text = "{" + walk(g, rng, "\0")
    call = json.loads(text)
    jsonschema.validate(call["parameters"], schemas[call["name"]])
    assert Llama3JsonToolParser(list(schemas)).parse(text).tool_calls[0].name == call["name"]


@settings(max_examples=25, deadline=None)
@given(declared=_TOOLS, seed=st.integers(0, 2**16), pick=st.integers(0, 2))
def test_a_hermes_answer_that_opens_a_bare_call_is_a_valid_call(compiler, declared, seed,
                                                                 pick):
    """`{"name": "<declared>"` at the start opens a bare call, held like a tagged one; a JSON
    answer naming anything else stays free."""
    schemas = dict(declared)
    name = list(schemas)[pick % len(schemas)]
    grammar = tool_call_grammar(HermesToolParser, tools_of(declared))
    g = compiler.compile(StructuredOutputs(grammar=grammar))
    opening = '\n{"name": ' + json.dumps(name)
    for t in ids(opening):
        g.accept(t)
    text = opening + walk(g, random.Random(seed), "\0")
    call = json.loads(text)
    assert call["name"] == name
    jsonschema.validate(call["arguments"], schemas[name])
    parsed = HermesToolParser(list(schemas)).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == \
        [(name, call["arguments"])]
    free = compiler.compile(StructuredOutputs(grammar=grammar))
    for t in ids('{"name": "' + "Q" * 11 + '", "age": '):
        free.accept(t)
    assert set(allowed(free)) >= set(range(1, 320)) - {BYTE_FF}


@settings(max_examples=40, deadline=None)
@given(declared=_TOOLS, prose=_PROSE, seed=st.integers(0, 2**16))
def test_a_qwen3_coder_call_once_opened_is_always_valid(compiler, declared, prose, seed):
    """The XML form: a declared function, its parameters in the schema's order, each value
    of its schema's type; the parser types them back into arguments that fit the schema."""
    schemas = dict(declared)
    g = compiler.compile(StructuredOutputs(
        grammar=tool_call_grammar(Qwen3CoderToolParser, tools_of(declared))))
    assert set(allowed(g)) >= set(range(1, 320)) - {BYTE_FF}
    for t in ids(prose + "<tool_call>"):
        g.accept(t)
    assert EOS not in allowed(g)
    text = walk(g, random.Random(seed), "</tool_call>")
    assert text.startswith("\n<function=") and text.endswith("</function>\n</tool_call>")
    parsed = Qwen3CoderToolParser(list(schemas), schemas).parse(prose + "<tool_call>" + text)
    (c,) = parsed.tool_calls
    jsonschema.validate(json.loads(c.arguments), schemas[c.name])
    streamed = Qwen3CoderToolParser(list(schemas), schemas)
    for ch in prose + "<tool_call>" + text:
        streamed.feed(ch)
    streamed.finish()
    assert [(s.name, s.arguments) for s in streamed.tool_calls()] == [(c.name, c.arguments)]
    assert streamed.broken == []


@settings(max_examples=30, deadline=None)
@given(declared=_TOOLS, seed=st.integers(0, 2**16), pick=st.integers(0, 2))
def test_a_pythonic_list_once_opened_is_valid_calls(compiler, declared, seed, pick):
    """`[` and a declared function's call open a list of calls, keywords held to their
    schemas; `[` before anything else stays free."""
    schemas = dict(declared)
    # Python keywords (`if`, `as`) cannot be a call's name or keyword: left out.
    callable_ = [n for n, sc in declared if not keyword.iskeyword(n)
                 and not any(keyword.iskeyword(k) for k in sc["required"])]
    grammar = tool_call_grammar(PythonicToolParser, tools_of(declared))
    if not callable_:
        assert grammar is None
        return
    name = callable_[pick % len(callable_)]
    g = compiler.compile(StructuredOutputs(grammar=grammar))
    assert set(allowed(g)) >= set(range(1, 320)) - {BYTE_FF}
    for t in ids("[" + name + "("):
        g.accept(t)
    assert EOS not in allowed(g)
    text = "[" + name + "(" + walk(g, random.Random(seed), "\0")
    calls = PythonicToolParser(list(schemas)).parse(text).tool_calls
    assert calls and calls[0].name == name, text
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), schemas[c.name])
    free = compiler.compile(StructuredOutputs(grammar=grammar))
    for t in ids("[1] See "):
        free.accept(t)
    assert set(allowed(free)) >= set(range(1, 320)) - {BYTE_FF}


# Forms without a grammar when the vocabulary's ids of their control tokens are not given:
# harmony's messages are made of them (channels, <|end|>, <|start|>), so its grammar names
# them by id (test_a_harmony_call_once_opened_is_always_valid).
NO_GRAMMAR = {"gpt-oss"}


def test_every_form_has_a_grammar():
    f = {"f": {"type": "object"}}
    assert all((cls.lazy_grammar(f) is None) == (cls.name in NO_GRAMMAR)
               for cls in TOOL_PARSERS.values())


def walk_ids(g: Grammar, size: int, rng: random.Random, out: list[int],
             ends: tuple[int, ...] = (), limit: int = 800) -> None:
    """Tokens of a `size` vocabulary drawn at random from what the grammar allows, appended
    to `out` until EOS (left out) or one of `ends` (kept: a generation's last token)."""
    for _ in range(limit):
        row = new_bitmask(1, size)[0]
        g.fill(row)
        bits = ((row.unsqueeze(-1) >> torch.arange(32)) & 1).flatten()[:size]
        t = rng.choice(bits.nonzero().flatten().tolist())
        if t == EOS:
            return
        out.append(t)
        if t in ends:
            return
        g.accept(t)


def mistral_tokenizer(*special: str) -> tuple[Tokenizer, GrammarCompiler]:
    """The byte-level tokenizer with Mistral's control tokens added as special tokens."""
    tok = Tokenizer.from_str(byte_level_tokenizer_json())
    tok.add_special_tokens(list(special))
    size = tok.get_vocab_size()
    return tok, GrammarCompiler(tok.to_str(), size, [EOS])


@settings(max_examples=20, deadline=None)
@given(declared=_TOOLS, prose=_PROSE, seed=st.integers(0, 2**16),
       form=st.sampled_from(["v11", "v3", "text"]))
def test_a_mistral_call_once_opened_is_always_valid(declared, prose, seed, form):
    """Mistral's marker is a control token (`<[id]>` in the grammar) where the vocabulary
    has it, else text; `name[ARGS]{...}` calls where [ARGS] is a token too (v11), else one
    JSON array (v3). Either way the text, decoded keeping special tokens, parses to calls of
    declared functions valid against their schemas."""
    schemas = dict(declared)
    special = {"v11": ("[TOOL_CALLS]", "[ARGS]"), "v3": ("[TOOL_CALLS]",), "text": ()}[form]
    tok, compiler = mistral_tokenizer(*special)
    token_ids = {t: tok.token_to_id(t) for t in special}
    g = compiler.compile(StructuredOutputs(grammar=tool_call_grammar(
        MistralToolParser, tools_of(declared), token_ids)))
    size = tok.get_vocab_size()
    opening = [token_ids["[TOOL_CALLS]"]] if special else \
        tok.encode("[TOOL_CALLS]", add_special_tokens=False).ids
    out = tok.encode(prose, add_special_tokens=False).ids + opening
    for t in out:
        g.accept(t)
    walk_ids(g, size, random.Random(seed), out)
    text = tok.decode(out, skip_special_tokens=False)
    parsed = MistralToolParser(list(schemas)).parse(text)
    assert parsed.tool_calls, text
    for c in parsed.tool_calls:
        jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_free_text_is_the_unconstrained_text(tiny_llama_dir):
    """Before a call opens, the lazy grammar masks only what it cannot write as text (here
    the byte 0xFF; with Qwen2.5's vocabulary, that one token and nothing else): a greedy
    answer is the same tokens with and without it. Under it, a seeded sample and a greedy
    answer are the same tokens alone, batched among others and with n-gram speculation
    (whose drafts the grammar checks). (A random model does not open a call: that is
    asserted, so the comparisons cover whole outputs.)"""
    tools = tools_of([("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]})])
    lazy = StructuredOutputs(grammar=tool_call_grammar(HermesToolParser, tools))
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [40, 41, 42], [100, 101]]

    def params(constraint):
        return [SamplingParams(temperature=0.9, seed=5, max_tokens=60,
                               structured_outputs=constraint),
                *[SamplingParams(temperature=0, max_tokens=60,
                                 structured_outputs=constraint)] * 2]

    free = make_llm(tiny_llama_dir).generate(prompts, params(None))
    alone = make_llm(tiny_llama_dir).generate(prompts, params(lazy))
    for o in free + alone:
        assert "<tool_call>" not in o.outputs[0].text and "```" not in o.outputs[0].text
    greedy_free = [o.outputs[0].token_ids for o in free[1:]]
    assert all(BYTE_FF not in t for t in greedy_free)
    assert [o.outputs[0].token_ids for o in alone[1:]] == greedy_free
    want = [o.outputs[0].token_ids for o in alone]
    others = [[i, i + 1, i + 2] * 5 for i in range(20, 24)]
    busy = make_llm(tiny_llama_dir, max_num_batched_tokens=16).generate(
        [*others[:2], *prompts, *others[2:]],
        [SamplingParams(temperature=1.0, max_tokens=30)] * 2 + params(lazy)
        + [SamplingParams(temperature=1.0, max_tokens=30)] * 2)
    spec = make_llm(tiny_llama_dir, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    speculated = spec.generate(prompts, params(lazy))
    assert [o.outputs[0].token_ids for o in busy[2:5]] == want
    assert [o.outputs[0].token_ids for o in speculated] == want
    spec.engine.check_integrity()


def harmony_tokenizer() -> tuple[Tokenizer, GrammarCompiler, dict[str, int]]:
    """The byte-level tokenizer with harmony's markers added as special tokens; `<|return|>`
    and `<|call|>` end a generation, as they do gpt-oss's."""
    tok = Tokenizer.from_str(byte_level_tokenizer_json())
    tok.add_special_tokens(list(harmony.MARKERS))
    ids = {m: tok.token_to_id(m) for m in harmony.MARKERS}
    eos = [EOS, ids[harmony.RETURN], ids[harmony.CALL]]
    return tok, GrammarCompiler(tok.to_str(), tok.get_vocab_size(), eos), ids


@settings(max_examples=25, deadline=None)
@given(declared=_TOOLS, prose=_PROSE, seed=st.integers(0, 2**16),
       header=st.sampled_from(["<|channel|>commentary to=functions.", " to=functions.",
                               "<|start|>assistant<|channel|>commentary to=functions."]))
def test_a_harmony_call_once_opened_is_always_valid(declared, prose, seed, header):
    """gpt-oss's calls: free messages (their bodies may name `to=functions.` freely), then a
    header that names a function opens a call, and from there the text, decoded keeping
    the markers, parses to a call of a declared function valid against its schema."""
    schemas = dict(declared)
    tok, compiler, token_ids = harmony_tokenizer()
    g = compiler.compile(StructuredOutputs(grammar=tool_call_grammar(
        GptOssToolParser, tools_of(declared), token_ids)))
    size = tok.get_vocab_size()
    before = (f"<|channel|>analysis<|message|>{prose} to=functions.x {prose}<|end|>"
              if header.startswith("<|start|>") else "")
    out = tok.encode(before + header, add_special_tokens=False).ids
    for t in out:
        g.accept(t)
    walk_ids(g, size, random.Random(seed), out,
             ends=(token_ids[harmony.RETURN], token_ids[harmony.CALL]))
    text = tok.decode(out, skip_special_tokens=False)
    calls = GptOssToolParser(list(schemas)).parse(text).tool_calls
    assert len(calls) == 1, text
    jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])


def test_harmony_free_text_stays_free():
    """Without a call: messages and their markers, a plain answer, and `to=functions.` in a
    body, all as the model writes them."""
    tok, compiler, token_ids = harmony_tokenizer()
    grammar = tool_call_grammar(GptOssToolParser, tools_of([("f", {"type": "object"})]),
                                token_ids)
    assert GptOssToolParser.lazy_grammar({"f": {}}) is None  # no markers: no grammar
    for text in ["<|channel|>analysis<|message|>I could call to=functions.f here.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>No call needed.<|return|>",
                 "<|channel|>analysis<|message|>I could call to=functions.f here.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>No call needed.<|return|>",
                 "Just an answer, no format at all.",
                 "<|channel|>commentary<|message|>A preamble.<|end|><|start|>assistant"
                 "<|channel|>final<|message|>Done"]:
        g = compiler.compile(StructuredOutputs(grammar=grammar))
        for t in tok.encode(text, add_special_tokens=False).ids:
            assert g.matcher.validate_tokens([t]) == 1, (text, tok.decode([t]))
            if t not in (token_ids[harmony.RETURN], token_ids[harmony.CALL]):
                g.accept(t)
