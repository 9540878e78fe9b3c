"""AsyncLLM's per-request buffer between the output processor and the request's consumer, as
vLLM's RequestOutputCollector: the outputs a slow consumer has not taken yet are merged into
one (DELTA ones appended, others replaced), so it gets everything new at once instead of a
queue of them."""

from __future__ import annotations

import asyncio

from tokentape.engine.outputs import RequestOutput
from tokentape.events.schema import RequestOutputKind, SamplingParams


class RequestOutputCollector:
    __slots__ = ("aggregate", "output", "error", "_ready")

    def __init__(self, params: SamplingParams) -> None:
        self.aggregate = params.output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | None = None
        self.error: Exception | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.output is None:
            self.output = output
        else:
            self.output.add(output, self.aggregate)
        self._ready.set()

    def fail(self, exc: Exception) -> None:
        self.error = exc
        self._ready.set()

    async def get(self) -> RequestOutput:
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self.error is not None:
                raise self.error
            if self.output is not None:
                got, self.output = self.output, None
                return got
