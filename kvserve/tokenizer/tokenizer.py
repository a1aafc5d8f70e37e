"""Text <-> token ids for one model: a Hugging Face `tokenizers.Tokenizer` assembled here
(kvserve.tokenizer.vocab), from a GGUF file's metadata or a Hugging Face style directory.
transformers is deliberately not used at run time: it is slow to import and only a small part
of it is needed."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer as HFTokenizer

from kvserve.tokenizer.chat_template import render_chat_template
from kvserve.tokenizer.vocab import (
    BYTE_TOKEN,
    CHAR_TO_BYTE,
    SPM_SPACE,
    DecodeKind,
    GGUFTokenizerCache,
    dir_tokenizer,
    gguf_tokenizer,
)


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
        cached = GGUFTokenizerCache.at(path)
        if cached is not None and (hit := cached.load()) is not None:
            backend, kwargs = hit
            return cls(backend, **kwargs)
        backend, kwargs = gguf_tokenizer(path, reader)
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
        backend, kwargs = dir_tokenizer(Path(path))
        return cls(backend, **kwargs)

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
                return bytes(CHAR_TO_BYTE[c] for c in token)
            except KeyError:  # not spelled in the byte alphabet: an added token, taken verbatim
                return token.encode("utf-8")
        if self.decode_kind == "byte_fallback":
            if match := BYTE_TOKEN.fullmatch(token):
                return bytes([int(match.group(1), 16)])
            return token.replace(SPM_SPACE, " ").encode("utf-8")
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
        variables: dict[str, Any] = {"documents": None}
        named_ids = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        named_ids["pad_token"] = self.pad_token_id
        for name, token_id in named_ids.items():
            if token_id is not None:
                variables[name] = self._backend.id_to_token(token_id)
        variables.update(kwargs)
        return render_chat_template(self.chat_template, {
            **variables, "messages": messages, "tools": tools,
            "add_generation_prompt": add_generation_prompt})

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        """Render a conversation with the model's chat template and tokenize it (the
        template writes BOS itself where the model wants it). With `continue_final_message`
        the rendering stops at the end of the last message's text, so the model continues
        it rather than starting a new turn. Raises what the template raises. The engine and
        a router's route keys (entrypoints.ray_serve.route_key) both render chats here."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        if continue_final_message:
            last = messages[-1].get("content") if messages else None
            if not isinstance(last, str) or not last or last not in text:
                raise ValueError("continue_final_message needs a last message whose text "
                                 "the chat template writes out")
            text = text[:text.rindex(last) + len(last)]
        return self.encode(text, add_special_tokens=False)
