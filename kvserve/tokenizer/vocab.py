"""Vocabularies into `tokenizers` backends: from a GGUF file's metadata (byte-level BPE or
SentencePiece BPE with byte fallback, as llama.cpp reads them) or from a Hugging Face style
directory, and the start-up cache entry that keeps a GGUF file's backend built."""

from __future__ import annotations

import json
import logging
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gguf
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
from kvserve.gguf_reader import array_values, open_gguf

logger = logging.getLogger(__name__)

DecodeKind = Literal["byte_level", "byte_fallback", "text"]

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPM_SPACE = "\u2581"


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
CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


# Pre-tokenizer split patterns, named by GGUF's `tokenizer.ggml.pre` (llama.cpp's names).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o, gpt-oss, Llama 4): words split at case changes -- an optional leading
# non-letter, then either upper-case letters followed by lower-case ones ("Camel", "Case") or
# an all-caps run ("HTTP"), with an English contraction kept on the word ("don't", "I'M");
# numbers in runs of at most three digits; punctuation runs keep a leading space and any
# trailing newlines or slashes; then the usual whitespace rules. \p{Lm}, \p{Lo} and \p{M}
# count as both cases, so caseless scripts and combining marks stay inside words.
_O200K_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_O200K_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_O200K_SUFFIX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}*{_O200K_LOWER}+{_O200K_SUFFIX}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}+{_O200K_LOWER}*{_O200K_SUFFIX}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "minimax-m2"), "o200k"),
}
_SPLITS = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "o200k": _O200K_SPLIT}


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
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


def gguf_tokenizer(path: Path, reader: gguf.GGUFReader | None
                   ) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizers backend a GGUF file describes ("gpt2" byte-level BPE or "llama"
    SPM) and the rest of Tokenizer's arguments, from its metadata (`reader` if open)."""
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
    extra_eos = [i for k in ("eot", "eom")
                 if (i := token_id(f"tokenizer.ggml.{k}_token_id")) is not None]
    eos, extra_eos = harmony_stops(lambda t: tokens.index(t) if t in tokens else None,
                                   eos, extra_eos)
    kwargs: dict[str, Any] = dict(
        decode_kind=decode_kind,
        bos_token_id=bos,
        eos_token_id=eos,
        extra_eos_token_ids=extra_eos,
        pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
        add_bos_token=add_bos_default if add_bos is None else add_bos,
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", bool)),
        chat_template=meta.get("tokenizer.chat_template", str),
    )
    return backend, kwargs


# OpenAI's harmony (gpt-oss): a generation ends at <|return|> (the answer is done) or <|call|>
# (a tool call waits for its result), never at <|end|>, which closes one message (the thinking)
# and lets the next begin. A GGUF file names one EOS token (<|return|>, or <|end|> in some
# conversions) and may name <|end|> as EOT; the vocabulary's own tokens decide instead.
HARMONY_STOPS = ("<|return|>", "<|call|>")
HARMONY_MESSAGE_END = "<|end|>"


def harmony_stops(token_id: Callable[[str], int | None], eos: int | None, extra: list[int]
                  ) -> tuple[int | None, list[int]]:
    """(eos, extra end-of-generation ids) with harmony's rule applied where the vocabulary
    has both of HARMONY_STOPS (`token_id` looks a token up): both end a generation and
    <|end|> does not (an EOS of <|end|> becomes <|return|>). Other vocabularies unchanged."""
    stops = [token_id(t) for t in HARMONY_STOPS]
    if None in stops:
        return eos, extra
    end = token_id(HARMONY_MESSAGE_END)
    if eos is not None and eos == end:
        eos = stops[0]
    kept = [i for i in extra if i != end]
    return eos, [*kept, *(i for i in stops if i is not None and i not in kept)]


def dir_tokenizer(root: Path) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizers backend of a Hugging Face style directory (tokenizer.json, with the
    optional tokenizer_config.json, chat_template.jinja / chat_template.json and
    generation_config.json) and the rest of Tokenizer's arguments."""
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

    eos, extra_eos = harmony_stops(backend.token_to_id, eos,
                                   [i for i in gen_eos_ids if isinstance(i, int)])
    bos = token_id("bos")
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        # No explicit flag: the tokenizer.json post-processor decides, as in transformers.
        with_special = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and with_special[:1] == [bos]
    return backend, dict(
        decode_kind=_decode_kind(spec.get("decoder")),
        bos_token_id=bos,
        eos_token_id=eos,
        extra_eos_token_ids=extra_eos,
        pad_token_id=token_id("pad"),
        add_bos_token=bool(add_bos),
        add_eos_token=bool(config.get("add_eos_token", False)),
        chat_template=_dir_chat_template(root, config),
    )


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
        if (values := array_values(field)) is not None:
            return values
        if element == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if element == gguf.GGUFValueType.ARRAY:
            raise ValueError("nested arrays are not supported")
        return [v.item() for i in field.data for v in field.parts[i]]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0].item()


def _is_byte_spelled(token: str) -> bool:
    return all(c in CHAR_TO_BYTE for c in token)


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
class GGUFTokenizerCache:
    """One GGUF file's tokenizer in the start-up cache: a line of JSON (the fingerprint, the
    Tokenizer's other arguments, the length and CRC-32 of what follows) and then the backend
    as tokenizers' JSON. The fingerprint covers the file, this module's source and tokenizers'
    version; an entry that fails any check is rebuilt with a warning."""

    path: Path
    header: dict[str, Any]

    @classmethod
    def at(cls, model: Path) -> GGUFTokenizerCache | None:
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
    backend.pre_tokenizer = byte_level_pre_tokenizer(pre)
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
        splits = [(a, b) for k in range(1, len(token))
                  if (a := token[:k]) in mergeable and (b := token[k:]) in mergeable]
        if len(splits) > 1:
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
        replacement=SPM_SPACE, prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
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


