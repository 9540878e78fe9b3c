"""POST /v1/completions: a string, token ids, or a list of either (n choices per prompt)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokentape.engine.outputs import CompletionOutput
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.choices import CompletionLogprobsFormatter
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
from tokentape.events.schema import SamplingParams

# The engine's names of a refused field, as a completion request calls them.
PARAM_ALIASES = {"prompt_token_ids": "prompt"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's, for completions


def completion_prompts(
    serving: OpenAIServing, prompt: str | list[Any], add_special_tokens: bool = True
) -> list[list[int]]:
    """The prompts as token ids: a string (encoded with the tokenizer's special tokens, as
    vLLM's add_special_tokens asks), token ids, or a list of either."""
    encode = serving.engine.tokenizer.encode

    def one(x: Any) -> list[int]:
        if isinstance(x, str):
            try:
                return encode(x, add_special_tokens=add_special_tokens)
            except ValueError as exc:  # a lone surrogate; a checkpoint without a tokenizer
                raise APIError(
                    400, f"the prompt cannot be encoded: {exc}", param="prompt"
                ) from None
        return x

    if isinstance(prompt, str):
        return [one(prompt)]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if all(type(t) is int for t in prompt):
        return [prompt]
    if all(
        isinstance(x, str) or (isinstance(x, list) and x and all(type(t) is int for t in x))
        for x in prompt
    ):
        return [one(x) for x in prompt]
    raise APIError(
        400, "prompt must be a string, a list of token ids, or a list of either", param="prompt"
    )


def prompt_texts(prompt: str | list[Any]) -> list[str | None]:
    """Each prompt's text as the client gave it (None for token ids), for echo."""
    if isinstance(prompt, str):
        return [prompt]
    if all(type(t) is int for t in prompt):
        return [None]
    return [x if isinstance(x, str) else None for x in prompt]


def completion_params(
    serving: OpenAIServing, req: p.CompletionRequest, num_prompt_tokens: int, score_only: bool
) -> SamplingParams:
    """One prompt's SamplingParams, as vLLM's: max_tokens unset (or null) is 16 cut to the
    context this prompt leaves; echo asks for the prompt's logprobs with `logprobs`; echo with
    max_tokens=0 (scoring) generates one token, which the choice leaves out."""
    max_tokens = req.max_tokens
    if score_only:
        max_tokens = 1  # vLLM's echo_without_generation
    elif max_tokens is msgspec.UNSET or max_tokens is None:
        left = serving.engine.max_model_len - num_prompt_tokens
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, left))
    prompt_logprobs = req.logprobs if req.echo else None
    return serving.sampling_params(
        req,
        max_tokens,
        num_prompt_tokens,
        req.logprobs,
        PARAM_ALIASES,
        prompt_logprobs,
        stream=req.stream,
        stream_options=req.stream_options,
    )


async def create_completion(
    serving: OpenAIServing, req: p.CompletionRequest, request: Request
) -> Response:
    """POST /v1/completions: n choices per prompt (index prompt * n + j, as vLLM's), streamed
    as SSE or in one body; with echo, each choice's first chunk begins with its prompt."""
    serving.check_model(req.model)
    prompts = completion_prompts(serving, req.prompt, req.add_special_tokens)
    score_only = req.echo and req.max_tokens == 0
    # Each prompt's own: its default max_tokens and its context checks, in order.
    params = [completion_params(serving, req, len(tokens), score_only) for tokens in prompts]
    request_id = serving.request_id(request, req.request_id, "cmpl")
    streams = await serving.start(request, prompts, params, request_id, PARAM_ALIASES, req.model)
    model_name = req.model or serving.model_name  # a LoRA adapter's name, as vLLM answers
    created, fp = int(time.time()), serving.system_fingerprint
    tokenizer, n = serving.engine.tokenizer, params[0].n
    # By choice index (prompt i's completion j is i * n + j): its logprobs' text offsets.
    texts: dict[int, CompletionLogprobsFormatter] = {}
    given = prompt_texts(req.prompt) if req.echo else []
    # Each prompt's prompt logprobs (echo with logprobs), from its first output that has them.
    prompt_lps: list[list[dict[int, float] | None] | None] = [None] * len(prompts)

    def echoed(i: int) -> str:
        """The text echo puts before prompt i's choices: as given, or its tokens decoded;
        none with return_token_ids (vLLM's: the ids say it)."""
        if req.return_token_ids:
            return ""
        text = given[i]
        return text if text is not None else tokenizer.decode(prompts[i])

    def choice(i: int, c: CompletionOutput) -> p.CompletionChoice:
        """A choice for a DELTA completion (the text is the processor's, held back and cut
        at a stop string), after the prompt with echo on its first."""
        index = i * n + c.index
        fmt = texts.get(index)
        first = fmt is None
        if fmt is None:
            fmt = texts[index] = CompletionLogprobsFormatter(tokenizer.decode)
        want = req.logprobs is not None
        text, lps = c.text, None
        if req.echo and first:
            lps = fmt.add_prompt(prompts[i], prompt_lps[i]) if want else None
            text = echoed(i) if score_only else echoed(i) + c.text
            if want and not score_only and c.logprobs is not None:
                lps = fmt.add(c, lps)
        elif want and c.logprobs is not None:
            lps = fmt.add(c)
        return p.CompletionChoice(
            index,
            text,
            c.finish_reason,
            lps,
            token_ids=c.token_ids if req.return_token_ids else None,  # a copy already
            prompt_token_ids=None,
            stop_reason=c.stop_reason,
        )

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        # vLLM's continuous_usage_stats: every chunk has its choice's usage so far.
        continuous = include_usage and req.stream_options.continuous_usage_stats  # type: ignore[union-attr]
        choice_tokens: dict[int, int] = {}

        async def sse() -> AsyncIterator[bytes]:
            generated = 0
            framer = SSEFramer(
                p.CompletionResponse(
                    request_id, created, model_name, [], None, system_fingerprint=fp
                )
            )
            async for i, out in merge_streams(streams):
                if out.prompt_logprobs:
                    prompt_lps[i] = out.prompt_logprobs
                for c in out.outputs:  # n > 1: the completions with something new
                    first = i * n + c.index not in texts
                    ch = choice(i, c)
                    generated += len(c.token_ids)
                    if first and req.return_token_ids:
                        ch.prompt_token_ids = streams[i].prompt_token_ids
                    if not continuous:
                        yield framer.chunk(ch)
                        continue
                    done = choice_tokens[ch.index] = choice_tokens.get(ch.index, 0) + len(
                        c.token_ids
                    )
                    prompt = len(streams[i].prompt_token_ids)
                    usage = p.UsageInfo(prompt, done, prompt + done)
                    yield sse_bytes(
                        p.CompletionResponse(
                            request_id,
                            created,
                            model_name,
                            [ch],
                            usage,
                            system_fingerprint=fp,
                        )
                    )
            if include_usage:
                usage = usage_of(streams, generated)
                yield sse_bytes(
                    p.CompletionResponse(
                        request_id, created, model_name, [], usage, system_fingerprint=fp
                    )
                )
            yield SSE_DONE

        return StreamingResponse(guarded_sse(sse()), media_type="text/event-stream")

    async def collect() -> p.CompletionResponse:
        choices: list[p.CompletionChoice] = []
        generated = 0
        for i, s in enumerate(streams):
            merged = await s.whole()
            prompt_lps[i] = merged.prompt_logprobs
            for m in merged.outputs:
                generated += len(m.token_ids)
                ch = choice(i, m)
                if req.return_token_ids:
                    ch.prompt_token_ids = s.prompt_token_ids
                choices.append(ch)
        return p.CompletionResponse(
            request_id,
            created,
            model_name,
            choices,
            usage_of(streams, generated),
            system_fingerprint=fp,
        )

    body = await serving.finish(request, streams, collect())
    return Response(p.encode_json(body), media_type="application/json")
