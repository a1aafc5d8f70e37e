"""Tokenization: text <-> ids (`Tokenizer`, from a GGUF file or a Hugging Face directory),
chat templates, and streaming detokenization (`IncrementalDetokenizer`, which never emits half
a UTF-8 character or any part of a stop string)."""

from kvserve.tokenizer.chat_template import ChatTemplateError
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer
from kvserve.tokenizer.tokenizer import Tokenizer
from kvserve.tokenizer.vocab import DecodeKind

__all__ = ["ChatTemplateError", "DecodeKind", "IncrementalDetokenizer", "Tokenizer"]
