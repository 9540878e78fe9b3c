"""What the engine refuses before it records a request: ids it cannot hold, prompts it cannot
serve, and options whose work would grow without bound.

SamplingParams checks its own fields when it is built (types, ranges, what the tape can hold);
here are the checks that need the engine: its vocabulary, its context, its runner, and the
limits on the work one request may ask of every step. Each message begins with the field it
is about (after `request 'ID': `), so a server can name the field in its error.

The limits (README, "Serve"):

- `logprobs` and `prompt_logprobs` at most `max_logprobs` (an engine argument, 20 by
  default, as vLLM's; -1: no cap but the vocabulary);
- `stop`: at most MAX_STOP_STRINGS strings of MAX_STOP_CHARS characters in all (the stop
  check after every frame looks for each of them in a window as long as the longest);
- `bad_words`: at most MAX_BAD_WORDS words of MAX_BAD_WORDS_SIZE characters or token ids in
  all (each word is matched against the context at every step);
- `stop_token_ids`: at most MAX_STOP_TOKEN_IDS ids, each in the vocabulary;
- `logit_bias`: token ids of the vocabulary (so at most one entry per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from tokentape.engine.bad_words import resolve_bad_words
from tokentape.engine.config import EngineConfig
from tokentape.engine.parallel_sampling import child_params, child_request_id
from tokentape.engine.runners.base import ChecksParams, ModelRunner
from tokentape.engine.tokenizer import Tokenizer
from tokentape.events.reducer import reusable_request_id
from tokentape.events.schema import SamplingParams
from tokentape.events.state import EngineState
from tokentape.events.validation import check_int, check_str, shown


class CheckedEngine(Protocol):
    """What the checks read of the engine (EngineCore), without importing it."""

    state: EngineState
    config: EngineConfig
    runner: ModelRunner
    tokenizer: Tokenizer | None
    params_checker: ChecksParams | None

    def has_parent(self, request_id: str) -> bool: ...


MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
MAX_BAD_WORDS = 1024
MAX_BAD_WORDS_SIZE = 16384
MAX_STOP_TOKEN_IDS = 1024


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt that leaves no position for output, in vLLM's words (its OpenAI
    server's `_validate_input`; its offline LLM refuses only a longer prompt). The front ends
    check it too, before a request is sent."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            "input messages."
        )


def check_request_limits(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """Refuse a request whose per-step work exceeds the limits above: cheap counts only, so it
    runs before any string is encoded."""
    for name, k in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if k is None:
            continue
        cap = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        if k > cap:
            why = "the vocabulary size" if cap == vocab_size else "max_logprobs, the engine's limit"
            raise ValueError(f"{name} must be at most {cap} ({why}), got {k}")
    stop = params.stop
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    stop_chars = sum(map(len, stop))
    if stop_chars > MAX_STOP_CHARS:
        raise ValueError(
            f"stop must hold at most {MAX_STOP_CHARS} characters in all, got {stop_chars}"
        )
    words = params.bad_words
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words must hold at most {MAX_BAD_WORDS} words, got {len(words)}")
    size = sum(map(len, words))  # characters of a string, token ids of an id sequence
    if size > MAX_BAD_WORDS_SIZE:
        raise ValueError(
            f"bad_words must hold at most {MAX_BAD_WORDS_SIZE} characters (or token "
            f"ids) in all, got {size}"
        )
    bad_ids = [t for t, _ in params.logit_bias if t >= vocab_size]  # ids in order, unique
    if bad_ids:
        raise ValueError(  # vLLM's words
            f"logit_bias: token_id(s) {bad_ids} in logit_bias contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}"
        )
    stop_ids = params.stop_token_ids
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(
            f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}"
        )
    if stop_ids and max(stop_ids) >= vocab_size:
        i, bad = next((i, t) for i, t in enumerate(stop_ids) if t >= vocab_size)
        raise ValueError(
            f"stop_token_ids[{i}] must be a token id in the vocabulary [0, {vocab_size}), "
            f"got {bad!r}"
        )


def check_prompt(request_id: str, prompt: object, vocab_size: int, max_model_len: int) -> None:
    """A non-empty list of token ids of the vocabulary, shorter than the context."""
    if not isinstance(prompt, Sequence) or isinstance(prompt, (str, bytes)):
        hint = " (encode text with the tokenizer first)" if isinstance(prompt, str) else ""
        raise TypeError(
            f"request {request_id!r}: prompt_token_ids must be a list of token ids, "
            f"got {shown(prompt)}{hint}"
        )
    if not prompt:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    # One pass at C speed for the usual good prompt; the slow search only names a bad token.
    if not (all(type(t) is int for t in prompt) and min(prompt) >= 0 and max(prompt) < vocab_size):
        for i, t in enumerate(prompt):
            name = f"request {request_id!r}: prompt_token_ids[{i}]"
            check_int(name, t, 0)  # the type (a bool is not a token id), then the vocabulary
            if t >= vocab_size:
                raise ValueError(
                    f"{name} must be a token id in the vocabulary [0, {vocab_size}), got {t!r}"
                )
    try:
        check_prompt_fits(len(prompt), max_model_len)
    except ValueError as exc:
        raise ValueError(
            f"request {request_id!r}: {exc} (raise max_model_len or num_kv_blocks, "
            "or shorten the prompt)"
        ) from None


def check_request(
    engine: CheckedEngine, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
) -> None:
    """Refuse a request the engine could not serve or the tape could not hold, before
    anything is recorded (EngineCore.check_request)."""
    check_str("request_id", request_id)
    if not request_id:
        raise ValueError("request_id must be a non-empty string, got ''")
    requests = engine.state.requests
    if (
        request_id in requests and not reusable_request_id(engine.state, requests[request_id])
    ) or engine.has_parent(request_id):
        raise ValueError(f"request id {request_id!r} is already in use on this engine")
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"request {request_id!r}: params must be a SamplingParams, got {shown(params)}"
        )
    config, vocab = engine.config, engine.runner.vocab_size
    try:
        check_request_limits(params, config.max_logprobs, vocab)
    except ValueError as exc:
        raise ValueError(f"request {request_id!r}: {exc}") from None
    if params.n > 1:
        for i in range(params.n):
            if child_request_id(i, request_id) in requests:
                raise ValueError(
                    f"request {request_id!r} with n={params.n}: its child id "
                    f"{child_request_id(i, request_id)!r} is already in use on this engine"
                )
        child_params(params, params.n - 1, config.seed, ())  # the seeds fit
    check_prompt(request_id, prompt_token_ids, vocab, config.effective_max_model_len)
    resolved = resolved_bad_words(engine, request_id, params).bad_words
    for i, word in enumerate(cast(tuple[tuple[int, ...], ...], resolved)):  # ids only, now
        for j, t in enumerate(word):
            if t >= vocab:
                raise ValueError(
                    f"request {request_id!r}: bad_words[{i}][{j}] must be a token id "
                    f"in the vocabulary [0, {vocab}), got {t!r}"
                )
    if engine.params_checker is not None:  # options the runner cannot honour
        try:
            engine.params_checker.check_params(params)
        except ValueError as exc:
            raise ValueError(f"request {request_id!r}: {exc}") from None
    if params.stop and engine.tokenizer is None:
        raise ValueError(
            f"request {request_id!r}: stop strings need a tokenizer, and this "
            "engine has none (pass stop_token_ids instead)"
        )


def resolved_bad_words(
    engine: CheckedEngine, request_id: str, params: SamplingParams
) -> SamplingParams:
    """The params with string bad words as token ids, encoded by the engine's tokenizer."""
    tokenizer = engine.tokenizer
    try:
        return resolve_bad_words(params, None if tokenizer is None else tokenizer.encode)
    except (ValueError, UnicodeError) as exc:
        raise ValueError(f"request {request_id!r}: {exc}") from None
