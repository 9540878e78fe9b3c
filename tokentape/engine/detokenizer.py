"""Incremental detokenization: the text a growing token list adds, decoded a short window at
a time (as vLLM's detokenizer does), for the output processor.

A byte sequence cut inside a UTF-8 character is held back until the character is complete,
or the stream ends (then it is replaced, as a one-shot decode replaces it).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Protocol

from tokentape.engine.tokenizer import ByteTokenizer, Tokenizer

Decode = Callable[[list[int]], str]


class Detokenizer(Protocol):
    def add(self, new_tokens: list[int], final: bool) -> str: ...


class IncrementalDetokenizer:
    """Text deltas of a growing token list: the tokens since the last emitted text are decoded
    after those before it (so a tokenizer that joins pieces with spaces decodes them in
    context). `num_chars`: the length of the text given out so far."""

    __slots__ = ("decode", "num_chars", "prefix_offset", "read_offset", "tokens")

    def __init__(self, decode: Decode) -> None:
        self.decode, self.num_chars = decode, 0
        self.tokens: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def add(self, new_tokens: list[int], final: bool) -> str:
        tokens = self.tokens
        tokens += new_tokens
        prefix = (
            self.decode(tokens[self.prefix_offset : self.read_offset])
            if self.read_offset > self.prefix_offset
            else ""
        )
        full = self.decode(tokens[self.prefix_offset :])
        if len(full) <= len(prefix) or (not final and full.endswith("\ufffd")):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        self.num_chars += len(delta)
        return delta


class ByteDetokenizer:
    """IncrementalDetokenizer's deltas for the byte tokenizer (the built-in models and the
    oracle), from an incremental UTF-8 decoder: each token is decoded once, and a character
    cut between tokens is held back by the decoder itself until it is complete (or, at the
    end, replaced)."""

    __slots__ = ("num_chars", "to_bytes", "utf8")

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.to_bytes = tokenizer.to_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.num_chars = 0

    def add(self, new_tokens: list[int], final: bool) -> str:
        delta = self.utf8.decode(self.to_bytes(new_tokens), final)
        self.num_chars += len(delta)
        return delta


def no_text(token_ids: list[int]) -> str:
    """The text of an engine without a tokenizer (a checkpoint without tokenizer.json): none,
    as vLLM's skip_tokenizer_init gives."""
    return ""


def detokenizer(tokenizer: Tokenizer | None) -> IncrementalDetokenizer | ByteDetokenizer:
    """The incremental detokenizer of one stream."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteDetokenizer(tokenizer)
    return IncrementalDetokenizer(tokenizer.decode if tokenizer is not None else no_text)
