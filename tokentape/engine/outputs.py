"""What the client gets back, in vLLM's shape, and how a request's output kind shapes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokentape.events.schema import RequestOutputKind

__all__ = ["CompletionOutput", "RequestOutput", "RequestOutputKind", "build_request_output"]


class CompletionOutput:
    """One completion: its token ids, text and finish reason.

    The text is decoded on first access, so streaming steps pay for detokenisation only when
    a caller reads it. The token ids (and logprobs) may be given as a span of a stream that
    only ever grows at its end (a request's output in the reducer's state): then they are
    copied out on first access, so that a cumulative output costs a step nothing until it is
    read.
    """

    __slots__ = (
        "index",
        "finish_reason",
        "_token_ids",
        "_logprobs",
        "_span",
        "_text",
        "_decode",
        "_top",
        "stop_reason",
    )

    def __init__(
        self,
        index: int,
        text: str | None,
        token_ids: list[int],
        finish_reason: str | None = None,
        logprobs: list[float] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        top_logprobs: list[dict[int, float]] | None = None,
        stop_reason: str | None = None,
    ) -> None:
        self.index = index
        # With logprobs=k > 0, vLLM's dict per position: the sampled token, then the top k.
        self._top = top_logprobs
        self.stop_reason = stop_reason  # the stop string that finished it, as vLLM's
        self._token_ids: list[int] | None = token_ids
        self.finish_reason = finish_reason
        self._logprobs = logprobs
        self._span: (
            tuple[list[int], list[float] | None, list[dict[int, float]] | None, int, int] | None
        ) = None
        self._text = text
        self._decode = decode

    @classmethod
    def of_span(
        cls,
        tokens: list[int],
        logprobs: list[float] | None,
        start: int,
        end: int,
        finish_reason: str | None,
        decode: Callable[[list[int]], str] | None,
        top_logprobs: list[dict[int, float]] | None = None,
        stop_reason: str | None = None,
    ) -> CompletionOutput:
        """tokens[start:end] (and logprobs[start:end]) of append-only lists, copied when read."""
        out = cls(0, None, [], finish_reason, None, decode, None, stop_reason)
        out._token_ids = None
        out._span = (tokens, logprobs, top_logprobs, start, end)
        return out

    def _copy_span(self) -> None:
        assert self._span is not None
        tokens, logprobs, top, start, end = self._span
        self._token_ids = tokens[start:end]
        self._logprobs = logprobs[start:end] if logprobs is not None else None
        self._top = top[start:end] if top is not None else None
        self._span = None

    @property
    def token_ids(self) -> list[int]:
        if self._span is not None:
            self._copy_span()
        assert self._token_ids is not None
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        if self._span is not None:
            self._copy_span()
        self._token_ids = value

    @property
    def logprobs(self) -> list[float] | None:
        if self._span is not None:
            self._copy_span()
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value: list[float] | None) -> None:
        if self._span is not None:
            self._copy_span()
        self._logprobs = value

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        if self._span is not None:
            self._copy_span()
        return self._top

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
            other.index,
            other.token_ids,
            other.finish_reason,
            other.logprobs,
            other.text,
        )

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, finish_reason={self.finish_reason!r})"
        )


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
    top_logprobs: list[dict[int, float]] | None = None,
    stop_reason: str | None = None,
) -> RequestOutput | None:
    """The output a client of this kind gets when `num_new` tokens (the tail of `token_ids`,
    every token delivered so far) arrive, or the request finishes: all of them (CUMULATIVE),
    the new ones (DELTA), or nothing until the end and then all of them (FINAL_ONLY)."""
    finished = finish_reason is not None
    if kind == RequestOutputKind.FINAL_ONLY and not finished:
        return None
    end = len(token_ids)
    start = end - num_new if kind == RequestOutputKind.DELTA else 0
    # The caller's lists only grow at the end: the span is copied out when it is read.
    completion = CompletionOutput.of_span(
        token_ids, logprobs, start, end, finish_reason, decode, top_logprobs, stop_reason
    )
    return RequestOutput(request_id, prompt_token_ids, [completion], finished, prompt)
