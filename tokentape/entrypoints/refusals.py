"""Refusals as OpenAI-style errors: the status, the message, and the `param` it is about.

The engine and SamplingParams refuse with messages that begin with the field they are about
(`max_tokens must be ...`, `request 'ID': prompt_token_ids[3] must be ...`); `param_of` finds
that field and names it as the endpoint's client knows it (the prompt of a chat request is
its `messages`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from tokentape.events.schema import SamplingParams


class APIError(Exception):
    """An OpenAI-style error response: status, message, type, param."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param


# The fields a refusal may be about: SamplingParams' and the prompt's.
KNOWN_PARAMS = frozenset(
    [f.name for f in msgspec.structs.fields(SamplingParams)] + ["prompt_token_ids", "prompt"]
)
# `request 'ID': ` or `request 'ID' with n=4: ` before the field (ID as repr writes it).
_REQUEST_PREFIX = re.compile(
    r"""^request (?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")(?: with n=\d+)?: """
)
_WORD = re.compile(r"[A-Za-z_]+")


def param_of(message: str, aliases: Mapping[str, str] | None = None) -> str | None:
    """The request field a refusal is about: the first known field named in its message
    (after the request id), as the endpoint calls it (`aliases`), or None."""
    prefix = _REQUEST_PREFIX.match(message)
    rest = message[prefix.end() :] if prefix else message
    for word in _WORD.finditer(rest):
        name = word.group()
        if name in KNOWN_PARAMS:
            return (aliases or {}).get(name, name)
    if "input tokens" in rest:  # vLLM's words for a prompt past the context
        return (aliases or {}).get("prompt", "prompt")
    return None


def refusal(exc: Exception, aliases: Mapping[str, str] | None = None) -> APIError:
    """A 400 for a value the engine or SamplingParams refused, naming its field."""
    message = str(exc)
    return APIError(400, message, param=param_of(message, aliases))


def check_fits_context(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str = "max_tokens"
) -> None:
    """A request whose prompt and explicit max_tokens exceed the context is refused, in the
    words of vLLM's OpenAI server (through 0.10; later releases cut max_tokens to the context
    silently, which this server does only for a max_tokens it chose itself)."""
    if max_tokens is None or num_prompt_tokens + max_tokens <= max_model_len:
        return
    raise APIError(
        400,
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
        f"maximum context length is {max_model_len} tokens and your request has "
        f"{num_prompt_tokens} input tokens ({max_tokens} > {max_model_len} - "
        f"{num_prompt_tokens}).",
        param=param,
    )
