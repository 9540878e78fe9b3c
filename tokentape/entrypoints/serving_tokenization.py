"""vLLM's POST /tokenize (a prompt, or chat messages through the chat template) and POST
/detokenize. Nothing goes to the engine, so nothing is recorded."""

from __future__ import annotations

from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.serving_chat import chat_prompt
from tokentape.entrypoints.serving_completion import completion_prompts
from tokentape.entrypoints.serving_engine import APIError, OpenAIServing


def tokenize(
    serving: OpenAIServing, req: p.TokenizeCompletionRequest | p.TokenizeChatRequest
) -> p.TokenizeResponse:
    """{count, max_model_len, tokens} (and token_strs when asked), as vLLM's."""
    serving.check_model(req.model)
    if isinstance(req, p.TokenizeChatRequest):
        tokens = chat_prompt(serving, req)
    else:
        tokens = completion_prompts(serving, req.prompt, req.add_special_tokens)[0]
    strs = None
    if req.return_token_strs:
        decode = serving.engine.tokenizer.decode
        strs = [decode([t]) for t in tokens]
    return p.TokenizeResponse(len(tokens), serving.engine.max_model_len, tokens, strs)


def detokenize(serving: OpenAIServing, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
    """{prompt}: the tokens' text, as vLLM's (special tokens skipped)."""
    serving.check_model(req.model)
    vocab = serving.engine.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise APIError(
                400,
                f"tokens[{i}] must be a token id in the vocabulary [0, {vocab}), got {t}",
                param="tokens",
            )
    return p.DetokenizeResponse(serving.engine.tokenizer.decode(req.tokens))


def tokenize_request_type(
    body: bytes,
) -> type[p.TokenizeCompletionRequest] | type[p.TokenizeChatRequest]:
    """vLLM's /tokenize takes either body: one with `messages` is a chat request."""
    return p.TokenizeChatRequest if b'"messages"' in body else p.TokenizeCompletionRequest
