"""What the OpenAI-compatible endpoints share over AsyncLLM (as vLLM's serving_engine.py):
OpenAIServing, which every endpoint is handed, with its request checks, sampling params and
the stream of each prompt (DELTA outputs of AsyncLLM's output processor); SSE framing;
errors. The endpoints themselves are in serving_completion.py, serving_chat.py and
serving_tokenization.py.

A request that the checks or the engine refuse gets a 400 before any byte of the response
is sent (the engine refuses before recording anything); a client that goes away cancels its
streams, which aborts their requests on the tape.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any, TypeVar
from uuid import uuid4

from starlette.requests import Request

from tokentape.engine.async_llm import AsyncLLM
from tokentape.engine.outputs import RequestOutput
from tokentape.engine.request_checks import check_prompt_fits
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.chat_template import ChatTemplate
from tokentape.entrypoints.metrics import RequestTimer, ServerMetrics
from tokentape.entrypoints.refusals import APIError, check_fits_context, refusal
from tokentape.errors import EngineDeadError
from tokentape.events.schema import RequestOutputKind, SamplingParams
from tokentape.lora.request import LoRARequest
from tokentape.version import __version__

__all__ = ["APIError", "ClientGone", "OpenAIServing", "PromptStream", "guarded_sse"]

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
logger = logging.getLogger("tokentape.serve")


class ClientGone(Exception):
    """The client disconnected before the response started."""


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

    def __init__(
        self, agen: AsyncIterator[RequestOutput], prompt_token_ids: list[int], timer: RequestTimer
    ) -> None:
        self.agen, self.prompt_token_ids, self.timer = agen, prompt_token_ids, timer
        self.first: RequestOutput | None = None
        self.finished = False

    async def start(self) -> None:
        self.first = await self._next()

    async def _next(self) -> RequestOutput:
        out = await self.agen.__anext__()
        self.timer.output(sum(len(c.token_ids) for c in out.outputs))
        if out.finished:
            self.finished = True
            self.timer.finished(out.outputs[0].finish_reason or "abort", len(self.prompt_token_ids))
        return out

    async def whole(self) -> RequestOutput:
        """Every output of the stream in one: its DELTA outputs appended, finished."""
        whole: RequestOutput | None = None
        async for out in self.outputs():
            if whole is None:
                whole = out
            else:
                whole.add(out, aggregate=True)
        assert whole is not None  # a stream ends with its finished output
        return whole

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
    """The endpoints' shared state and steps over one AsyncLLM (vLLM's OpenAIServing, which
    there is the endpoints' base class; here each endpoint is a function handed it): the
    served model's name, its chat template, the metrics, the request checks and the start
    and finish of a request's streams."""

    def __init__(
        self, engine: AsyncLLM, model_name: str, chat_template: ChatTemplate, metrics: ServerMetrics
    ) -> None:
        self.engine, self.model_name, self.chat_template, self.metrics = (
            engine,
            model_name,
            chat_template,
            metrics,
        )
        self._fingerprint: str | None = None
        # The LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter); a request
        # whose `model` names one runs with it. Ids are given in order from 1, as vLLM's.
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_lora_id = 1

    def add_lora_module(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter in `path` under `name` (its id the next one)."""
        lora = LoRARequest(name, self._next_lora_id, path)
        self._next_lora_id += 1
        self.lora_requests[name] = lora
        return lora

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model."""
        self.check_model(model)
        return None if model is None else self.lora_requests.get(model)

    @property
    def system_fingerprint(self) -> str:
        """vLLM's system_fingerprint, `tokentape-<version>-<hash8>`: the hash of what shapes
        every output (the model, its vocabulary, the context), so a client sees a change."""
        if self._fingerprint is None:
            e = self.engine
            identity = f"{e.model_id}|{e.vocab_size}|{e.max_model_len}".encode()
            self._fingerprint = (
                f"tokentape-{__version__}-{hashlib.sha256(identity).hexdigest()[:8]}"
            )
        return self._fingerprint

    def request_id(self, request: Request, given: str | None, prefix: str) -> str:
        """The response id: vLLM's `request_id` field (`given`), else the X-Request-Id header,
        else a new one."""
        return given or request.headers.get("x-request-id") or f"{prefix}-{uuid4().hex}"

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.lora_requests:
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    def sampling_params(
        self,
        req: p.SamplingFields,
        max_tokens: int | None,
        num_prompt_tokens: int,
        logprobs: int | None,
        aliases: Mapping[str, str],
        prompt_logprobs: int | None = None,
        *,
        stream: bool = False,
        stream_options: p.StreamOptions | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; a refused value is a 400 naming its field (as the
        endpoint calls it: `aliases`). As vLLM's: a prompt past the context is refused in
        vLLM's words, `max_tokens` None means the rest of the context, an explicit
        max_tokens past it is refused, and stream options are refused without a stream."""
        max_model_len = self.engine.max_model_len
        if num_prompt_tokens >= max_model_len:  # before max_tokens: the prompt is the fault
            try:
                check_prompt_fits(num_prompt_tokens, max_model_len)
            except ValueError as exc:
                raise refusal(exc, aliases) from None
        options = stream_options
        if options is not None and not stream and options != p.StreamOptions():
            raise APIError(  # vLLM's words; an empty object passes, as in vLLM
                400,
                "Stream options can only be defined when `stream=True`.",
                param="stream_options",
            )
        asked = max_tokens
        if max_tokens is None:
            max_tokens = max(1, max_model_len - num_prompt_tokens)
        top_k = 0 if req.top_k in (None, -1) else req.top_k
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=top_k,  # type: ignore[arg-type]
                seed=req.seed,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                output_kind=RequestOutputKind.DELTA,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0
                if req.repetition_penalty is None
                else req.repetition_penalty,
                min_tokens=req.min_tokens,
                stop=req.stop or (),
                include_stop_str_in_output=req.include_stop_str_in_output,
                n=req.n,
                bad_words=tuple(req.bad_words or ()),
                min_p=req.min_p or 0.0,
                logit_bias=logit_bias_ids(req.logit_bias),
                prompt_logprobs=prompt_logprobs,
            )
        except (ValueError, TypeError) as exc:
            raise refusal(exc, aliases) from None
        check_fits_context(
            num_prompt_tokens, asked, max_model_len, aliases.get("max_tokens", "max_tokens")
        )
        return params

    async def start(
        self,
        request: Request,
        prompts: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        request_id: str,
        aliases: Mapping[str, str],
        model: str | None = None,
    ) -> list[PromptStream]:
        """Start every prompt's stream (with its own params, when a list is given) and take
        its first output: a refusal by the engine (nothing recorded) is a 400 naming its
        field, a dead engine a 503. Every prompt is checked first, so a request of several is
        refused whole, none of it recorded."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        lora = self.lora_for(model)
        for tokens in prompts:
            try:
                self.engine.check_prompt(tokens)
            except (ValueError, TypeError) as exc:
                raise refusal(exc, aliases) from None
        streams = [
            PromptStream(
                self.engine.generate(tokens, prompt_params, f"{request_id}-{i}", lora_request=lora),
                tokens,
                RequestTimer(self.metrics),
            )
            for i, (tokens, prompt_params) in enumerate(zip(prompts, each, strict=True))
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
            raise refusal(exc, aliases) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from None
        return streams

    async def finish(self, request: Request, streams: list[PromptStream], work: Awaitable[T]) -> T:
        try:
            return await until_disconnect(request, work)
        except BaseException:
            for s in streams:
                await s.agen.aclose()  # type: ignore[attr-defined]
            raise


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as strings) as SamplingParams takes it, each bias
    clamped to [-100, 100] as vLLM's; a key that is no integer is refused in vLLM's words."""
    if not bias:
        return {}
    bad = [k for k in bias if not k.strip().lstrip("+-").isdigit()]
    if bad:
        raise APIError(
            400,
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
            param="logit_bias",
        )
    return {int(k): min(100.0, max(-100.0, v)) for k, v in bias.items()}


def sse_bytes(chunk: Any) -> bytes:
    return b"data: " + p.encode_json(chunk) + b"\n\n"


def sse_error(message: str, type: str, status: int) -> bytes:
    """vLLM's error event in a stream: the OpenAI error body as an SSE event."""
    return sse_bytes(p.ErrorResponse(p.ErrorInfo(message, type, None, status)))


async def guarded_sse(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream that fails after its response started ends as vLLM's does: an error event,
    then [DONE], so the client reads a clean end rather than a cut connection. A client
    that leaves cancels it (its requests are aborted), as before."""
    try:
        async for chunk in events:
            yield chunk
    except EngineDeadError as exc:
        yield sse_error(str(exc), "ServiceUnavailableError", 503)
        yield SSE_DONE
    except Exception as exc:
        logger.exception("a stream failed after its response started")
        yield sse_error(f"{type(exc).__name__}: {exc}", "InternalServerError", 500)
        yield SSE_DONE


class SSEFramer:
    """The SSE events of one stream, whose chunks differ only in their choices: the envelope
    (id, created, model, object, usage) is encoded once, and each chunk encodes its choices
    alone between the envelope's two halves (the same JSON as sse_bytes of the whole)."""

    __slots__ = ("head", "tail")

    def __init__(self, envelope: Any) -> None:
        """`envelope`: the response with no choices."""
        raw = p.encode_json(envelope)
        # The first '"choices":[]' is the key: inside a JSON string its quotes are escaped.
        at = raw.index(b'"choices":[]') + len(b'"choices":[')
        self.head, self.tail = b"data: " + raw[:at], raw[at:] + b"\n\n"

    def chunk(self, choice: Any) -> bytes:
        return self.head + p.encode_json(choice) + self.tail


def usage_of(streams: list[PromptStream], generated: int) -> p.UsageInfo:
    prompt = sum(len(s.prompt_token_ids) for s in streams)
    return p.UsageInfo(prompt, generated, prompt + generated)


async def merge_streams(streams: list[PromptStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
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
