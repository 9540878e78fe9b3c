"""Tokenizers: the built-in byte-level one (token id = byte + 3, three special tokens) and a
checkpoint's tokenizer.json."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    bos_token_id = 0
    eos_token_id = 1
    pad_token_id = 2
    _OFFSET = 3
    vocab_size = 256 + _OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + self._OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        return self.to_bytes(token_ids).decode("utf-8", errors="replace")

    def to_bytes(self, token_ids: list[int]) -> bytes:
        """The bytes the ids stand for; the special tokens stand for none."""
        return bytes(t - self._OFFSET for t in token_ids if self._OFFSET <= t < self.vocab_size)


class HFTokenizer:
    """A checkpoint's tokenizer.json, through the `tokenizers` library."""

    def __init__(self, file: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(file)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)
