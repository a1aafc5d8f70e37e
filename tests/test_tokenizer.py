"""Tests for kvserve.tokenizer: parity with transformers on the real SmolLM2 GGUF, chat templates,
streaming detokenization invariants, directory loading, and error messages."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.models.paths import DEFAULT_GGUF, default_model_path
from kvserve.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from tests.conftest import gguf_parsed_once

GGUF_PATH = default_model_path()
needs_model = pytest.mark.skipif(GGUF_PATH is None, reason=f"{DEFAULT_GGUF} is not installed")
real_model = [pytest.mark.real_model, needs_model]
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------- corpus

SCRIPTS = [
    "Hello, world! How are you today?",
    "Привет, мир! Как дела?",
    "你好，世界！今天天气很好。",
    "こんにちは世界、カタカナとひらがな。",
    "안녕하세요 세계",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "Γειά σου Κόσμε",
    "ğüşıöç ĞÜŞİÖÇ straße ÆØÅ",
    "∑∫√∞ ≤≥≠ ∂x/∂y",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝒮𝒸𝓇𝒾𝓅𝓉",
    "e\u0301 a\u0308 n\u0303",
    "zero\u200bwidth\ufeffbom\u00a0nbsp",
]
EMOJI = ["😀", "👨‍👩‍👧‍👦", "🇫🇷", "👍🏽", "🏳️‍🌈", "❤️", "🧑🏿‍💻", "😀😃😄", "☃"]
CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    '<div class="x">&amp; &lt;tag&gt;</div>',
    "SELECT * FROM t WHERE id IN (1, 2, 3);",
    "x =  12\ny\t=\t\t3.14159\n\n\n",
    "Steps:\n\n1. Do this\n2. Then that\n\n10. Done",
    "I'm sure it's they're we've you'll he'd I'M",
    "$ ls -la | grep '^d' && echo \"done\" > /dev/null 2>&1",
]
NUMBERS = ["0", "42", "3.14159", "1,000,000", "2024-01-01T12:00:00Z", "-7e-3", "١٢٣", "½ ⅓ ²"]
SPECIAL_TEXT = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>",
    "a<|im_end|>b",
    "<|im_start",
    "<|im_end|",
    "<file_sep><filename>main.py<gh_stars>10",
    "text <jupyter_code>print(1)<jupyter_output>1",
]
WHITESPACE = ["", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n \n", "\t\t  \n", "a  b", " a"]


def _corpus() -> list[str]:
    """A few hundred varied strings, the same every run."""
    rng = random.Random(20240601)
    fixed = SCRIPTS + EMOJI + CODE + NUMBERS + SPECIAL_TEXT + WHITESPACE
    fragments = fixed + [" ", "  ", "\n", "\t", "\n\n", "1", "23", " 4", "-", "'s", "…", "—"]
    generated = []
    for _ in range(260):
        parts = rng.choices(fragments, k=rng.randint(1, 6))
        seps = rng.choices(["", " ", "  ", "\n", "\t"], k=len(parts))
        generated.append("".join(p + s for p, s in zip(parts, seps, strict=True)))
    for _ in range(40):  # random code points from several blocks, including astral ones
        blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x400, 0x4FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F)]
        chars = []
        for _ in range(rng.randint(1, 20)):
            lo, hi = rng.choice(blocks)
            chars.append(chr(rng.randint(lo, hi)))
        generated.append("".join(chars))
    long_text = " ".join(SCRIPTS + CODE) * 20
    return fixed + generated + [long_text]


CORPUS = _corpus()

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "12"},
    ],
    [
        {"role": "system", "content": "Réponds en français 🇫🇷"},
        {"role": "user", "content": "Bonjour\n\nça va ?"},
        {"role": "assistant", "content": "Oui !"},
        {"role": "user", "content": "<|im_end|> sneaky"},
    ],
]


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    if GGUF_PATH is None:
        pytest.skip(f"{DEFAULT_GGUF} is not installed")
    return Tokenizer.from_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def ref() -> Any:
    """transformers' tokenizer for the same GGUF (loaded once: it takes seconds)."""
    if GGUF_PATH is None:
        pytest.skip(f"{DEFAULT_GGUF} is not installed")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(GGUF_PATH.parent,
                                                          gguf_file=GGUF_PATH.name)


@pytest.fixture(scope="module")
def interesting_ids(tok: Tokenizer) -> dict[str, list[int]]:
    """Ids that stress streaming: special ids, single raw bytes, and pieces of characters."""
    special = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    partial = []
    for i in range(tok.vocab_size):
        try:
            tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            partial.append(i)
    multibyte = tok.encode("".join(EMOJI) + "€ü你好 ğ 𝔘", add_special_tokens=False)
    return {"special": special, "partial": partial, "multibyte": multibyte}


@pytest.fixture
def smollm_split(ref: Any) -> Iterator[Any]:
    """The reference with llama.cpp's 'smollm' pre-tokenizer (digits split off first).

    transformers builds every 'gpt2' GGUF with the plain GPT-2 split, but llama.cpp -- and
    SmolLM2's own tokenizer.json -- split digits first, which changes e.g. "\\n\\n1" from
    [Ċ, Ċ, 1] to [ĊĊ, 1]. We follow the model; see test_smollm_digit_split.
    """
    from tokenizers import pre_tokenizers

    backend = ref.backend_tokenizer
    original = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    try:
        yield ref
    finally:
        backend.pre_tokenizer = original


# ---------------------------------------------------------------------- GGUF metadata


@pytest.mark.slow
@pytest.mark.real_model
@needs_model
def test_gguf_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.eos_token_ids == frozenset({2})
    assert tok.add_bos_token is False
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.is_special(0) and tok.is_special(2) and tok.is_special(16)
    assert not tok.is_special(17)


@pytest.mark.slow
@pytest.mark.real_model
@needs_model
def test_reuses_open_reader(tok: Tokenizer) -> None:
    assert GGUF_PATH is not None
    again = Tokenizer.from_gguf(GGUF_PATH, reader=gguf.GGUFReader(GGUF_PATH))
    assert again.encode(CORPUS[-1]) == tok.encode(CORPUS[-1])


# ---------------------------------------------------------------------- parity with transformers


@pytest.mark.slow
@pytest.mark.real_model
@needs_model
def test_encode_matches_transformers(tok: Tokenizer, smollm_split: Any) -> None:
    assert len(CORPUS) > 300
    for text in CORPUS:
        expected = smollm_split(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text, add_special_tokens=False) == expected, text
        assert tok.encode(text) == smollm_split(text)["input_ids"], text


@pytest.mark.real_model
@needs_model
def test_smollm_digit_split(tok: Tokenizer, ref: Any) -> None:
    # llama.cpp's "smollm" pre-tokenizer splits digits first, as the model was trained.
    ids = tok.encode("Steps:\n\n1. Do", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["Steps", ":", "ĊĊ", "1", ".", "ĠDo"]
    # Where no whitespace run precedes a digit, unpatched transformers agrees exactly too.
    for text in CORPUS:
        if not any(c.isspace() and n.isnumeric() for c, n in zip(text, text[1:], strict=False)):
            assert tok.encode(text) == ref(text)["input_ids"], text


@pytest.mark.real_model
@needs_model
@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen",
                                 "gpt-4o"])
def test_pre_tokenizer_splits_match_transformers(ref: Any, pre: str) -> None:
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from kvserve.tokenizer.vocab import byte_level_pre_tokenizer

    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:  # transformers keeps GPT2Tokenizer's default for this name
        expected = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        expected = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    ours = byte_level_pre_tokenizer(pre)
    for text in CORPUS:
        assert ours.pre_tokenize_str(text) == expected.pre_tokenize_str(text), text


@pytest.mark.real_model
@needs_model
def test_decode_matches_transformers(tok: Tokenizer, ref: Any) -> None:
    rng = random.Random(7)
    sequences = [tok.encode(text) for text in CORPUS]
    sequences += [
        [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 30))] for _ in range(200)
    ]
    sequences.append([0, 1, 2, 16, 17, 1, 2])
    for ids in sequences:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            ), ids
    for text in CORPUS:  # and decode(encode(text)) round-trips
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.real_model
@needs_model
def test_tokens_and_bytes(tok: Tokenizer, ref: Any) -> None:
    ids = list(range(0, tok.vocab_size, 97)) + [0, 1, 2, tok.vocab_size - 1]
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(2) == ["<|im_end|>"]
    for text in CORPUS[:120]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.token_bytes(tok.vocab_size + 5) == b""


@pytest.mark.real_model
@needs_model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, ref: Any, add_generation_prompt: bool
) -> None:
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == expected


CUSTOM_TEMPLATE = """\
{%- if tools %}Tools: {{ tools | tojson(indent=2) }}
{% endif -%}
{{ bos_token }}
{%- for m in messages %}
  {%- if m.role == 'bad' %}{{ raise_exception('role ' + m.role + ' is not allowed') }}{% endif %}
  {%- if loop.index > 10 %}{% break %}{% endif %}
  [{{ m.role }}] {% generation %}{{ m.content }}{% endgeneration %}
  {%- if m.tool_calls is defined %}
 calls={{ m.tool_calls | tojson(separators=(',', ':')) }}
  {%- endif %}
  {%- if m.reasoning_content is defined %} thought={{ m.reasoning_content }}{% endif %}
{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}[assistant]
  {%- if enable_thinking is defined %}{{ enable_thinking }}{% endif %}
{%- endif %}
{{- strftime_now('%Y') | length }}"""


@pytest.mark.real_model
@needs_model
def test_custom_template_matches_transformers(tok: Tokenizer, ref: Any) -> None:
    custom = Tokenizer(
        tok.backend,
        decode_kind=tok.decode_kind,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        chat_template=CUSTOM_TEMPLATE,
    )
    tools = [{"type": "function", "function": {"name": "f", "description": "é ünïcode"}}]
    messages = [
        {"role": "user", "content": 'Ça va? "quotes" <tags> & 😀'},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"name": "f", "arguments": {"x": "ü"}}],
            "reasoning_content": "hmm",
        },
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = ref.apply_chat_template(
            messages,
            chat_template=CUSTOM_TEMPLATE,
            tools=tools,
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )
        assert custom.apply_chat_template(messages, tools=tools, **kwargs) == expected
    with pytest.raises(ChatTemplateError, match="role bad is not allowed"):
        custom.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer(tok.backend, decode_kind="byte_level").apply_chat_template(CONVERSATIONS[0])


# ---------------------------------------------------------------------- streaming


def _stream(
    detok: IncrementalDetokenizer, ids: list[int], sizes: list[int], final_text: str
) -> str:
    """Feed ids in chunks of `sizes`, checking that the output only ever grows towards
    `final_text` (so no broken character or stop-string fragment is ever emitted)."""
    out, pos, i = "", 0, 0
    while pos < len(ids):
        size = sizes[i % len(sizes)] if sizes else len(ids)
        delta = detok.add_tokens(ids[pos : pos + size])
        pos, i, out = pos + size, i + 1, out + delta
        assert final_text.startswith(out), (out, final_text)
        assert detok.text == out
    out += detok.finish()
    assert detok.text == out
    return out


def _id_lists(tok_ids: dict[str, list[int]], vocab_size: int) -> st.SearchStrategy[list[int]]:
    one = st.one_of(
        st.integers(0, vocab_size - 1),
        st.sampled_from(tok_ids["partial"]),
        st.sampled_from(tok_ids["multibyte"]),
        st.sampled_from(tok_ids["special"]),
    )
    return st.lists(one, min_size=1, max_size=60)


@pytest.mark.slow
@pytest.mark.real_model
@needs_model
@pytest.mark.parametrize("decode_kind", ["byte_level", "text"])
def test_stream_equals_full_decode(
    tok: Tokenizer, interesting_ids: dict[str, list[int]], decode_kind: str
) -> None:
    # "text" exercises the generic U+FFFD-based hold-back on the same vocabulary.
    tokenizer = tok if decode_kind == "byte_level" else Tokenizer(tok.backend, decode_kind="text")

    @HYPOTHESIS
    @given(
        ids=_id_lists(interesting_ids, tok.vocab_size),
        sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8),
        skip=st.booleans(),
    )
    def check(ids: list[int], sizes: list[int], skip: bool) -> None:
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        assert _stream(detok, ids, sizes, expected) == expected
        assert not detok.stopped and detok.stop_reason is None

    check()
    # Plus longer seeded sequences than hypothesis tends to draw.
    rng = random.Random(11)
    pool = [i for group in interesting_ids.values() for i in group]
    for _ in range(150):
        ids = [
            rng.choice(pool) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(50, 150))
        ]
        sizes = [rng.randint(1, 4) for _ in range(5)]
        skip = rng.random() < 0.5
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        assert _stream(detok, ids, sizes, expected) == expected


@pytest.mark.real_model
@needs_model
def test_stream_holds_back_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("a😀b", add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert len(ids) >= 3 and pieces[0] == b"a"  # the emoji spans several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add_tokens([i]) for i in ids]
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == "a😀b"
    assert deltas[0] == "a" and "" in deltas  # something was held back mid-emoji
    # A character left unfinished at the end comes out as U+FFFD from finish(), like decode().
    detok = IncrementalDetokenizer(tok)
    assert detok.add_tokens(ids[:2]) == "a"
    assert detok.finish() == tok.decode(ids[:2])[1:]


@pytest.mark.real_model
@needs_model
def test_stream_window_stays_small(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    widths: list[int] = []
    decode = tok.decode

    def spy(ids: Any, skip_special_tokens: bool = True) -> str:
        widths.append(len(ids))
        return decode(ids, skip_special_tokens)

    ids = tok.encode(CORPUS[-1], add_special_tokens=False)
    assert len(ids) > 1000
    monkeypatch.setattr(tok, "decode", spy)
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.add_tokens([i])
    detok.finish()
    monkeypatch.undo()
    assert detok.text == tok.decode(ids)
    assert max(widths) <= 8  # O(1) work per token, not O(output length)


def _expected_stop(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Brute force: the first end position at which some stop string is complete."""
    for end in range(1, len(full) + 1):
        hits = [s for s in stops if s and full[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)  # same end: the earliest start
            return (full[:end] if include else full[: end - len(stop)]), stop
    return full, None


@pytest.mark.slow
@pytest.mark.real_model
@needs_model
def test_stop_strings_property(tok: Tokenizer, interesting_ids: dict[str, list[int]]) -> None:
    texts = [t for t in CORPUS if 0 < len(t) < 300]

    @HYPOTHESIS
    @given(
        text=st.sampled_from(texts),
        extra=_id_lists(interesting_ids, tok.vocab_size),
        cuts=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 6)), max_size=3),
        junk=st.lists(st.text(min_size=1, max_size=3), max_size=2),
        sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6),
        include=st.booleans(),
    )
    def check(
        text: str,
        extra: list[int],
        cuts: list[tuple[int, int]],
        junk: list[str],
        sizes: list[int],
        include: bool,
    ) -> None:
        ids = tok.encode(text, add_special_tokens=False) + extra
        full = tok.decode(ids)
        stops = [full[a % max(len(full), 1) :][:n] for a, n in cuts] + junk
        stops = [s for s in stops if s]
        expected, reason = _expected_stop(full, stops, include)
        detok = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include)
        assert _stream(detok, ids, sizes, expected) == expected
        assert detok.stop_reason == reason and detok.stopped == (reason is not None)

    check()


@pytest.mark.real_model
@needs_model
def test_stop_string_examples(tok: Tokenizer) -> None:
    def feed(detok: IncrementalDetokenizer, text: str) -> str:
        return "".join(detok.add_tokens([i]) for i in tok.encode(text, add_special_tokens=False))

    # Matched across token boundaries; the possible start "wor" is held back meanwhile.
    detok = IncrementalDetokenizer(tok, stop=["world"])
    assert feed(detok, "hello wor") == "hello "
    assert not detok.stopped
    assert feed(detok, "ld and more") == ""
    assert (detok.text, detok.stop_reason, detok.stopped) == ("hello ", "world", True)
    assert detok.add_tokens(tok.encode(" ignored")) == "" and detok.finish() == ""

    # Released once it can no longer be a stop string, or at finish().
    detok = IncrementalDetokenizer(tok, stop=["world"])
    assert feed(detok, "hello wor") + feed(detok, "m") == "hello worm"
    detok = IncrementalDetokenizer(tok, stop=["world"])
    assert feed(detok, "hello wor") + detok.finish() == "hello wor"
    assert detok.stop_reason is None

    # The earliest occurrence wins, whatever the order of the list.
    detok = IncrementalDetokenizer(tok, stop=["world", "lo w"])
    assert feed(detok, "hello world") + detok.finish() == "hel"
    assert detok.stop_reason == "lo w"

    # include_stop_str_in_output keeps the stop string, and nothing after it.
    detok = IncrementalDetokenizer(tok, stop=["o w"], include_stop_str_in_output=True)
    assert feed(detok, "hello world") + detok.finish() == "hello w"

    # Special tokens are skipped before matching, so they do not break up a stop string.
    detok = IncrementalDetokenizer(tok, stop=["ab"])
    assert detok.add_tokens(tok.encode("a<|im_end|>b", add_special_tokens=False)) == ""
    assert detok.stop_reason == "ab"


# ---------------------------------------------------------------------- directory loading


@pytest.mark.real_model
@needs_model
def test_from_dir_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": tok.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.vocab_size == tok.vocab_size
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)
    assert loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.decode_kind == "byte_level" and loaded.add_bos_token is False
    for text in CORPUS[::3]:
        ids = loaded.encode(text)
        assert ids == tok.encode(text)
        assert loaded.decode(ids, skip_special_tokens=False) == text
    assert loaded.token_bytes(ids[-1]) == tok.token_bytes(ids[-1])
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)

    # chat_template.jinja takes precedence over tokenizer_config.json.
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATIONS[2]) == "4"


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="unusable tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------- small synthetic GGUFs


def _write_gguf(path: Path, tokenizer_model: str | None, **extra: Any) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    if tokenizer_model is not None:
        writer.add_tokenizer_model(tokenizer_model)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPM_PIECES = [
    "▁", "e", "t", "a", "o", "h", "l", "r", "n", "▁t", "he", "▁the", "▁a", "in", "▁in", "er",
    "▁h", "▁he", "ll", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "an", "▁an", "nd",
    "▁and", "▁▁", "▁▁▁▁", "1", "2", "é", "▁é", "你",
]  # fmt: skip


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama-style (sentencepiece, byte fallback) GGUF."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    tokens.append("<tool>")
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0]
    path = tmp_path_factory.mktemp("spm") / "tiny.gguf"
    return _write_gguf(
        path,
        "llama",
        token_list=tokens,
        token_types=types,
        token_scores=scores,
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
        add_bos_token=True,
        add_space_prefix=True,
    )


SPM_TEXTS = [
    "hello world", " hello  world and the", "héllo 😀 wörld", "", "<s>hello</s> <tool>x",
    "123 abc\n\tend", "你好 the hello", "the    world   ", "a<unk>b",
]  # fmt: skip


def test_sentencepiece_gguf_matches_transformers(spm_gguf: Path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    ref = transformers.AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)
    spm = Tokenizer.from_gguf(spm_gguf)
    assert spm.decode_kind == "byte_fallback" and spm.add_bos_token
    for text in SPM_TEXTS:
        ids = spm.encode(text)
        assert ids == ref(text)["input_ids"], text
        for skip in (True, False):
            assert spm.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    assert spm.token_bytes(spm.token_to_id("<0xE4>")) == b"\xe4"
    assert spm.token_bytes(spm.token_to_id("▁hello")) == b" hello"


def test_sentencepiece_stream_equals_full_decode(spm_gguf: Path) -> None:
    spm = Tokenizer.from_gguf(spm_gguf)
    byte_ids = [spm.token_to_id(f"<0x{b:02X}>") for b in (0xE4, 0xBD, 0xA0, 0xC3, 0xA9, 0x80, 0x41)]
    assert None not in byte_ids

    @HYPOTHESIS
    @given(
        ids=st.lists(
            st.one_of(st.integers(0, spm.vocab_size - 1), st.sampled_from(byte_ids)), max_size=30
        ),
        sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6),
        skip=st.booleans(),
    )
    def check(ids: list[int], sizes: list[int], skip: bool) -> None:
        expected = spm.decode(ids, skip_special_tokens=skip)
        detok = IncrementalDetokenizer(spm, skip_special_tokens=skip)
        assert _stream(detok, ids, sizes, expected) == expected

    check()


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bert.gguf", "bert", token_list=["[PAD]", "a"])
    with pytest.raises(ValueError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_gguf(path)


def test_unusable_files(tmp_path: Path) -> None:
    no_tokenizer = _write_gguf(tmp_path / "none.gguf", None)
    with pytest.raises(ValueError, match="has no tokenizer"):
        Tokenizer.from_gguf(no_tokenizer)
    no_merges = _write_gguf(tmp_path / "nomerges.gguf", "gpt2", token_list=["a", "b"])
    with pytest.raises(ValueError, match="lacks tokenizer.ggml.merges"):
        Tokenizer.from_gguf(no_merges)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"definitely not a gguf file")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        Tokenizer.from_gguf(garbage)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


def test_unknown_pre_tokenizer_falls_back_to_gpt2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    letters = ["a", "b", "Ġ", "ab", "Ġab"]
    path = _write_gguf(
        tmp_path / "odd.gguf",
        "gpt2",
        token_list=letters,
        token_types=[1] * len(letters),
        token_merges=["a b", "Ġ ab"],
        tokenizer_pre="made-up",
    )
    with caplog.at_level("WARNING", logger="kvserve.tokenizer"):
        odd = Tokenizer.from_gguf(path)
    assert "made-up" in caplog.text
    assert odd.convert_ids_to_tokens(odd.encode("ab ab")) == ["ab", "Ġab"]


HOSTILE_TEMPLATES = {
    "python internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "a file": "{% include '/etc/passwd' %}",
    "an import": "{% import 'os' as os %}{{ os }}",
    "nested loops for ever": "{% for i in range(100000) %}{% for j in range(100000) %}"
                             "{% endfor %}{% endfor %}",
    "a huge range": "{% for i in range(10**9) %}{% endfor %}",
    "a huge string": "{{ 'a' * 10**9 }}",
    "a huge power": "{{ 10 ** 100000000 }}",
    "recursion": "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}",
    "growing numbers": "{% set x = namespace(v=3) %}{% for i in range(100000) %}"
                       "{% set x.v = x.v * x.v %}{% endfor %}{{ x.v }}",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_chat_templates_fail_clearly_and_quickly(name: str) -> None:
    import time

    from tokenizers import Tokenizer as HF

    from tests.conftest import byte_level_tokenizer_json

    t = Tokenizer(HF.from_str(byte_level_tokenizer_json()), decode_kind="byte_level",
                  bos_token_id=0, eos_token_id=1, chat_template=HOSTILE_TEMPLATES[name])
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError):
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 5
    t.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
