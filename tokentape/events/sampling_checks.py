"""Checks of SamplingParams' vLLM sampling options (format 2), with vLLM's bounds.

Called from `SamplingParams.__post_init__`: a refused value raises before anything is
recorded. Sequences are normalised to tuples (a str `stop` to a 1-tuple, as vLLM accepts),
so a params object equals its copy decoded from the tape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from tokentape.events.validation import check_bool, check_int, check_number, check_str, shown

MAX_N = 1024  # a bound on the fan-out one request may ask for


def _sequence(name: str, value: object, what: str) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence of {what}, got {shown(value)}")
    return tuple(value)  # type: ignore[arg-type]


def check_sampling_options(params: Any, set_field: Callable[[Any, str, Any], None]) -> None:
    check_int("n", params.n, 1, MAX_N)
    for name in ("presence_penalty", "frequency_penalty"):  # the OpenAI API's range
        set_field(params, name, check_number(name, getattr(params, name), -2.0, 2.0))
    set_field(
        params,
        "repetition_penalty",
        check_number("repetition_penalty", params.repetition_penalty, 0.0, lo_open=True),
    )
    check_int("min_tokens", params.min_tokens, 0)
    if params.min_tokens > params.max_tokens:
        raise ValueError(
            f"min_tokens must be <= max_tokens={params.max_tokens}, got {params.min_tokens}"
        )
    stop = params.stop
    stop = (stop,) if isinstance(stop, str) else _sequence("stop", stop, "strings")
    for i, s in enumerate(stop):
        check_str(f"stop[{i}]", s)
        if not s:
            raise ValueError(f"stop[{i}] must be a non-empty string, got ''")
    set_field(params, "stop", stop)
    check_bool("include_stop_str_in_output", params.include_stop_str_in_output)
    words: list[Any] = []
    for i, word in enumerate(
        _sequence("bad_words", params.bad_words, "strings or token-id sequences")
    ):
        if isinstance(word, str):  # vLLM's form: the engine encodes it and records the ids
            check_str(f"bad_words[{i}]", word)
            if not word.strip():
                raise ValueError(f"bad_words[{i}] must be a non-blank string, got {word!r}")
            words.append(word)
            continue
        word = _sequence(f"bad_words[{i}]", word, "token ids (or be a string)")
        if not word:
            raise ValueError(f"bad_words[{i}] must hold at least one token id, got ()")
        for j, token in enumerate(word):
            check_int(f"bad_words[{i}][{j}]", token, 0)
        words.append(word)
    set_field(params, "bad_words", tuple(words))
    set_field(params, "min_p", check_number("min_p", params.min_p, 0.0, 1.0))
    set_field(params, "logit_bias", _logit_bias(params.logit_bias))


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """vLLM's {token id: bias} (or (id, bias) pairs) as pairs in id order; a finite bias."""
    items = value.items() if isinstance(value, Mapping) else _sequence("logit_bias", value, "pairs")
    pairs: dict[int, float] = {}
    for item in items:
        if isinstance(item, (str, bytes)) or not hasattr(item, "__len__") or len(item) != 2:
            raise TypeError(f"logit_bias must map token ids to biases, got {shown(item)}")
        token, bias = item
        check_int(f"logit_bias key {token!r}", token, 0)
        pairs[token] = check_number(f"logit_bias[{token}]", bias, -math.inf)
    return tuple(sorted(pairs.items()))
