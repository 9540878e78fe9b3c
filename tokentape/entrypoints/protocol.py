"""The OpenAI-compatible request and response bodies (msgspec structs, JSON on the wire),
with vLLM's extra request fields (top_k, min_p, stop_token_ids, ignore_eos, return_token_ids,
...) and vLLM's /tokenize and /detokenize.

The fields of OpenAI's and vLLM's requests that this server does not implement are refused
with a 400 naming them (unsupported_fields.py); a field neither API has is ignored, as vLLM
ignores it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


# chat_template_kwargs' values: one level of JSON (a deeper value is refused as it is decoded).
TemplateValue = str | int | float | bool | None


class SamplingFields(msgspec.Struct, kw_only=True):
    """vLLM's sampling fields: at the top of an OpenAI request's body, and in the
    `sampling_params` of /inference/v1/generate."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # OpenAI's penalties and vLLM's extra sampling fields, passed to SamplingParams as named.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None  # vLLM's: strings, encoded by the engine's tokenizer
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids as strings (JSON's keys) -> bias


class _SamplingFields(SamplingFields, kw_only=True):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM: the token ids go into each choice
    request_id: str | None = None  # vLLM's: the response id (as the X-Request-Id header)
    user: str | None = None  # OpenAI's end-user id: no effect on the output (nor in vLLM)


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of token ids, or a list of either (one choice per prompt). msgspec
    # takes one array type in a union, so a list's items are checked in serving_completion.
    # Typed to two levels: a deeper body is refused as it is decoded, not recursed into.
    prompt: str | list[int | str | list[int]]
    # Unset: OpenAI's and vLLM's default for completions, 16 (less where the context ends).
    max_tokens: int | None | msgspec.UnsetType = msgspec.UNSET
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's post-processor (a BOS) runs


class ContentPart(msgspec.Struct):
    """A part of a message's content; only text parts are supported (other fields of a part
    are skipped as it is decoded)."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # OpenAI's participant name: passed to the template, as vLLM does
    # Tool calling is not implemented: a message with these is refused (serving_chat.py); kept
    # raw, so never recursed into.
    tool_calls: msgspec.Raw = msgspec.Raw(b"")
    tool_call_id: msgspec.Raw = msgspec.Raw(b"")


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None  # None: True, unless continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, TemplateValue] | None = None
    add_special_tokens: bool = False  # vLLM's chat default: the template adds what it needs
    echo: bool = False  # vLLM's: the last message's content before the reply, roles matching


class GenerateSamplingParams(SamplingFields, kw_only=True):
    """vLLM's SamplingParams in a /inference/v1/generate body."""

    logprobs: int | None = None  # the sampled token's, and the k most likely
    prompt_logprobs: int | None = None
    detokenize: bool = True  # the answer is token ids either way


class GenerateRequest(msgspec.Struct, kw_only=True):
    """vLLM's /inference/v1/generate body: token ids in, token ids out (RL loops)."""

    token_ids: list[int]
    sampling_params: GenerateSamplingParams
    model: str | None = None
    request_id: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize of chat messages, through the chat template."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, TemplateValue] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class UpdateWeightsRequest(msgspec.Struct):
    # One of: a checkpoint folder on the server's machine (inside a transfer: one chunk), or
    # with --weight-transfer-config a bucket's update_info, as vLLM's weight transfer engine
    # sends it ({"shm_name", "names", "dtype_names", "shapes", "offsets"}: one chunk).
    path: str | None = None
    weight_version: str | None = None  # vLLM #49040's label; default: the update's number
    update_info: dict[str, Any] | None = None


class InitWeightTransferEngineRequest(msgspec.Struct):
    init_info: dict[str, Any] = {}  # vLLM's; the shm backend takes at most {"backend": "shm"}


class FinishWeightUpdateRequest(msgspec.Struct):
    weight_version: str | None = None  # as vLLM's finish_weight_update takes it


class CollectiveRPCRequest(msgspec.Struct):
    """vLLM's dev-mode /collective_rpc body: a worker method by name, and its arguments."""

    method: str
    timeout: float | None = None
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class LoadLoRAAdapterRequest(msgspec.Struct):
    """vLLM's /v1/load_lora_adapter body: the adapter's served name and its PEFT folder."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id, when given, must match)."""

    lora_name: str
    lora_int_id: int | None = None


class AbortRequest(msgspec.Struct):
    """SGLang's /abort_request body (AbortReq): one request's id, or every request."""

    rid: str = ""
    abort_all: bool = False


# -- responses ----------------------------------------------------------------------------------


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # null: an echoed prompt's first token (vLLM's)
    text_offset: list[int]
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoice(msgspec.Struct, omit_defaults=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None


class ChatLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None  # None: a token given by its id ("token_id:<id>"), as vLLM's
    top_logprobs: list[dict[str, Any]] = []


class ChatChoiceLogprobs(msgspec.Struct):
    content: list[ChatLogprob]


class ChatResponseMessage(msgspec.Struct):
    role: str
    content: str | None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChoice(msgspec.Struct, omit_defaults=True):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChatChoiceLogprobs | None = None
    token_ids: list[int] | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


class ChatStreamChoice(msgspec.Struct, omit_defaults=True):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatChoiceLogprobs | None = None
    token_ids: list[int] | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None


class GenerateChoice(msgspec.Struct):
    index: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: ChatChoiceLogprobs | None = None


class GenerateResponse(msgspec.Struct):
    """vLLM's answer to /inference/v1/generate (in a stream, each chunk has the new tokens of
    one choice, and the usage, when asked for, comes in a last chunk of no choices)."""

    request_id: str
    choices: list[GenerateChoice]
    # vLLM's: per prompt position (None for the first), token id -> {"logprob": ...}.
    prompt_logprobs: list[dict[str, dict[str, float]] | None] | None = None
    kv_transfer_params: None = None
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    owned_by: str = "tokentape"
    object: Literal["model"] = "model"
    # vLLM's: a LoRA adapter's card names its folder and the base model it runs on.
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


encode_json = msgspec.json.Encoder().encode
