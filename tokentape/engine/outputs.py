"""What the engine core hands out (`EngineCoreOutput`: one request's new tokens, as
`OutputsEmitted` records them) and what a client gets back, in vLLM's shape (`RequestOutput`,
built from the core's outputs by the output processor, output_processor.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from tokentape.events.schema import PromptLogprobs, RequestOutputKind

__all__ = [
    "CompletionOutput",
    "EngineCoreOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SpanSource",
]


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """New tokens of one engine request (a request, or a child of n > 1) since its last
    output: what the core emits after a step, in the process or across the process boundary.
    `error` set: the request was refused before anything was recorded (`(type, message)`),
    and nothing else will come for it."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    finish_reason: str | None = None
    error: tuple[str, str] | None = None
    # vLLM's stop_reason, with the finish: the stop string or stop token id that ended it.
    stop_reason: str | int | None = None
    # With SamplingParams.logprobs = k > 0: per new token, the logprobs of the k most likely ids
    # and the sampled one.
    new_top_logprobs: list[dict[int, float]] | None = None
    # With SamplingParams.prompt_logprobs: the prompt's, with the request's first tokens.
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's weight_version (#49040) of the weights that computed the new tokens: the one in
    # force when they were delivered (an update needs a drained engine, reducer.py checks it).
    weight_version: str | None = None
    # A request with stop strings: the text its new tokens add, decoded by the engine core,
    # which looked for the stop strings in it (stop_strings.py); held back and cut as the
    # client may see it. None: the output processor decodes the tokens itself.
    new_text: str | None = None


class SpanSource(Protocol):
    """Append-only lists a completion's tokens are read from (the output processor's)."""

    tokens: list[int]
    logprobs: list[float] | None
    top: list[dict[int, float]] | None
    versions: list[tuple[int, str]]  # where each weight version's tokens begin, in order


# The text of tokens[:end] of a source, the output finished or not, decoded when first read.
TextOf = Callable[[Any, int, bool], str]


def versions_between(spans: list[tuple[int, str]], start: int, end: int) -> list[str]:
    """One weight version per token in [start, end) (spans as SpanSource.versions)."""
    out: list[str] = []
    for i, (begin, version) in enumerate(spans):
        stop = spans[i + 1][0] if i + 1 < len(spans) else end
        lo, hi = max(begin, start), min(stop, end)
        if hi > lo:
            out += [version] * (hi - lo)
    return out


class CompletionOutput(msgspec.Struct, gc=False):
    """One completion: its token ids, text, logprobs and finish.

    The token ids (and logprobs) may be given as a span [start, end) of a source whose lists
    only ever grow at their end (the output processor's): then they are copied out on first
    access, and the text may be given as a function computing it on first access, so that a
    cumulative output costs a step nothing until it is read. A step builds one per running
    request, which the caller keeps until the next step: so, like RequestOutput, it is
    untracked by the garbage collector (it takes part in no reference cycle).

    Built as `CompletionOutput(index, text, token_ids, finish_reason, logprobs, top_logprobs,
    stop_reason, weight_versions)`, positionally (the fields behind the properties are
    private); it pickles as those values.
    """

    index: int
    _text: str | None  # None: _text_of gives it when first read
    _token_ids: list[int] | None  # None: the span of _source, copied when first read
    finish_reason: str | None = None
    _logprobs: list[float] | None = None
    # With logprobs=k > 0, vLLM's dict per position: the sampled token, then the top k.
    _top: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id
    _versions: list[str] | None = None
    _source: SpanSource | None = None
    _start: int = 0
    _end: int = 0
    _text_of: TextOf | None = None

    @classmethod
    def of_span(
        cls,
        index: int,
        source: SpanSource,
        start: int,
        end: int,
        text: str | TextOf,
        finish_reason: str | None,
        stop_reason: str | int | None,
    ) -> CompletionOutput:
        """source's tokens[start:end] (and logprobs, and the weight versions that computed
        them), copied when read; the text, or a function text(source, end, finished) giving
        it when it is first read."""
        fixed, text_of = (text, None) if isinstance(text, str) else (None, text)
        return cls(
            index,
            fixed,
            None,
            finish_reason,
            None,
            None,
            stop_reason,
            None,
            source,
            start,
            end,
            text_of,
        )

    def _copy_span(self) -> None:
        source, start, end = self._source, self._start, self._end
        assert source is not None
        self._token_ids = source.tokens[start:end]
        self._logprobs = source.logprobs[start:end] if source.logprobs is not None else None
        self._top = source.top[start:end] if source.top is not None else None
        self._versions = versions_between(source.versions, start, end)
        if self._text_of is None:
            self._source = None  # the text needs it no longer

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            self._copy_span()
        assert self._token_ids is not None
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        if self._token_ids is None:
            self._copy_span()
        self._token_ids = value

    @property
    def logprobs(self) -> list[float] | None:
        if self._token_ids is None:
            self._copy_span()
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value: list[float] | None) -> None:
        if self._token_ids is None:
            self._copy_span()
        self._logprobs = value

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        if self._token_ids is None:
            self._copy_span()
        return self._top

    @top_logprobs.setter
    def top_logprobs(self, value: list[dict[int, float]] | None) -> None:
        if self._token_ids is None:
            self._copy_span()
        self._top = value

    @property
    def weight_versions(self) -> list[str]:
        """Per token of `token_ids`, the weight version that computed it (vLLM #49040's
        weight_version, token by token: a rollout that spans an update says which tokens
        came from which weights)."""
        if self._token_ids is None:
            self._copy_span()
        if self._versions is None:
            self._versions = []
        return self._versions

    @property
    def weight_version(self) -> str | None:
        """vLLM's weight_version: the version that computed this output's first token (as
        vLLM's RFC #54443 recommends for one label per output); None without tokens.
        `weight_versions` has every token's."""
        versions = self.weight_versions
        return versions[0] if versions else None

    @property
    def text(self) -> str:
        if self._text is None:
            assert self._text_of is not None
            text = self._text_of(self._source, self._end, self.finish_reason is not None)
            self._text, self._text_of = text, None
            if self._token_ids is not None:
                self._source = None
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text, self._text_of = value, None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Append a later DELTA completion of the same index (a consumer that fell behind
        gets one output with everything new)."""
        self.text += delta.text
        self.token_ids = self.token_ids + delta.token_ids
        self._versions = self.weight_versions + delta.weight_versions
        if self.logprobs is not None:
            self.logprobs = self.logprobs + (delta.logprobs or [])
        if self.top_logprobs is not None:
            self.top_logprobs = self.top_logprobs + (delta.top_logprobs or [])
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return (
            self.index,
            self.token_ids,
            self.finish_reason,
            self.stop_reason,
            self.logprobs,
            self.top_logprobs,
            self.text,
        ) == (
            other.index,
            other.token_ids,
            other.finish_reason,
            other.stop_reason,
            other.logprobs,
            other.top_logprobs,
            other.text,
        )

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, finish_reason={self.finish_reason!r}, "
            f"stop_reason={self.stop_reason!r})"
        )

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Pickled as its values (a span's source and a text function stay behind)."""
        return (
            CompletionOutput,
            (
                self.index,
                self.text,
                self.token_ids,
                self.finish_reason,
                self.logprobs,
                self.top_logprobs,
                self.stop_reason,
                self.weight_versions,
            ),
        )


class RequestOutput(msgspec.Struct, gc=False):
    """One request's output, as vLLM's. Untracked by the garbage collector (it takes part in
    no reference cycle): `step()` returns one per running request, which the caller keeps
    until the next step; tracked, they survived into the old generation and set off a full
    collection (~20 ms in a process with torch) every ~80 steps of 256 requests."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    metrics: dict[str, int] | None = None  # as vLLM's without stats: none are kept
    # vLLM's, with SamplingParams.prompt_logprobs: per prompt position, None for the first,
    # then {prompt token: logprob, the top k...}; in the first output only (later: []).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def add(self, later: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one, as vLLM's
        RequestOutput.add: DELTA completions (`aggregate`) are appended to those of the same
        index, others replace them; completions of other indexes join, in index order."""
        by_index = {c.index: c for c in self.outputs}
        for c in later.outputs:
            mine = by_index.get(c.index)
            if mine is not None and aggregate:
                mine.add(c)
            else:
                by_index[c.index] = c
        self.outputs = [by_index[i] for i in sorted(by_index)]
        self.finished = later.finished
        if not self.prompt_logprobs:  # delivered once: the first output that has them
            self.prompt_logprobs = later.prompt_logprobs
