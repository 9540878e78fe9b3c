"""POST /v1/completions: a string, token ids, or a list of either (one choice per prompt)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokentape.engine.outputs import CompletionOutput, RequestOutput
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.serving import (
    SSE_DONE,
    APIError,
    OpenAIServing,
    SSEFramer,
    detokenizer,
    merge_streams,
    sse_bytes,
    usage_of,
)


def completion_prompts(serving: OpenAIServing, prompt: str | list[Any]) -> list[list[int]]:
    encode = serving.engine.tokenizer.encode

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

async def create_completion(serving: OpenAIServing, req: p.CompletionRequest, request: Request) -> Response:
    """POST /v1/completions: one choice per prompt, streamed as SSE or in one body."""
    serving.check_model(req.model)
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    prompts = completion_prompts(serving, req.prompt)
    params = serving.sampling_params(req, req.max_tokens, max(map(len, prompts)), req.logprobs)
    request_id = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
    streams = await serving.start(request, prompts, params, request_id)
    created = int(time.time())
    decode = serving.engine.tokenizer.decode
    detoks = [detokenizer(serving.engine.tokenizer) for _ in streams]

    def choice(i: int, out: RequestOutput) -> p.CompletionChoice:
        c = out.outputs[0]
        text = detoks[i].add(c.token_ids, out.finished)
        lps = None
        if req.logprobs is not None and c.logprobs is not None:
            offset = detoks[i].num_chars - len(text)
            pieces = [decode([t]) for t in c.token_ids]
            offsets = [offset + sum(len(x) for x in pieces[:j]) for j in range(len(pieces))]
            lps = p.CompletionLogprobs(pieces, list(c.logprobs), offsets)
        return p.CompletionChoice(
            i, text, c.finish_reason, lps,
            token_ids=c.token_ids if req.return_token_ids else None,  # a copy already
            prompt_token_ids=None,
        )

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        async def sse() -> AsyncIterator[bytes]:
            first = [True] * len(streams)
            generated = 0
            framer = SSEFramer(p.CompletionResponse(request_id, created, serving.model_name, []))
            async for i, out in merge_streams(streams):
                ch = choice(i, out)
                generated += len(out.outputs[0].token_ids)
                if first[i] and req.return_token_ids:
                    ch.prompt_token_ids = streams[i].prompt_token_ids
                first[i] = False
                yield framer.chunk(ch)
            if include_usage:
                usage = usage_of(streams, generated)
                yield sse_bytes(p.CompletionResponse(request_id, created, serving.model_name, [], usage))
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
            merged = RequestOutput(out.request_id, s.prompt_token_ids, [CompletionOutput(
                0, None, tokens, reason, lps if req.logprobs is not None else None)], True)
            ch = choice(i, merged)
            if req.return_token_ids:
                ch.prompt_token_ids = s.prompt_token_ids
            choices.append(ch)
        return p.CompletionResponse(request_id, created, serving.model_name, choices, usage_of(streams, generated))

    body = await serving.finish(request, streams, collect())
    return Response(p.encode_json(body), media_type="application/json")
