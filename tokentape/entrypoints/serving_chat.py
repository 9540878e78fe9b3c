"""POST /v1/chat/completions: the messages through the chat template, one choice."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokentape.engine.outputs import RequestOutput
from tokentape.entrypoints.chat_template import ChatTemplateError, message_text
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


async def create_chat_completion(serving: OpenAIServing, req: p.ChatCompletionRequest, request: Request) -> Response:
    """POST /v1/chat/completions: the messages through the chat template, one choice."""
    serving.check_model(req.model)
    if not req.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    try:
        messages = [message_text(m.role, m.content) for m in req.messages]
        text = serving.chat_template.render(messages, req.add_generation_prompt)
        tokens = serving.engine.tokenizer.encode(text)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except UnicodeError as exc:
        raise APIError(400, f"the messages cannot be encoded: {exc}", param="messages") from None
    if not tokens:
        raise APIError(400, "the rendered chat prompt is empty", param="messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = serving.sampling_params(req, max_tokens, len(tokens), logprobs)
    request_id = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
    streams = await serving.start(request, [tokens], params, request_id)
    created = int(time.time())
    decode = serving.engine.tokenizer.decode
    detok = detokenizer(serving.engine.tokenizer)

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
            framer = SSEFramer(p.ChatCompletionChunk(request_id, created, serving.model_name, []))
            yield framer.chunk(p.ChatStreamChoice(0, role, None))
            generated = 0
            async for _, out in merge_streams(streams):
                c = out.outputs[0]
                generated += len(c.token_ids)
                delta = p.ChatDelta(content=detok.add(c.token_ids, out.finished))
                ch = p.ChatStreamChoice(0, delta, c.finish_reason, chat_logprobs(out),
                                        c.token_ids if req.return_token_ids else None)  # a copy already
                yield framer.chunk(ch)
            if include_usage:
                yield sse_bytes(p.ChatCompletionChunk(request_id, created, serving.model_name, [],
                                                 usage_of(streams, generated)))
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
        return p.ChatCompletionResponse(request_id, created, serving.model_name, [ch],
                                        usage_of(streams, len(out_tokens)))

    body = await serving.finish(request, streams, collect())
    return Response(p.encode_json(body), media_type="application/json")
