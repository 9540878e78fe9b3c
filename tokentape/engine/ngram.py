"""The n-gram (prompt lookup) drafter used for speculative decoding."""

from __future__ import annotations


def propose_ngram_drafts(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Find the latest earlier occurrence of the sequence's suffix and propose what followed.

    Tries suffixes from `max_n` down to `min_n` tokens; returns up to `k` tokens, or none.
    """
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []
