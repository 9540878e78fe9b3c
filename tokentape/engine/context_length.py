"""The model's context length: max_model_len's default, and the refusal of a prompt that does
not fit, worded as vLLM words it."""

from __future__ import annotations

import logging

import msgspec

from tokentape.engine.config import EngineConfig
from tokentape.engine.runners.base import HasModelConfig, ModelRunner

_log = logging.getLogger(__name__)


def with_model_max_len(config: EngineConfig, runner: ModelRunner) -> EngineConfig:
    """The config with max_model_len defaulted as vLLM defaults it: the model's context length
    (its config's derived_max_model_len), capped, with a warning, at what the KV cache holds.
    A max_model_len above the model's context length is refused. The oracle has no context
    length: its default stays the KV capacity."""
    if not isinstance(runner, HasModelConfig):
        return config
    derived = runner.config.derived_max_model_len
    source = runner.config.context_length_source
    if config.max_model_len is not None:
        if config.max_model_len > derived:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is greater than the model's "
                f"context length ({derived}: {source})"
            )
        return config
    capacity = config.kv_capacity
    if derived > capacity:
        _log.warning(
            "max_model_len %d: the model's context length is %d (%s), but the KV cache "
            "holds %d tokens (num_kv_blocks=%d x block_size=%d); raise num_kv_blocks, or "
            "give the cache more memory (kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE), to "
            "serve the whole context",
            capacity,
            derived,
            source,
            capacity,
            config.num_kv_blocks,
            config.block_size,
        )
    return msgspec.structs.replace(config, max_model_len=min(derived, capacity))


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt that leaves no position for output, in vLLM's words (its OpenAI
    server's `_validate_input`; its offline LLM refuses only a longer prompt)."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            "input messages."
        )
