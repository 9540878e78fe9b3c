"""`bad_words` given as strings, encoded as vLLM encodes them (SamplingParams.
update_from_tokenizer): each word without a leading space, and again with one when that gives
a new first token and as many tokens (a word inside a sentence is often one token with its
space). The engine records the encoded token ids, so a replay needs no tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from tokentape.events.schema import SamplingParams

Encode = Callable[[str], list[int]]


def encode_bad_word(word: str, encode: Encode) -> list[tuple[int, ...]]:
    """The token-id sequences one bad word bans (one or two)."""
    plain = tuple(encode(word.lstrip()))
    if not plain:
        raise ValueError(f"bad word {word!r} encodes to no token")
    spaced = tuple(encode(" " + word.lstrip()))
    if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
        return [plain, spaced]
    return [plain]


def has_text_bad_words(params: SamplingParams) -> bool:
    return any(isinstance(w, str) for w in params.bad_words)


def resolve_bad_words(params: SamplingParams, encode: Encode | None) -> SamplingParams:
    """The params with every string bad word replaced by its token-id sequences (words given
    as ids are kept as they are); the same params when there is no string."""
    if not has_text_bad_words(params):
        return params
    if encode is None:
        raise ValueError(
            "bad_words given as strings need a tokenizer, and this engine has none "
            "(pass token-id sequences instead)"
        )
    # vLLM drops repeated words; a dict keeps the first of each in order, in linear time (a
    # scan of the list for each word took 8 s for 40,000 words, inside the engine core).
    words: dict[tuple[int, ...], None] = {}
    for word in params.bad_words:
        for ids in encode_bad_word(word, encode) if isinstance(word, str) else [word]:
            words[tuple(ids)] = None
    return msgspec.structs.replace(params, bad_words=tuple(words))
