"""POST /inference/v1/generate: vLLM's tokens-in, tokens-out endpoint (its ServingTokens), for
RL loops that keep the token ids their trainer sees (SkyRL, prime-rl, AReaL): a prompt's
token ids and vLLM's SamplingParams in, the generated token ids out, with no text either way.

The answer is vLLM's GenerateResponse: the request id (`generate-tokens-<id>`), one choice
per completion (index, token_ids, finish_reason, and with `logprobs` the chat API's logprobs
with each token named `token_id:<id>`), the prompt's logprobs with `prompt_logprobs`, and the
usage. With `stream`, each chunk carries one choice's new token ids, and the usage, when
`stream_options.include_usage` asks, a last chunk of no choices; then [DONE]. max_tokens left
out is the rest of the context, as vLLM's server defaults it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from uuid import uuid4

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokentape.engine.outputs import CompletionOutput
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.choices import json_logprob, token_id_logprobs
from tokentape.entrypoints.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    guarded_sse,
    merge_streams,
    sse_bytes,
    usage_of,
)

# The engine's names of a refused field, as this endpoint's body calls them.
PARAM_ALIASES = {
    "prompt_token_ids": "token_ids",
    "prompt": "token_ids",
    **{
        name: f"sampling_params.{name}"
        for name in (
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "n",
            "stop",
            "stop_token_ids",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_tokens",
            "bad_words",
            "min_p",
            "logit_bias",
            "logprobs",
            "prompt_logprobs",
        )
    },
}


def _choice(c: CompletionOutput, logprobs: int | None) -> p.GenerateChoice:
    lps = None
    if logprobs is not None and c.logprobs is not None:
        lps = p.ChatChoiceLogprobs(token_id_logprobs(c, logprobs))
    return p.GenerateChoice(c.index, c.token_ids, c.finish_reason, lps)


def _prompt_logprobs(
    rows: list[dict[int, float] | None] | None,
) -> list[dict[str, dict[str, float]] | None] | None:
    """vLLM's prompt_logprobs as JSON: per position, token id -> {"logprob": ...}."""
    if rows is None:
        return None
    return [
        None if row is None else {str(t): {"logprob": json_logprob(lp)} for t, lp in row.items()}
        for row in rows
    ]


async def generate_tokens(
    serving: OpenAIServing, req: p.GenerateRequest, request: Request
) -> Response:
    """POST /inference/v1/generate (see the module doc)."""
    serving.check_model(req.model)
    sp = req.sampling_params
    prompt = req.token_ids
    params = serving.sampling_params(
        sp,
        sp.max_tokens,
        len(prompt),
        sp.logprobs,
        PARAM_ALIASES,
        sp.prompt_logprobs,
        stream=req.stream,
        stream_options=req.stream_options,
    )
    given = req.request_id or request.headers.get("x-request-id") or uuid4().hex
    request_id = f"generate-tokens-{given}"  # vLLM's
    streams = await serving.start(request, [prompt], params, request_id, PARAM_ALIASES, req.model)

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        async def sse() -> AsyncIterator[bytes]:
            generated = 0
            async for _, out in merge_streams(streams):
                for c in out.outputs:
                    generated += len(c.token_ids)
                    chunk = p.GenerateResponse(request_id, [_choice(c, sp.logprobs)])
                    if out.prompt_logprobs:
                        chunk.prompt_logprobs = _prompt_logprobs(out.prompt_logprobs)
                    yield sse_bytes(chunk)
            if include_usage:
                yield sse_bytes(
                    p.GenerateResponse(request_id, [], usage=usage_of(streams, generated))
                )
            yield SSE_DONE

        return StreamingResponse(guarded_sse(sse()), media_type="text/event-stream")

    async def collect() -> p.GenerateResponse:
        merged = await streams[0].whole()
        choices = [_choice(c, sp.logprobs) for c in merged.outputs]
        generated = sum(len(c.token_ids) for c in merged.outputs)
        return p.GenerateResponse(
            request_id,
            choices,
            _prompt_logprobs(merged.prompt_logprobs),
            usage=usage_of(streams, generated),
        )

    body = await serving.finish(request, streams, collect())
    return Response(p.encode_json(body), media_type="application/json")
