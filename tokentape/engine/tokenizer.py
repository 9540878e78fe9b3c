"""The built-in byte-level tokenizer: token id = byte + 3, with three special tokens."""

from __future__ import annotations


class ByteTokenizer:
    bos_token_id = 0
    eos_token_id = 1
    pad_token_id = 2
    _OFFSET = 3
    vocab_size = 256 + _OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + self._OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(t - self._OFFSET for t in token_ids if self._OFFSET <= t < self.vocab_size)
        return data.decode("utf-8", errors="replace")
