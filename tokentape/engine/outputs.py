"""What the client gets back, in vLLM's shape, and how a request's output kind shapes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokentape.events.schema import RequestOutputKind

__all__ = ["CompletionOutput", "RequestOutput", "RequestOutputKind", "build_request_output"]


class CompletionOutput:
    """One completion: its token ids, text and finish reason.

    The text is decoded on first access, so streaming steps pay for detokenisation only when
    a caller reads it.
    """

    __slots__ = ("index", "token_ids", "finish_reason", "logprobs", "_text", "_decode")

    def __init__(
        self,
        index: int,
        text: str | None,
        token_ids: list[int],
        finish_reason: str | None = None,
        logprobs: list[float] | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.index = index
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self.logprobs = logprobs
        self._text = text
        self._decode = decode

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._decode(self.token_ids) if self._decode else ""
        return self._text

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return (self.index, self.token_ids, self.finish_reason, self.logprobs, self.text) == (
            other.index, other.token_ids, other.finish_reason, other.logprobs, other.text)

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids}, finish_reason={self.finish_reason!r})")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    metrics: dict[str, int] = field(default_factory=dict)


def build_request_output(
    kind: RequestOutputKind,
    request_id: str,
    prompt_token_ids: list[int],
    token_ids: list[int],
    num_new: int,
    logprobs: list[float] | None,
    finish_reason: str | None,
    decode: Callable[[list[int]], str] | None = None,
    prompt: str | None = None,
) -> RequestOutput | None:
    """The output a client of this kind gets when `num_new` tokens (the tail of `token_ids`,
    every token delivered so far) arrive, or the request finishes: all of them (CUMULATIVE),
    the new ones (DELTA), or nothing until the end and then all of them (FINAL_ONLY)."""
    finished = finish_reason is not None
    if kind == RequestOutputKind.FINAL_ONLY and not finished:
        return None
    start = len(token_ids) - num_new if kind == RequestOutputKind.DELTA else 0
    tokens = token_ids[start:]  # a copy: the caller's list keeps growing
    lps = logprobs[start:] if logprobs is not None else None
    completion = CompletionOutput(0, None, tokens, finish_reason, lps, decode=decode)
    return RequestOutput(request_id, prompt_token_ids, [completion], finished, prompt)
