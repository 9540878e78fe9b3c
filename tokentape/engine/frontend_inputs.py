"""What AsyncLLM makes of its callers' inputs before they cross to the engine core: the
frontend's tokenizer, prompts as token ids, and a state_dict as bytes."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

from tokentape.engine.tokenizer import ByteTokenizer, Tokenizer, checkpoint_tokenizer
from tokentape.events.validation import check_str, shown

PromptType = str | Sequence[int] | Mapping[str, Any]


def frontend_tokenizer(model: str) -> Tokenizer:
    """The tokenizer the engine uses, without loading the model: a checkpoint folder's
    (tokenizer.checkpoint_tokenizer: its tokenizer.json, or one that refuses text when it has
    none), else the byte tokenizer (the built-in models and the oracle)."""
    if os.path.isdir(model):
        return checkpoint_tokenizer(model)
    return ByteTokenizer()


def prompt_token_ids(tokenizer: Tokenizer, prompt: PromptType) -> tuple[list[int], str | None]:
    """A prompt's token ids, and its text when it was given as text."""
    if isinstance(prompt, Mapping):  # vLLM's TextPrompt / TokensPrompt
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
    if isinstance(prompt, str):
        check_str("prompt", prompt)
        return tokenizer.encode(prompt), prompt
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
        raise TypeError(f"prompt must be a string or a list of token ids, got {shown(prompt)}")
    return list(cast(Sequence[int], prompt)), None


def state_dict_bytes(weights: Mapping[str, Any]) -> bytes:
    """A state_dict as safetensors bytes, to cross the process boundary (tied tensors are
    copied apart: safetensors refuses shared storage)."""
    import torch
    from safetensors.torch import save

    tensors = {}
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"update_weights: {name!r} is not a tensor ({shown(t)}); nothing was changed")
        tensors[name] = t.detach().to("cpu").contiguous().clone()
    return save(tensors)
