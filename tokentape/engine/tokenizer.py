"""Tokenizers: the built-in byte-level one (token id = byte + 3, three special tokens), a
checkpoint's tokenizer.json, and the stand-in for a checkpoint that has none."""

from __future__ import annotations

import os
from typing import Protocol

from tokentape.errors import CheckpointError


class Tokenizer(Protocol):
    # add_special_tokens: the tokenizer's post-processor runs (a BOS, for Llama's), as vLLM's
    # completions ask by default; the byte tokenizer has none.
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    bos_token_id = 0
    eos_token_id = 1
    pad_token_id = 2
    _OFFSET = 3
    vocab_size = 256 + _OFFSET

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + self._OFFSET for b in text.encode("utf-8")]  # no post-processor

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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


def byte_tokenizer_json() -> str:
    """ByteTokenizer as a tokenizer.json (byte-level BPE without merges, each byte's id its
    value + 3, the three special tokens first), for checkpoint folders written from the
    built-in models: `tokenizers` encodes and decodes text with it as ByteTokenizer does
    (except that the special tokens' own text in a prompt, as in every tokenizer.json, is
    read as those tokens; their names make that a deliberate act)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizerFile

    specials = ["<|tokentape:bos|>", "<|tokentape:eos|>", "<|tokentape:pad|>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update(
        {char: byte + ByteTokenizer._OFFSET for char, byte in _byte_level_alphabet().items()}
    )
    tok = HFTokenizerFile(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True) for name in specials])
    return tok.to_str()


class MissingTokenizer:
    """A checkpoint folder without tokenizer.json. Its model's ids mean nothing to the byte
    tokenizer, so rather than garbage text: text prompts are refused (naming the folder),
    token-id prompts run, and outputs carry token ids with empty text, as vLLM's
    skip_tokenizer_init gives. LLM hands the engine no tokenizer, which refuses stop strings
    and string bad words."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise CheckpointError(
            f"{os.path.join(self.folder, 'tokenizer.json')}: missing, so text cannot be "
            "encoded for this checkpoint; pass prompts as token ids, or add the tokenizer.json "
            "the model was trained with"
        )

    def decode(self, token_ids: list[int]) -> str:
        return ""


def checkpoint_tokenizer(folder: str | os.PathLike[str]) -> HFTokenizer | MissingTokenizer:
    """A checkpoint folder's tokenizer: its tokenizer.json, read by the `tokenizers` library
    (a file it cannot read is a CheckpointError naming it), or MissingTokenizer."""
    file = os.path.join(folder, "tokenizer.json")
    if not os.path.lexists(file):
        return MissingTokenizer(os.fspath(folder))
    if os.path.isdir(file):
        raise CheckpointError(f"{file}: is a directory, not a JSON file")
    try:
        return HFTokenizer(file)
    except Exception as exc:  # noqa: BLE001 (`tokenizers` raises a bare Exception)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{file}: not a tokenizer the tokenizers library can read ({reason})"
        ) from None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}
