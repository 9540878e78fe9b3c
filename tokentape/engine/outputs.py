"""What the client gets back, in vLLM's shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


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
