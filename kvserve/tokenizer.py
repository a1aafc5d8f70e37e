"""Tokenization: text <-> ids, chat templates, and streaming detokenization.

The tokenizer is a Hugging Face `tokenizers.Tokenizer` that we assemble ourselves, either from the
metadata of a GGUF file (`Tokenizer.from_gguf`) or from a Hugging Face style model directory
(`Tokenizer.from_dir`). transformers is deliberately not used at runtime: it is slow to import and
we only need a small part of it.

`IncrementalDetokenizer` turns the ids a request generates into text deltas for streaming, without
ever emitting half a UTF-8 character or any part of a stop string.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import __version__ as tokenizers_version

from kvserve.disk_cache import (
    cache_root,
    entry_name,
    model_fingerprint,
    read_entry,
    sources_digest,
    write_entry,
)
from kvserve.gguf_reader import open_gguf

logger = logging.getLogger(__name__)

# How token ids turn back into bytes, which decides how streaming detects an unfinished character:
#   byte_level:    GPT-2 style byte-level BPE; every token spells bytes in a printable alphabet.
#   byte_fallback: sentencepiece style; "<0xNN>" tokens carry single bytes, "▁" is a space.
#   text:          anything else; tokens are text and we only see "\ufffd" when bytes are missing.
DecodeKind = Literal["byte_level", "byte_fallback", "text"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map.

    Printable Latin-1 bytes stand for themselves; the remaining 68 bytes (controls, space, ...)
    are given the characters from U+0100 upwards, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    for offset, b in enumerate(shifted):
        table[b] = chr(0x100 + offset)
    return table


_BYTE_TO_CHAR = _byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


# Pre-tokenizer split patterns, named by GGUF's `tokenizer.ggml.pre` (llama.cpp's names).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "gpt2": the GPT-2 regex (built into tokenizers' ByteLevel). "digits": every digit on its own
# first, then the GPT-2 regex -- llama.cpp's rule for these vocabularies, and what their own
# tokenizer.json files do (SmolLM's has a Digits(individual_digits) step).
_PRE_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(("gpt2", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"), "digits"
    ),
    **dict.fromkeys(("llama3", "llama-bpe", "llama-v3", "falcon3", "smaug-bpe", "dbrx"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), "qwen2"),
}
_SPLITS = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    kind = _PRE_TOKENIZERS.get(pre or "")
    if kind is None:
        logger.warning("unknown GGUF pre-tokenizer %r; falling back to the GPT-2 split", pre)
        kind = "gpt2"
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "gpt2":
        return gpt2
    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLITS[kind]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class ChatTemplateError(ValueError):
    """A chat template refused its input (its `raise_exception`) or failed to render."""


class Tokenizer:
    """Text <-> token ids for one model.

    Invariants:
      * `encode(text, add_special_tokens=False)` never adds tokens; special tokens written in the
        text (e.g. "<|im_start|>") are recognised and become their single id.
      * `decode(ids, skip_special_tokens=True)` drops exactly the ids for which `is_special` holds.
      * `token_bytes(id)` are the bytes that id contributes to a decode (before UTF-8 decoding).
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        decode_kind: DecodeKind,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.decode_kind: DecodeKind = decode_kind
        added = backend.get_added_tokens_decoder()
        self.vocab_size: int = max(
            backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1
        )
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        eos = {eos_token_id} if eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | set(extra_eos_token_ids))
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        self._bytes_cache: dict[int, bytes] = {}

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_gguf(
        cls, path: str | os.PathLike[str], reader: gguf.GGUFReader | None = None
    ) -> Tokenizer:
        """Build the tokenizer a GGUF file describes ("gpt2" byte-level BPE or "llama" SPM).

        What is built is kept in the start-up cache (kvserve.disk_cache) under the file's
        fingerprint: the next start reads it back (tokenizers' own JSON) without parsing the
        file's metadata or assembling the vocabulary again."""
        path = Path(path)
        cached = _GGUFTokenizerCache.at(path)
        if cached is not None and (hit := cached.load()) is not None:
            backend, kwargs = hit
            return cls(backend, **kwargs)
        if reader is None:
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file not found: {path}")
            try:
                reader = open_gguf(path)
            except Exception as exc:  # the reader raises assorted errors on garbage
                raise ValueError(f"{path}: not a readable GGUF file ({exc})") from exc
        meta = _GGUFMeta(reader, path)

        model = meta.get("tokenizer.ggml.model", str)
        if model is None:
            raise ValueError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.model missing)")
        tokens = meta.require("tokenizer.ggml.tokens", list)
        if not tokens or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"{path}: tokenizer.ggml.tokens must be a non-empty list of strings")
        types = meta.get("tokenizer.ggml.token_type", list) or [gguf.TokenType.NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.token_type length does not match the tokens")

        def token_id(key: str) -> int | None:
            value = meta.get(key, int)
            if value is not None and not 0 <= value < len(tokens):
                logger.warning("%s: ignoring out-of-range %s=%d", path, key, value)
                return None
            return value

        bos, eos, unk = (
            token_id(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown")
        )
        if model == "gpt2":
            merges = meta.require("tokenizer.ggml.merges", list)
            backend = _byte_level_bpe(tokens, types, merges, meta.get("tokenizer.ggml.pre", str))
            decode_kind: DecodeKind = "byte_level"
            add_bos_default = False
        elif model == "llama":
            scores = meta.get("tokenizer.ggml.scores", list)
            if scores is not None and len(scores) != len(tokens):
                raise ValueError(f"{path}: tokenizer.ggml.scores length does not match the tokens")
            add_prefix = meta.get("tokenizer.ggml.add_space_prefix", bool) is not False
            backend = _sentencepiece_bpe(tokens, types, scores, unk, add_prefix_space=add_prefix)
            decode_kind = "byte_fallback"
            add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
        else:
            raise ValueError(
                f"{path}: unsupported tokenizer model {model!r} (supported: 'gpt2', 'llama')"
            )

        add_bos = meta.get("tokenizer.ggml.add_bos_token", bool)
        extra_eos = (token_id(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom"))
        kwargs: dict[str, Any] = dict(
            decode_kind=decode_kind,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_token_ids=[i for i in extra_eos if i is not None],
            pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
            add_bos_token=add_bos_default if add_bos is None else add_bos,
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", bool)),
            chat_template=meta.get("tokenizer.chat_template", str),
        )
        if cached is not None:
            cached.save(backend, kwargs)
        return cls(backend, **kwargs)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a model: a GGUF file or a Hugging Face style directory."""
        return cls.from_dir(path) if Path(path).is_dir() else cls.from_gguf(path)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face style directory: tokenizer.json plus the optional
        tokenizer_config.json, chat_template.jinja / chat_template.json, generation_config.json."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{root}: no tokenizer.json in this directory")
        try:
            spec = json.loads(tokenizer_file.read_text(encoding="utf-8"))
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise ValueError(f"{tokenizer_file}: unusable tokenizer.json ({exc})") from exc
        config = _read_json(root / "tokenizer_config.json")

        # Named special tokens are special even if tokenizer.json forgot to say so, as in
        # transformers, so that decode skips them and encode keeps them whole.
        named = {k: _token_content(config.get(f"{k}_token")) for k in ("bos", "eos", "unk", "pad")}
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in named.values() if t]
        )

        def token_id(name: str) -> int | None:
            content = named[name]
            return backend.token_to_id(content) if content else None

        generation = _read_json(root / "generation_config.json")
        gen_eos = generation.get("eos_token_id")
        gen_eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        eos = token_id("eos")
        if eos is None and gen_eos_ids:
            eos = gen_eos_ids[0]

        bos = token_id("bos")
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No explicit flag: the tokenizer.json post-processor decides, as in transformers.
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and with_special[:1] == [bos]
        return cls(
            backend,
            decode_kind=_decode_kind(spec.get("decoder")),
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_token_ids=[i for i in gen_eos_ids if isinstance(i, int)],
            pad_token_id=token_id("pad"),
            add_bos_token=bool(add_bos),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=_dir_chat_template(root, config),
        )

    # ------------------------------------------------------------------ encode / decode

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. to save it as tokenizer.json)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; with add_special_tokens, BOS/EOS as the model asks for them."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`. Unknown ids are ignored; incomplete UTF-8 becomes U+FFFD."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int] | int) -> list[str]:
        """Raw vocabulary strings (e.g. "Ġhello"); "" for ids the tokenizer does not know."""
        if isinstance(ids, int):
            ids = [ids]
        return [(self._backend.id_to_token(int(i)) if i >= 0 else None) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether decode(..., skip_special_tokens=True) drops this id."""
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes this token stands for (b"" for unknown ids).

        Not necessarily valid UTF-8 on its own: byte-level BPE splits characters across tokens.
        """
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._compute_token_bytes(token_id)
        return cached

    def _compute_token_bytes(self, token_id: int) -> bytes:
        token = self._backend.id_to_token(token_id) if token_id >= 0 else None
        if token is None:
            return b""
        if self.decode_kind == "byte_level":
            try:
                return bytes(_CHAR_TO_BYTE[c] for c in token)
            except KeyError:  # not spelled in the byte alphabet: an added token, taken verbatim
                return token.encode("utf-8")
        if self.decode_kind == "byte_fallback":
            if match := _BYTE_TOKEN.fullmatch(token):
                return bytes([int(match.group(1), 16)])
            return token.replace(_SPM_SPACE, " ").encode("utf-8")
        return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the model's chat template, with the variables Hugging Face templates expect.

        Extra kwargs become template variables (e.g. `enable_thinking=False`) and override the
        special-token strings. Raises ChatTemplateError (a ValueError) if the template rejects
        the conversation, ValueError if the model has no template.
        """
        if self.chat_template is None:
            raise ValueError("model has no chat template; send a completion prompt instead")
        template = _compile_chat_template(self.chat_template)
        variables: dict[str, Any] = {"documents": None}
        named_ids = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        named_ids["pad_token"] = self.pad_token_id
        for name, token_id in named_ids.items():
            if token_id is not None:
                variables[name] = self._backend.id_to_token(token_id)
        variables.update(kwargs)
        _render_budget.deadline = time.monotonic() + RENDER_SECONDS
        try:
            return template.render(
                messages=[_template_message(m) for m in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.TemplateError, TypeError, ValueError, OverflowError,
                RecursionError) as exc:
            # Sandbox refusals, the render budget, and templates that misuse values or ask
            # for files (no loader): the template's fault, never the server's.
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
        finally:
            _render_budget.deadline = None


# ---------------------------------------------------------------------- GGUF helpers


class _GGUFMeta:
    """Typed access to GGUF key/values; every problem becomes a ValueError naming the file."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self._reader = reader
        self._path = path

    def get(self, key: str, kind: type) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return None
        try:
            value = _field_value(field)
        except (IndexError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self._path}: malformed GGUF field {key} ({exc})") from exc
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise ValueError(
                f"{self._path}: GGUF field {key} should be {kind.__name__}, "
                f"got {type(value).__name__}"
            )
        return value

    def require(self, key: str, kind: type) -> Any:
        value = self.get(key, kind)
        if value is None:
            raise ValueError(f"{self._path}: GGUF file lacks {key}")
        return value


def _field_value(field: gguf.ReaderField) -> Any:
    # Reading parts directly: ReaderField.contents() is ~100x slower on 50k-entry arrays.
    kind = field.types[0] if field.types else None
    if kind == gguf.GGUFValueType.ARRAY:
        element = field.types[1] if len(field.types) > 1 else None
        if element == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if element == gguf.GGUFValueType.ARRAY:
            raise ValueError("nested arrays are not supported")
        return [v.item() for i in field.data for v in field.parts[i]]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0].item()


def _is_byte_spelled(token: str) -> bool:
    return all(c in _CHAR_TO_BYTE for c in token)


def _register_added_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    # CONTROL (and UNKNOWN) tokens are special: matched whole in text, skipped on decode.
    # USER_DEFINED tokens (e.g. "<think>") are matched whole but kept on decode, as llama.cpp
    # and transformers do.
    special_types = (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN)
    special = [t for t, k in zip(tokens, types, strict=True) if k in special_types and t]
    user = [t for t, k in zip(tokens, types, strict=True) if k == gguf.TokenType.USER_DEFINED and t]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


@dataclass(frozen=True)
class _GGUFTokenizerCache:
    """One GGUF file's tokenizer in the start-up cache: a line of JSON (the fingerprint, the
    Tokenizer's other arguments, the length and CRC-32 of what follows) and then the backend
    as tokenizers' JSON. The fingerprint covers the file, this module's source and tokenizers'
    version; an entry that fails any check is rebuilt with a warning."""

    path: Path
    header: dict[str, Any]

    @classmethod
    def at(cls, model: Path) -> _GGUFTokenizerCache | None:
        root = cache_root()
        if root is None:
            return None
        try:
            header = {"format": 1, "model": model_fingerprint(model),
                      "tokenizers": tokenizers_version, "code": sources_digest([Path(__file__)])}
        except OSError:  # a missing file: from_gguf says so
            return None
        name = entry_name(model, header["model"]["path"], header)
        return cls(root / "tokenizers" / f"{name}.json", header)

    def load(self) -> tuple[HFTokenizer, dict[str, Any]] | None:
        data = read_entry(self.path, "tokenizer")
        if data is None:
            return None
        try:
            line, _, body = data.partition(b"\n")
            meta = json.loads(line)
            if meta.get("header") != self.header:
                raise ValueError("its fingerprint does not match")
            if len(body) != meta["bytes"] or zlib.crc32(body) != meta["crc"]:
                raise ValueError("truncated or damaged")
            return HFTokenizer.from_str(body.decode()), meta["kwargs"]
        except Exception as exc:  # anything unexpected in the entry: build anew
            logger.warning("tokenizer cache: %s is unusable (%s); rebuilding it", self.path.name,
                           exc)
            return None

    def save(self, backend: HFTokenizer, kwargs: dict[str, Any]) -> None:
        body = backend.to_str().encode()
        line = json.dumps({"header": self.header, "kwargs": kwargs, "bytes": len(body),
                           "crc": zlib.crc32(body)}).encode()
        write_entry(self.path, line + b"\n" + body, "tokenizer")


def _byte_level_bpe(
    tokens: list[str], types: list[int], merges: list[str], pre: str | None
) -> HFTokenizer:
    plain = (gguf.TokenType.NORMAL, gguf.TokenType.BYTE, gguf.TokenType.UNUSED)
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        # A plain token is always spelled in the byte alphabet; respell any that a converter
        # wrote as raw text so BPE can reach it.
        if kind in plain and not _is_byte_spelled(token):
            token = "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))
        vocab[token] = i
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ValueError("tokenizer.ggml.merges entries must be two tokens separated by a space")
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _register_added_tokens(backend, tokens, types)
    return backend


def _sentencepiece_bpe(
    tokens: list[str],
    types: list[int],
    scores: list[float] | None,
    unk: int | None,
    *,
    add_prefix_space: bool,
) -> HFTokenizer:
    """SentencePiece BPE with byte fallback, as llama/mistral GGUFs describe it.

    The file has scores instead of merges. SentencePiece merges the adjacent pair whose union has
    the highest score, which is BPE with merges ranked by the merged piece's score.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    if scores is None:
        scores = [-float(i) for i in range(len(tokens))]
    mergeable = {
        t
        for t, k in zip(tokens, types, strict=True)
        if k in (gguf.TokenType.NORMAL, gguf.TokenType.USER_DEFINED)
    }
    ranked: list[tuple[float, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        if token not in mergeable:
            continue
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = [(a, b) for a, b in splits if a in mergeable and b in mergeable]
        splits.sort(key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
        ranked.extend((score, a, b) for a, b in splits)
    # Best score first; among equal scores the longer left piece, then the longer right piece
    # (transformers' order, so that ties break the same way). sort() is stable.
    ranked.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for _, a, b in ranked],
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _register_added_tokens(backend, tokens, types)
    return backend


# ---------------------------------------------------------------------- directory helpers


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _decode_kind(decoder: Any) -> DecodeKind:
    steps = decoder.get("decoders") or [] if isinstance(decoder, dict) else []
    names = {d.get("type") for d in [decoder, *steps] if isinstance(d, dict)}
    if "ByteLevel" in names:
        return "byte_level"
    if "ByteFallback" in names:
        return "byte_fallback"
    return "text"


def _dir_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    # Newer checkpoints keep the template in its own file, which then takes precedence.
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(root / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------------- chat template helpers


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    # Like transformers: keys set to None are dropped (OpenAI clients send content=None with
    # tool calls, and templates test for presence), and reasoning is visible under the names
    # templates read it by.
    message = {k: v for k, v in message.items() if v is not None}
    reasoning_keys = ("reasoning_content", "thinking", "reasoning")
    reasoning = next((message[k] for k in reasoning_keys if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and takes no json.dumps options; HF templates need both.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in some
    HF templates; for rendering it is a no-op around its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# A chat template comes with the model file: it renders in jinja2's immutable sandbox (no
# attributes of Python internals, no file access: there is no loader), within a time budget
# and with bounded string and list products, so a hostile one fails its request clearly.
RENDER_SECONDS = 1.0
MAX_PRODUCT = 1 << 20  # elements of a repeated string or list
_render_budget = threading.local()


def _check_budget() -> None:
    deadline = getattr(_render_budget, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise ChatTemplateError(f"chat template took over {RENDER_SECONDS:g} s to render")


def _bounded_range(*args: int) -> Iterator[int]:
    """range() for templates: the sandbox's size cap, and the render budget checked as the
    loop runs (nested loops cannot run for ever)."""
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise ChatTemplateError(f"chat template asked for a range over {MAX_RANGE} items")
    for i, x in enumerate(r):
        if i % 1024 == 0:
            _check_budget()
        yield x


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_budget()
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise ChatTemplateError("chat template raised a number to a power over 64")
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, str | list | tuple) and isinstance(times, int) and \
                    len(seq) * times > MAX_PRODUCT:
                raise ChatTemplateError(f"chat template built a sequence over {MAX_PRODUCT} "
                                        "items")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_budget()
        return super().call(__context, __obj, *args, **kwargs)


@functools.cache
def _template_environment() -> ImmutableSandboxedEnvironment:
    env = _TemplateEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.globals["range"] = _bounded_range
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile_chat_template(source: str) -> jinja2.Template:
    try:
        return _template_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template: {exc}") from exc


# ---------------------------------------------------------------------- streaming


def _incomplete_utf8_tail(data: bytes) -> bool:
    """Whether `data` ends in the valid beginning of a multi-byte character that more bytes could
    complete. Any other ending (complete, or definitively invalid) decodes the same whatever
    follows, so it is safe to emit."""
    tail = data[-4:]
    for start in range(len(tail) - 1, -1, -1):
        lead = tail[start]
        if lead & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
            break
    else:
        return False
    if 0xC2 <= lead <= 0xDF:
        need, second = 2, (0x80, 0xBF)
    elif 0xE0 <= lead <= 0xEF:
        need = 3
        second = (0xA0, 0xBF) if lead == 0xE0 else (0x80, 0x9F) if lead == 0xED else (0x80, 0xBF)
    elif 0xF0 <= lead <= 0xF4:
        need = 4
        second = (0x90, 0xBF) if lead == 0xF0 else (0x80, 0x8F) if lead == 0xF4 else (0x80, 0xBF)
    else:
        return False
    rest = tail[start + 1 :]
    if len(rest) >= need - 1:
        return False
    return not rest or second[0] <= rest[0] <= second[1]


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas for streaming.

    Invariants:
      * Without stop strings, the deltas of all `add_tokens` calls plus `finish()` concatenate to
        exactly `tokenizer.decode(all_ids, skip_special_tokens)`, however the ids are chunked.
      * A delta never ends inside a UTF-8 character that later tokens could complete; such text is
        held back until it completes, or until `finish()`.
      * Stop strings are searched in the generated text only, across token boundaries. The match
        that completes first wins (earliest end; for equal ends, the earliest start). `text` then
        ends right before it (or after it with include_stop_str_in_output), and nothing after it is
        ever emitted. Text that might be the start of a stop string is held back until it cannot
        be, or until `finish()`.

    Cost per token is O(1) in the output length: decoding works on a short window of recent ids
    (vLLM/TGI's prefix/read offsets) rather than on everything generated so far.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self.stop_reason: str | None = None
        # Ids that reach the decoder: with skip_special_tokens, special ids are dropped up front
        # (decode would drop them anyway) so they never stall or widen the window.
        self._ids: list[int] = []
        # ids[prefix:read] is context already emitted; ids[read:] is not emitted yet.
        self._prefix_offset = 0
        self._read_offset = 0
        self._decoded_chars = 0  # length of all text released by the decode window
        self._held = ""  # released text withheld because it may begin a stop string
        self._chunks: list[str] = []
        self._done = False

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; returns the text that may now be shown ("" after a stop)."""
        if self._done:
            return ""
        tok = self.tokenizer
        skip = self.skip_special_tokens
        self._ids.extend(int(t) for t in token_ids if not (skip and tok.is_special(int(t))))
        return self._emit(self._release(final=False), final=False)

    def finish(self) -> str:
        """End of the request (for any reason but a stop string): return all held-back text."""
        if self._done:
            return ""
        delta = self._emit(self._release(final=True), final=True)
        self._done = True
        return delta

    # -- decode window

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _unfinished(self, end: int) -> bool:
        """Whether the unemitted ids[read:end] stop part-way through a character."""
        ids, read = self._ids, self._read_offset
        kind = self.tokenizer.decode_kind
        if kind == "byte_level":
            tail = b""
            for i in range(end - 1, read - 1, -1):
                tail = self.tokenizer.token_bytes(ids[i]) + tail
                if len(tail) >= 4:
                    break
            return _incomplete_utf8_tail(tail)
        if kind == "byte_fallback":
            # ByteFallback turns a whole run of byte tokens into text at once, and all of it into
            # U+FFFD if the run is invalid, so a run is never split: wait for its end.
            last = self.tokenizer.convert_ids_to_tokens(ids[end - 1])[0]
            return _BYTE_TOKEN.fullmatch(last) is not None
        return self._decode(ids[self._prefix_offset : end]).endswith("\ufffd")

    def _release(self, final: bool) -> str:
        """Decode newly complete text: the window ids[prefix:end] minus its emitted prefix."""
        ids = self._ids
        end = len(ids)
        if not final:
            # Stop before an unfinished character, releasing whatever precedes it.
            while end > self._read_offset and self._unfinished(end):
                end -= 1
        if end <= self._read_offset:
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(ids[self._prefix_offset : end])
        if window_text.startswith(prefix_text):
            delta = window_text[len(prefix_text) :]
        else:
            # Decoding the window alone disagreed with its own prefix (a decoder quirk at the
            # window's start); decode everything once to stay exact.
            delta = self._decode(ids[:end])[self._decoded_chars :]
        if not delta and not final:
            # Nothing visible yet (e.g. a lone leading "▁"); keep these ids in the window so the
            # next window's prefix is never empty text.
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._decoded_chars += len(delta)
        return delta

    # -- stop strings

    def _emit(self, released: str, final: bool) -> str:
        if not self._stops:
            return self._push(released)
        # A stop string can only start inside the held text or the new text: anything emitted
        # earlier was not a possible stop-string start (or it would have been held).
        buf = self._held + released
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            end, start, stop = best
            self._held = ""
            self.stop_reason = stop
            self._done = True
            return self._push(buf[: end if self.include_stop_str_in_output else start])
        keep = 0 if final else self._stop_prefix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return self._push(buf[: len(buf) - keep])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = max(len(s) for s in self._stops) - 1
        for n in range(min(longest, len(text)), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0

    def _push(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta
