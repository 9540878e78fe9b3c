"""The fields of OpenAI's and vLLM's requests that this server does not implement: each is
refused with a 400 naming it, before anything is recorded, unless it holds a value that asks
for nothing (its default, or what this server does anyway). Nothing is dropped silently.

A body's top-level fields are read raw (msgspec.Raw: not decoded, so never recursed into);
only a short raw value is decoded, to compare it with the values that ask for nothing.
README.md ("Serve", the table of fields) lists what is implemented and what is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from tokentape.entrypoints.refusals import APIError

_RAW_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_NOTHING = (None,)  # the values of a field that ask for nothing: JSON null only, by default

# field -> (the values that ask for nothing, why it is refused). Both endpoints' fields.
_COMMON: dict[str, tuple[tuple[Any, ...], str]] = {
    "response_format": (
        (None, {"type": "text"}),
        "structured output (json_object, json_schema) is not implemented",
    ),
    "structured_outputs": (_NOTHING, "structured output is not implemented"),
    "guided_json": (_NOTHING, "structured output is not implemented"),
    "guided_regex": (_NOTHING, "structured output is not implemented"),
    "guided_choice": (_NOTHING, "structured output is not implemented"),
    "guided_grammar": (_NOTHING, "structured output is not implemented"),
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search only"),
    "allowed_token_ids": (_NOTHING, "allowed_token_ids is not implemented (use logit_bias)"),
    "prompt_logprobs": (
        _NOTHING,
        "the prompt_logprobs field is not implemented (echo with logprobs gives the prompt's)",
    ),
    "logprob_token_ids": (_NOTHING, "logprobs of chosen token ids are not implemented"),
    "truncate_prompt_tokens": (_NOTHING, "prompt truncation is not implemented"),
    "truncation_side": (_NOTHING, "prompt truncation is not implemented"),
    "skip_special_tokens": (
        (None, True),
        "special tokens are always skipped in the text (vLLM's default)",
    ),
    "spaces_between_special_tokens": (
        (None, True),
        "special tokens are always skipped in the text (vLLM's default)",
    ),
    "return_tokens_as_token_ids": ((None, False), "logprob tokens are always text"),
    "return_token_offsets": ((None, False), "token offsets are not implemented"),
    "priority": ((None, 0), "priority scheduling is not implemented"),
    "cache_salt": (_NOTHING, "prefix-cache salts are not implemented"),
    "kv_transfer_params": (_NOTHING, "KV transfer is not implemented"),
    "ec_transfer_params": (_NOTHING, "encoder-cache transfer is not implemented"),
    "vllm_xargs": (_NOTHING, "vllm_xargs (custom logits processors) are not implemented"),
    "logits_processors": (_NOTHING, "custom logits processors are not implemented"),
    "watermarking": (_NOTHING, "watermarking is not implemented"),
    "repetition_detection": (_NOTHING, "repetition detection is not implemented"),
    "thinking_token_budget": (_NOTHING, "thinking budgets are not implemented"),
    "stream_interval": (_NOTHING, "a request's stream interval is the server's --stream-interval"),
    "prompt_embeds": (_NOTHING, "prompt embeddings are not implemented"),
    "mm_payload": ((None, "tensors"), "multimodal inputs are not implemented"),
    "return_mm_kwargs": (_NOTHING, "multimodal inputs are not implemented"),
    "session_id": (_NOTHING, "sessions are not implemented"),
    "best_of": ((None, 1), "best_of is not implemented (use n)"),
    "store": ((None, False), "stored completions are not implemented"),
    "metadata": (_NOTHING, "stored completions are not implemented"),
    "service_tier": ((None, "auto", "default"), "service tiers are not implemented"),
    "prediction": (_NOTHING, "predicted outputs are not implemented"),
}

COMPLETION: Mapping[str, tuple[tuple[Any, ...], str]] = {
    **_COMMON,
    "suffix": ((None, ""), "suffix (fill-in-the-middle) is not implemented"),
}

CHAT: Mapping[str, tuple[tuple[Any, ...], str]] = {
    **_COMMON,
    "tools": ((None, []), "tool calling is not implemented"),
    "tool_choice": ((None, "none"), "tool calling is not implemented"),
    "functions": ((None, []), "function calling is not implemented"),
    "function_call": ((None, "none"), "function calling is not implemented"),
    "documents": (_NOTHING, "documents for the chat template are not implemented"),
    "chat_template": (
        _NOTHING,
        # vLLM's words (without --trust-request-chat-template, which this server lacks)
        "Chat template is passed with request, but --trust-request-chat-template is not "
        "set. Refused request with untrusted chat template.",
    ),
    "media_io_kwargs": (_NOTHING, "multimodal inputs are not implemented"),
    "mm_processor_kwargs": (_NOTHING, "multimodal inputs are not implemented"),
    "return_prompt_text": ((None, False), "return_prompt_text is not implemented"),
    "reasoning_effort": (_NOTHING, "reasoning controls are not implemented"),
    "include_reasoning": ((None, True), "reasoning is not parsed out of the output"),
    "modalities": ((None, ["text"]), "only text output is implemented"),
    "audio": (_NOTHING, "audio output is not implemented"),
    "web_search_options": (_NOTHING, "web search is not implemented"),
    "verbosity": (_NOTHING, "verbosity is not implemented"),
}

# /inference/v1/generate: the body's own fields, and those of its sampling_params (vLLM's
# SamplingParams, whose prompt_logprobs this endpoint implements).
GENERATE: Mapping[str, tuple[tuple[Any, ...], str]] = {
    name: _COMMON[name] for name in ("cache_salt", "priority", "kv_transfer_params")
} | {"features": (_NOTHING, "multimodal features are not implemented")}

GENERATE_SAMPLING: Mapping[str, tuple[tuple[Any, ...], str]] = {
    name: entry for name, entry in _COMMON.items() if name != "prompt_logprobs"
} | {
    "output_kind": (_NOTHING, "the endpoint streams with stream=true"),
    "extra_args": (_NOTHING, "extra_args (custom logits processors) are not implemented"),
}

_SHORT = 256  # a raw value longer than this is no value that asks for nothing


def refuse_unsupported(body: bytes, fields: Mapping[str, tuple[tuple[Any, ...], str]]) -> None:
    """A 400 naming the first field of `body` (a JSON object) that asks for what this server
    does not implement; nothing for a body whose other fields ask for nothing."""
    try:
        raw = _RAW_FIELDS.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # not an object: the typed decode has refused it already
    for name, value in raw.items():
        entry = fields.get(name)
        if entry is None:
            continue
        allowed, why = entry
        text = bytes(value)
        if len(text) <= _SHORT:
            try:
                decoded = msgspec.json.decode(text)
            except msgspec.DecodeError:
                decoded = text
            if any(_same(decoded, a) for a in allowed):
                continue
        message = why if why.endswith(".") else f"{name} is not supported: {why}"
        raise APIError(400, message, param=name)


def refuse_unsupported_in(
    body: bytes, field: str, fields: Mapping[str, tuple[tuple[Any, ...], str]]
) -> None:
    """refuse_unsupported for the object that `body`'s `field` holds (the 400 names
    `field.name`)."""
    try:
        raw = _RAW_FIELDS.decode(body).get(field)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    if raw is None:
        return
    try:
        refuse_unsupported(bytes(raw), fields)
    except APIError as exc:
        raise APIError(exc.status, exc.message, exc.type, f"{field}.{exc.param}") from None


def _same(value: object, allowed: object) -> bool:
    """JSON equality that keeps true apart from 1 (Python's True == 1)."""
    return (
        type(value) is type(allowed)
        and value == allowed
        or ({type(value), type(allowed)} == {int, float} and value == allowed)
    )
