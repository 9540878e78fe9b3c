"""The OpenAI-compatible completions and chat completions over AsyncLLM: request checks, the
stream of each prompt (DELTA outputs, text decoded incrementally), SSE chunks or one response.

A request that the checks or the engine refuse gets a 400 before any byte of the response
is sent (the engine refuses before recording anything); a client that goes away cancels its
streams, which aborts their requests on the tape.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokentape.engine.async_llm import AsyncLLM
from tokentape.engine.llm_engine import EngineDeadError
from tokentape.engine.outputs import RequestOutput
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.chat_template import ChatTemplate, ChatTemplateError, message_text
from tokentape.entrypoints.metrics import RequestTimer, ServerMetrics
from tokentape.events.schema import RequestOutputKind, SamplingParams

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """An OpenAI-style error response: status, message, type, param."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param


class ClientGone(Exception):
    """The client disconnected before the response started."""


class IncrementalDetokenizer:
    """Text deltas of a growing token list, decoding only a short window (as vLLM does): the
    tokens since the last emitted text, after those before it (so a tokenizer that joins
    pieces with spaces decodes them in context). A byte sequence cut inside a UTF-8 character
    is held back until the character is complete, or the stream ends."""

    __slots__ = ("decode", "tokens", "text", "prefix_offset", "read_offset")

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.tokens, self.text = decode, [], ""
        self.prefix_offset = self.read_offset = 0

    def add(self, new_tokens: list[int], final: bool) -> str:
        tokens = self.tokens
        tokens += new_tokens
        prefix = self.decode(tokens[self.prefix_offset:self.read_offset]) if self.read_offset > self.prefix_offset else ""
        full = self.decode(tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or (not final and full.endswith("\ufffd")):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        self.text += delta
        return delta


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work` unless the client disconnects first; then cancel it (aborting its
    requests) and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # its streams are closed (aborted) now
    raise ClientGone()


class PromptStream:
    """One prompt's generation: its first output is taken before the response starts, so a
    refusal still becomes a 400."""

    def __init__(self, agen: AsyncIterator[RequestOutput], prompt_token_ids: list[int], timer: RequestTimer) -> None:
        self.agen, self.prompt_token_ids, self.timer = agen, prompt_token_ids, timer
        self.first: RequestOutput | None = None
        self.finished = False

    async def start(self) -> None:
        self.first = await self._next()

    async def _next(self) -> RequestOutput:
        out = await self.agen.__anext__()
        self.timer.output(len(out.outputs[0].token_ids))
        if out.finished:
            self.finished = True
            self.timer.finished(out.outputs[0].finish_reason or "abort", len(self.prompt_token_ids))
        return out

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            if self.first is not None:
                first, self.first = self.first, None
                yield first
            while not self.finished:
                yield await self._next()
        finally:
            if not self.finished:
                self.finished = True
                self.timer.finished("abort", len(self.prompt_token_ids))
            await self.agen.aclose()  # type: ignore[attr-defined]  # aborts if cut short


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, chat_template: ChatTemplate, metrics: ServerMetrics) -> None:
        self.engine, self.model_name, self.chat_template, self.metrics = engine, model_name, chat_template, metrics

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    def sampling_params(self, req: p._SamplingFields, max_tokens: int | None, num_prompt_tokens: int,
                        logprobs: int | None) -> SamplingParams:
        if req.n != 1:
            raise APIError(400, f"n must be 1 (one choice per prompt), got {req.n}", param="n")
        if req.stop:
            raise APIError(400, "stop strings are not supported; use stop_token_ids", param="stop")
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - num_prompt_tokens)
        top_k = 0 if req.top_k in (None, -1) else req.top_k
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=top_k,  # type: ignore[arg-type]
                seed=req.seed,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                output_kind=RequestOutputKind.DELTA,
            )
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None

    async def _start(self, request: Request, prompts: list[list[int]], params: SamplingParams,
                     request_id: str) -> list[PromptStream]:
        streams = [
            PromptStream(self.engine.generate(tokens, params, f"{request_id}-{i}"), tokens, RequestTimer(self.metrics))
            for i, tokens in enumerate(prompts)
        ]

        async def start_all() -> None:
            tasks = [asyncio.ensure_future(s.start()) for s in streams]
            try:
                await asyncio.gather(*tasks)
            except BaseException:  # one refused, or the client left: end them all (aborts)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.gather(*(s.agen.aclose() for s in streams), return_exceptions=True)  # type: ignore[attr-defined]
                raise

        try:
            await until_disconnect(request, start_all())
        except (ValueError, TypeError) as exc:  # refused by the engine, nothing recorded
            raise APIError(400, str(exc)) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from None
        return streams

    # -- /v1/completions -------------------------------------------------------------------------

    def _completion_prompts(self, prompt: str | list[Any]) -> list[list[int]]:
        encode = self.engine.tokenizer.encode

        def one(x: Any) -> list[int]:
            if isinstance(x, str):
                try:
                    return encode(x)
                except UnicodeError as exc:
                    raise APIError(400, f"the prompt cannot be encoded: {exc}", param="prompt") from None
            return x

        if isinstance(prompt, str):
            return [one(prompt)]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if all(type(t) is int for t in prompt):
            return [prompt]
        if all(isinstance(x, str) or (isinstance(x, list) and x and all(type(t) is int for t in x)) for x in prompt):
            return [one(x) for x in prompt]
        raise APIError(400, "prompt must be a string, a list of token ids, or a list of either", param="prompt")

    async def completions(self, req: p.CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompts = self._completion_prompts(req.prompt)
        params = self.sampling_params(req, req.max_tokens, max(map(len, prompts)), req.logprobs)
        request_id = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        streams = await self._start(request, prompts, params, request_id)
        created = int(time.time())
        decode = self.engine.tokenizer.decode
        detoks = [IncrementalDetokenizer(decode) for _ in streams]

        def choice(i: int, out: RequestOutput) -> p.CompletionChoice:
            c = out.outputs[0]
            text = detoks[i].add(c.token_ids, out.finished)
            lps = None
            if req.logprobs is not None and c.logprobs is not None:
                offset = len(detoks[i].text) - len(text)
                pieces = [decode([t]) for t in c.token_ids]
                offsets = [offset + sum(len(x) for x in pieces[:j]) for j in range(len(pieces))]
                lps = p.CompletionLogprobs(pieces, list(c.logprobs), offsets)
            return p.CompletionChoice(
                i, text, c.finish_reason, lps,
                token_ids=list(c.token_ids) if req.return_token_ids else None,
                prompt_token_ids=None,
            )

        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            async def sse() -> AsyncIterator[bytes]:
                first = [True] * len(streams)
                generated = 0
                async for i, out in _merge(streams):
                    ch = choice(i, out)
                    generated += len(out.outputs[0].token_ids)
                    if first[i] and req.return_token_ids:
                        ch.prompt_token_ids = streams[i].prompt_token_ids
                    first[i] = False
                    yield _sse(p.CompletionResponse(request_id, created, self.model_name, [ch]))
                if include_usage:
                    usage = _usage(streams, generated)
                    yield _sse(p.CompletionResponse(request_id, created, self.model_name, [], usage))
                yield SSE_DONE

            return StreamingResponse(sse(), media_type="text/event-stream")

        async def collect() -> p.CompletionResponse:
            choices: list[p.CompletionChoice] = []
            generated = 0
            for i, s in enumerate(streams):
                tokens: list[int] = []
                lps: list[float] = []
                reason = None
                async for out in s.outputs():
                    tokens += out.outputs[0].token_ids
                    lps += out.outputs[0].logprobs or ()
                    reason = out.outputs[0].finish_reason
                generated += len(tokens)
                merged = RequestOutput(out.request_id, s.prompt_token_ids, [type(out.outputs[0])(
                    0, None, tokens, reason, lps if req.logprobs is not None else None)], True)
                ch = choice(i, merged)
                if req.return_token_ids:
                    ch.prompt_token_ids = s.prompt_token_ids
                choices.append(ch)
            return p.CompletionResponse(request_id, created, self.model_name, choices, _usage(streams, generated))

        body = await self._finish(request, streams, collect())
        return Response(p.encode_json(body), media_type="application/json")

    async def _finish(self, request: Request, streams: list[PromptStream], work: Awaitable[T]) -> T:
        try:
            return await until_disconnect(request, work)
        except BaseException:
            for s in streams:
                await s.agen.aclose()  # type: ignore[attr-defined]
            raise

    # -- /v1/chat/completions ----------------------------------------------------------------------

    async def chat(self, req: p.ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        try:
            messages = [message_text(m.role, m.content) for m in req.messages]
            text = self.chat_template.render(messages, req.add_generation_prompt)
            tokens = self.engine.tokenizer.encode(text)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except UnicodeError as exc:
            raise APIError(400, f"the messages cannot be encoded: {exc}", param="messages") from None
        if not tokens:
            raise APIError(400, "the rendered chat prompt is empty", param="messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, len(tokens), logprobs)
        request_id = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._start(request, [tokens], params, request_id)
        created = int(time.time())
        decode = self.engine.tokenizer.decode
        detok = IncrementalDetokenizer(decode)

        def chat_logprobs(out: RequestOutput) -> p.ChatChoiceLogprobs | None:
            c = out.outputs[0]
            if not req.logprobs or c.logprobs is None:
                return None
            content = []
            for t, lp in zip(c.token_ids, c.logprobs):
                piece = decode([t])
                content.append(p.ChatLogprob(piece, lp, list(piece.encode("utf-8", "replace"))))
            return p.ChatChoiceLogprobs(content)

        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            async def sse() -> AsyncIterator[bytes]:
                role = p.ChatDelta("assistant", "")
                yield _sse(p.ChatCompletionChunk(request_id, created, self.model_name,
                                                 [p.ChatStreamChoice(0, role, None)]))
                generated = 0
                async for _, out in _merge(streams):
                    c = out.outputs[0]
                    generated += len(c.token_ids)
                    delta = p.ChatDelta(content=detok.add(c.token_ids, out.finished))
                    ch = p.ChatStreamChoice(0, delta, c.finish_reason, chat_logprobs(out),
                                            list(c.token_ids) if req.return_token_ids else None)
                    yield _sse(p.ChatCompletionChunk(request_id, created, self.model_name, [ch]))
                if include_usage:
                    yield _sse(p.ChatCompletionChunk(request_id, created, self.model_name, [],
                                                     _usage(streams, generated)))
                yield SSE_DONE

            return StreamingResponse(sse(), media_type="text/event-stream")

        async def collect() -> p.ChatCompletionResponse:
            out_tokens: list[int] = []
            lps: list[p.ChatLogprob] = []
            reason = None
            async for out in streams[0].outputs():
                out_tokens += out.outputs[0].token_ids
                got = chat_logprobs(out)
                lps += got.content if got else ()
                reason = out.outputs[0].finish_reason
            message = p.ChatResponseMessage("assistant", detok.add(out_tokens, True))
            ch = p.ChatChoice(0, message, reason, p.ChatChoiceLogprobs(lps) if req.logprobs else None,
                              out_tokens if req.return_token_ids else None)
            return p.ChatCompletionResponse(request_id, created, self.model_name, [ch],
                                            _usage(streams, len(out_tokens)))

        body = await self._finish(request, streams, collect())
        return Response(p.encode_json(body), media_type="application/json")


def _sse(chunk: Any) -> bytes:
    return b"data: " + p.encode_json(chunk) + b"\n\n"


def _usage(streams: list[PromptStream], generated: int) -> p.UsageInfo:
    prompt = sum(len(s.prompt_token_ids) for s in streams)
    return p.UsageInfo(prompt, generated, prompt + generated)


async def _merge(streams: list[PromptStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every stream's outputs as they come, tagged with the stream's index; cancelling the
    consumer cancels (and so aborts) every stream still running."""
    if len(streams) == 1:
        async for out in streams[0].outputs():
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, s: PromptStream) -> None:
        try:
            async for out in s.outputs():
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
