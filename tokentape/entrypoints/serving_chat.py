"""POST /v1/chat/completions: the messages through the chat template, n choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokentape.engine.outputs import CompletionOutput
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.chat_template import ChatTemplateError, message_text
from tokentape.entrypoints.choices import chat_logprobs
from tokentape.entrypoints.serving_engine import (
    SSE_DONE,
    APIError,
    OpenAIServing,
    SSEFramer,
    guarded_sse,
    merge_streams,
    sse_bytes,
    usage_of,
)


def param_aliases(req: p.ChatCompletionRequest) -> dict[str, str]:
    """The engine's names of a refused field, as this chat request calls them."""
    aliases = {"prompt_token_ids": "messages", "prompt": "messages"}
    if req.top_logprobs is not None:
        aliases["logprobs"] = "top_logprobs"
    if req.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    return aliases


def content_of(message: p.ChatMessage) -> str | list[dict[str, object]] | None:
    """A message's content as the chat template's message_text takes it."""
    if isinstance(message.content, list):
        return [{"type": part.type, "text": part.text} for part in message.content]
    return message.content


def generation_prompt(req: p.ChatCompletionRequest | p.TokenizeChatRequest) -> bool:
    """add_generation_prompt as given, else on unless continue_final_message."""
    if req.add_generation_prompt is None:
        return not req.continue_final_message
    return req.add_generation_prompt


def echoed_content(req: p.ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content, when its role is the response's (the
    assistant's with a generation prompt, else the last message's own); else nothing."""
    last = req.messages[-1]
    role = "assistant" if generation_prompt(req) else last.role
    if not req.echo or last.role != role:
        return ""
    return message_text(last.role, content_of(last))["content"]


def chat_prompt(
    serving: OpenAIServing, req: p.ChatCompletionRequest | p.TokenizeChatRequest
) -> list[int]:
    """The messages through the chat template (with vLLM's add_generation_prompt,
    continue_final_message and chat_template_kwargs), encoded: a 400 naming `messages` (or the
    field at fault) when they cannot be."""
    if not req.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(  # vLLM's words
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    kwargs = dict(req.chat_template_kwargs or {})
    if "chat_template" in kwargs:  # vLLM refuses a template smuggled in here too
        raise APIError(
            400,
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
            param="chat_template_kwargs",
        )
    for i, m in enumerate(req.messages):
        for field in ("tool_calls", "tool_call_id"):
            if bytes(getattr(m, field)) not in (b"", b"null", b"[]"):
                raise APIError(
                    400,
                    f"messages[{i}].{field} is not supported: tool calling is not implemented",
                    param="messages",
                )
    add_generation_prompt = generation_prompt(req)
    try:
        messages = [message_text(m.role, content_of(m), m.name) for m in req.messages]
        text = serving.chat_template.render(
            messages, add_generation_prompt, req.continue_final_message, kwargs
        )
        tokens = serving.engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except ValueError as exc:  # a lone surrogate; a checkpoint without a tokenizer
        raise APIError(400, f"the messages cannot be encoded: {exc}", param="messages") from None
    if not tokens:
        raise APIError(400, "the rendered chat prompt is empty", param="messages")
    return tokens


async def create_chat_completion(
    serving: OpenAIServing, req: p.ChatCompletionRequest, request: Request
) -> Response:
    """POST /v1/chat/completions: the messages through the chat template, n choices."""
    serving.check_model(req.model)
    tokens = chat_prompt(serving, req)
    if req.top_logprobs and not req.logprobs:  # vLLM's words: not dropped silently
        raise APIError(
            400,
            "when using `top_logprobs`, `logprobs` must be set to true.",
            param="top_logprobs",
        )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    aliases = param_aliases(req)
    params = serving.sampling_params(
        req,
        max_tokens,
        len(tokens),
        logprobs,
        aliases,
        stream=req.stream,
        stream_options=req.stream_options,
    )
    request_id = serving.request_id(request, req.request_id, "chatcmpl")
    streams = await serving.start(request, [tokens], params, request_id, aliases, req.model)
    model_name = req.model or serving.model_name  # a LoRA adapter's name, as vLLM answers
    created, fp = int(time.time()), serving.system_fingerprint
    tokenizer, n, k = serving.engine.tokenizer, params.n, req.top_logprobs or 0
    head = echoed_content(req)  # before each choice's content (echo)

    def choice_logprobs(c: CompletionOutput) -> p.ChatChoiceLogprobs | None:
        if not req.logprobs or c.logprobs is None:
            return None
        return p.ChatChoiceLogprobs(chat_logprobs(tokenizer.decode, c, k))

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        # vLLM's continuous_usage_stats: every chunk has its choice's usage so far.
        continuous = include_usage and req.stream_options.continuous_usage_stats  # type: ignore[union-attr]
        choice_tokens = [0] * n

        def chunk(ch: p.ChatStreamChoice) -> bytes:
            if not continuous:
                return framer.chunk(ch)
            usage = p.UsageInfo(len(tokens), choice_tokens[ch.index])
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            return sse_bytes(
                p.ChatCompletionChunk(
                    request_id, created, model_name, [ch], usage, system_fingerprint=fp
                )
            )

        framer = SSEFramer(
            p.ChatCompletionChunk(request_id, created, model_name, [], None, system_fingerprint=fp)
        )

        async def sse() -> AsyncIterator[bytes]:
            role = p.ChatDelta("assistant", "")
            for j in range(n):
                yield chunk(p.ChatStreamChoice(j, role, None))
            if head:  # vLLM's echo: a chunk of its own per choice, after the role's
                for j in range(n):
                    yield chunk(p.ChatStreamChoice(j, p.ChatDelta(content=head), None))
            generated = 0
            async for _, out in merge_streams(streams):
                for c in out.outputs:  # n > 1: the choices with something new
                    generated += len(c.token_ids)
                    choice_tokens[c.index] += len(c.token_ids)
                    delta = p.ChatDelta(content=c.text)  # the processor's, cut at a stop string
                    ch = p.ChatStreamChoice(
                        c.index,
                        delta,
                        c.finish_reason,
                        choice_logprobs(c),
                        c.token_ids if req.return_token_ids else None,  # a copy already
                        c.stop_reason,
                    )
                    yield chunk(ch)
            if include_usage:
                yield sse_bytes(
                    p.ChatCompletionChunk(
                        request_id,
                        created,
                        model_name,
                        [],
                        usage_of(streams, generated),
                        system_fingerprint=fp,
                    )
                )
            yield SSE_DONE

        return StreamingResponse(guarded_sse(sse()), media_type="text/event-stream")

    async def collect() -> p.ChatCompletionResponse:
        whole = await streams[0].whole()
        merged = whole.outputs
        choices = [
            p.ChatChoice(
                m.index,
                p.ChatResponseMessage("assistant", head + m.text),
                m.finish_reason,
                choice_logprobs(m) if req.logprobs else None,
                m.token_ids if req.return_token_ids else None,
                m.stop_reason,
            )
            for m in merged
        ]
        return p.ChatCompletionResponse(
            request_id,
            created,
            model_name,
            choices,
            usage_of(streams, sum(len(m.token_ids) for m in merged)),
            system_fingerprint=fp,
        )

    body = await serving.finish(request, streams, collect())
    return Response(p.encode_json(body), media_type="application/json")
