"""Stop strings, as vLLM's front end checks them: in the detokenized output text, after each
frame, once the output is longer than min_tokens; the text is cut at the match.

The engine looks for a match after applying a frame (`find_stop_string`) and records what it
found as `RequestFinished(reason="stop", stop_reason=<the string>)`, so a fold of the tape
knows the finish without a tokenizer. The token ids stay as delivered (every token of the
frame, as in vLLM); only the text is cut (`stop_text`, by the output processor), a pure
function of the tokens, the params and the matched string.

Decoding the whole output after every frame costs O(output) per frame; given the tokenizer's
`safe_split` the check decodes only a window ending with the frame, with the same answer
(tests/engine/test_stop_strings.py; at 4096 output tokens 0.8 ms -> 11 us per frame, byte
tokenizer).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from tokentape.events.schema import SamplingParams

Decode = Callable[[list[int]], str]
# A tokenizer's safe_split(ids, pos): a k <= pos with decode(ids[:j]) == decode(ids[:k]) +
# decode(ids[k:j]) for every k <= j <= len(ids) (0 always qualifies).
SafeSplit = Callable[[list[int], int], int]


def _earliest_match(text: str, start: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The stop string whose first occurrence ending after `start` ends earliest (ties: the
    first in `stops`), with the index where it begins."""
    best: tuple[str, int] | None = None
    best_end = sys.maxsize
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and i + len(stop) < best_end:
            best, best_end = (stop, i), i + len(stop)
    return best


def find_stop_string(
    decode: Decode,
    params: SamplingParams,
    output: list[int],
    num_before: int,
    split: SafeSplit | None = None,
) -> str | None:
    """The stop string completed by the output tokens after `num_before` (the frame just
    applied), or None. Text of the first min_tokens tokens cannot complete one.

    With the tokenizer's `split` (its `safe_split`) only a window of the output is decoded:
    one that ends with the frame and holds enough text before it for any stop string to begin
    there. The tokenizer promises the text before the window is the same in the full decode,
    so the answer is the full decode's; without `split` the whole output is decoded."""
    if not params.stop or len(output) <= params.min_tokens:
        return None
    checked = max(num_before, params.min_tokens)
    if split is None or not checked:
        text = decode(output)
        found = _earliest_match(text, _stable_len(decode(output[:checked]), text), params.stop)
        return found[0] if found else None
    # A match ending in the frame begins at most len(stop) - 1 characters before it.
    need = max(map(len, params.stop)) - 1
    span = need + 1  # tokens give at least a character each, mostly (more are taken if not)
    while True:
        k = split(output, max(0, checked - span))
        window = decode(output[k:])
        start = _stable_len(decode(output[k:checked]), window)
        if k == 0 or start >= need:
            break
        span *= 2
    found = _earliest_match(window, start, params.stop)
    return found[0] if found else None


def _stable_len(before: str, after: str) -> int:
    """How much of the text before the frame the frame left as it was: all of it, less a
    replacement character that stood for a multi-byte character the frame completed (whose
    new text may complete a stop string)."""
    n = min(len(before), len(after))
    if before[:n] == after[:n]:
        return n
    return len(os.path.commonprefix([before, after]))


def _cut(text: str, start: int, params: SamplingParams, stop_str: str) -> str:
    i = text.find(stop_str, max(0, start - len(stop_str) + 1))
    if i == -1:  # cannot happen for a recorded match; keep the text whole
        return text
    return text[: i + len(stop_str)] if params.include_stop_str_in_output else text[:i]


def stop_text(decode: Decode, params: SamplingParams, output: list[int], stop_str: str) -> str:
    """The output's text cut at the stop string that finished it: before the string, or
    after it with include_stop_str_in_output. Every check before the last found nothing, so
    the match is the string's first occurrence that ends after the min_tokens text."""
    text = decode(output)
    start = _stable_len(decode(output[: params.min_tokens]), text) if params.min_tokens else 0
    return _cut(text, start, params, stop_str)
