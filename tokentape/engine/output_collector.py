"""AsyncLLM's per-request buffer between the engine core's outputs and the request's
consumer: what each engine request sent since the consumer last took, merged."""

from __future__ import annotations

import asyncio

from tokentape.engine.core.messages import CoreOutput, rebuild_error
from tokentape.events.schema import SamplingParams


class Delta:
    """What one engine request (a request, or a child of n > 1) sent since its consumer last
    took: new tokens, their logprobs and top-k alternatives, the finish."""

    __slots__ = ("tokens", "logprobs", "top", "finish_reason", "stop_reason")

    def __init__(self, with_logprobs: bool, with_top: bool) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if with_logprobs else None
        self.top: list[dict[int, float]] | None = [] if with_top else None
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None


class RequestOutputCollector:
    """A request's deltas not yet taken by its consumer, merged per engine request (index 0,
    or the child's index for n > 1): a slow consumer gets one output with everything new
    instead of a queue of them (as vLLM's collector).

    With `stream_interval` N > 1 (vLLM's --stream-interval) the consumer is woken for an
    engine request's first tokens, then once N tokens have gathered, at its finish, on an
    error, or when `flush` says so (a pause): fewer, larger outputs, so a server spends less
    per token, and the tokens reach the client up to N - 1 steps later."""

    __slots__ = ("with_logprobs", "with_top", "deltas", "error", "_ready", "_interval", "_started")

    def __init__(self, params: SamplingParams, stream_interval: int = 1) -> None:
        self.with_logprobs = params.logprobs is not None
        self.with_top = bool(params.logprobs)
        self.deltas: dict[int, Delta] = {}
        self.error: Exception | None = None
        self._ready = asyncio.Event()
        self._interval = stream_interval
        self._started: set[int] = set()  # the engine requests whose first tokens were released

    def put(self, index: int, out: CoreOutput) -> None:
        if out.error is not None:
            self.error = rebuild_error(out.error)
        else:
            d = self.deltas.get(index)
            if d is None:
                d = self.deltas[index] = Delta(self.with_logprobs, self.with_top)
            d.tokens += out.new_token_ids
            if d.logprobs is not None and out.new_logprobs:
                d.logprobs += out.new_logprobs
            if d.top is not None and out.new_top_logprobs:
                d.top += out.new_top_logprobs
            if out.finish_reason is not None:
                d.finish_reason, d.stop_reason = out.finish_reason, out.stop_reason
            if (
                self._interval > 1
                and out.finish_reason is None
                and index in self._started
                and len(d.tokens) < self._interval
            ):
                return  # gathering: the consumer is woken at N tokens, the finish or a flush
            self._started.add(index)
        self._ready.set()

    def flush(self) -> None:
        """Wake the consumer for whatever has gathered (a pause: drained tokens go out)."""
        if self.deltas:
            self._ready.set()

    def fail(self, exc: Exception) -> None:
        self.error = exc
        self._ready.set()

    async def get(self) -> dict[int, Delta]:
        await self._ready.wait()
        self._ready.clear()
        if self.error is not None:
            raise self.error
        got, self.deltas = self.deltas, {}
        return got
