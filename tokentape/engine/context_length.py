"""The refusal of a prompt that does not fit the model's context, worded as vLLM words it
(max_model_len's default is settled with the other settings: config.resolve_config)."""

from __future__ import annotations


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt that leaves no position for output, in vLLM's words (its OpenAI
    server's `_validate_input`; its offline LLM refuses only a longer prompt)."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            "input messages."
        )
