"""gpt-oss's text side in the tokenizer: the o200k pre-tokenizer split (GGUF pre "gpt-4o") on
strings whose split is worked out by hand, and harmony's end-of-generation tokens read from a
tiny GGUF vocabulary (no model needed)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer
from kvserve.tokenizer.vocab import CHAR_TO_BYTE, byte_level_pre_tokenizer
from tests.test_tokenizer import _write_gguf


def split(pre: str, text: str) -> list[str]:
    """`text` cut as the GGUF pre-tokenizer `pre` cuts it, each piece as text again (the
    byte-level step spells pieces in its byte alphabet)."""
    pieces = byte_level_pre_tokenizer(pre).pre_tokenize_str(text)
    return [bytes(CHAR_TO_BYTE[c] for c in p).decode("utf-8") for p, _ in pieces]


# (text, o200k's split): each worked out from the pattern's alternatives, in order.
O200K_CASES = [
    # A contraction stays on its word, in either case; an all-caps word takes it too.
    ("I'M don't", ["I'M", " don't"]),
    ("she'LL WE'VE", ["she'LL", " WE'VE"]),
    # A word ends where lower case turns to upper; a capital run followed by lower case
    # stays one piece ("HTTPServer": capitals, then the lower-case letters).
    ("CamelCase HTTPServer iPhone", ["Camel", "Case", " HTTPServer", " i", "Phone"]),
    # Numbers in runs of at most three digits, never joined to a leading space.
    ("12345 x1234567", ["123", "45", " x", "123", "456", "7"]),
    ("v2.0", ["v", "2", ".", "0"]),
    # Combining marks and caseless scripts stay inside words.
    ("e\u0301te\u0301 Привет 你好世界", ["e\u0301te\u0301", " Привет", " 你好世界"]),
    # A space before punctuation joins it; a punctuation run keeps trailing newlines and
    # slashes; a non-letter may lead a word ("/to").
    ("Hello , world !", ["Hello", " ,", " world", " !"]),
    ("path/to/file", ["path", "/to", "/file"]),
    ("x ...\n\ny", ["x", " ...\n\n", "y"]),
    ("}\n/", ["}\n/"]),
    # Whitespace: newline runs on their own, the last space of a run goes to the next word.
    ("a\n\nb\n  c", ["a", "\n\n", "b", "\n", " ", " c"]),
    ("   end  ", ["  ", " end", "  "]),
    ("'twas", ["'twas"]),
]


@pytest.mark.parametrize(("text", "expected"), O200K_CASES)
def test_o200k_split(text: str, expected: list[str]) -> None:
    assert split("gpt-4o", text) == expected
    assert "".join(expected) == text
    for alias in ("llama4", "kanana2", "minimax-m2"):  # llama.cpp's other names for it
        assert split(alias, text) == expected


@pytest.mark.parametrize(("text", "qwen2"), [
    ("I'M don't", ["I", "'M", " don", "'t"]),  # qwen2 splits contractions off
    ("CamelCase", ["CamelCase"]),  # and has no case rule
    ("12345", ["1", "2", "3", "4", "5"]),  # and splits every digit
    ("e\u0301te", ["e", "\u0301te"]),  # and cuts before a combining mark
    ("}\n/", ["}\n", "/"]),  # and keeps no slash after newlines
])
def test_o200k_differs_from_qwen2(text: str, qwen2: list[str]) -> None:
    assert split("qwen2", text) == qwen2
    assert split("gpt-4o", text) != qwen2


# ---------------------------------------------------------------------- harmony stops

HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
           "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
CONTROL = int(gguf.TokenType.CONTROL)


def harmony_gguf(path: Path, specials: list[str], **ids: int) -> Tokenizer:
    """A byte-level vocabulary (every byte, one merge) with `specials` as control tokens
    after it, and the given GGUF token ids (eos_token_id=..., eot_token_id=...)."""
    from kvserve.tokenizer.vocab import _byte_alphabet

    byte_tokens = list(_byte_alphabet().values())
    tokens = [*byte_tokens, "ab", *specials]
    types = [int(gguf.TokenType.NORMAL)] * (len(byte_tokens) + 1) + [CONTROL] * len(specials)
    _write_gguf(path, "gpt2", token_list=tokens, token_types=types, token_merges=["a b"],
                tokenizer_pre="gpt-4o", **ids)
    return Tokenizer.from_gguf(path)


def test_harmony_ends_at_return_and_call_not_end(tmp_path: Path) -> None:
    base = 257
    ids = {t: base + i for i, t in enumerate(HARMONY)}
    # As llama.cpp's converter writes gpt-oss: EOS <|return|>, no EOT.
    tok = harmony_gguf(tmp_path / "a.gguf", HARMONY, eos_token_id=ids["<|return|>"])
    assert tok.eos_token_ids == {ids["<|return|>"], ids["<|call|>"]}
    assert tok.eos_token_id == ids["<|return|>"]
    # A conversion that names <|end|> as EOS and EOT: it still ends only at the two.
    tok = harmony_gguf(tmp_path / "b.gguf", HARMONY, eos_token_id=ids["<|end|>"],
                       eot_token_id=ids["<|end|>"])
    assert tok.eos_token_ids == {ids["<|return|>"], ids["<|call|>"]}
    assert tok.eos_token_id == ids["<|return|>"]


def test_other_vocabularies_keep_their_end_tokens(tmp_path: Path) -> None:
    # Phi-3 style: <|end|> is its end of turn, and there is no <|call|>: untouched.
    specials = ["<|endoftext|>", "<|end|>", "<|return|>"]
    tok = harmony_gguf(tmp_path / "phi.gguf", specials, eos_token_id=257,
                       eot_token_id=258)
    assert tok.eos_token_ids == {257, 258}


def test_harmony_markers_are_single_tokens_kept_on_request(tmp_path: Path) -> None:
    tok = harmony_gguf(tmp_path / "h.gguf", HARMONY, eos_token_id=259)
    text = "<|channel|>final<|message|>ab<|return|>"
    ids = tok.encode(text, add_special_tokens=False)
    channel, message, ret = (tok.token_to_id(t) for t in ("<|channel|>", "<|message|>",
                                                          "<|return|>"))
    assert ids[0] == channel and ids[-1] == ret and message in ids
    assert tok.convert_ids_to_tokens(ids[-2]) == ["ab"]
    # Decoding keeps the markers only without skip_special_tokens, which the harmony
    # parsers therefore ask for; streamed the same way, token by token.
    assert tok.decode(ids, skip_special_tokens=True) == "finalab"
    assert tok.decode(ids, skip_special_tokens=False) == text
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(detok.add_tokens([i]) for i in ids) + detok.finish() == text
