"""What AsyncLLM makes of its callers' inputs before they cross to the engine core: the
frontend's tokenizer, prompts as token ids, and a state_dict as bytes."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

from tokentape.engine.request_checks import check_prompt_fits
from tokentape.engine.tokenizer import ByteTokenizer, Tokenizer, checkpoint_tokenizer
from tokentape.events.validation import check_int, check_str, short_repr, shown

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


def check_token_ids(name: str, token_ids: Sequence[object], vocab_size: int) -> None:
    """Every id an int of the vocabulary (one pass at C speed for the usual good list)."""
    if all(type(t) is int for t in token_ids):
        ids = cast(Sequence[int], token_ids)
        if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
            return
    for i, t in enumerate(token_ids):
        check_int(f"{name}[{i}]", t, 0)  # the type (a bool is not a token id), then the vocabulary
        if t >= vocab_size:  # type: ignore[operator]
            raise ValueError(
                f"{name}[{i}] must be a token id in the vocabulary [0, {vocab_size}), "
                f"got {short_repr(t)}"
            )


def check_prompt_tokens(token_ids: Sequence[object], vocab_size: int, max_model_len: int) -> None:
    """What the core checks of a prompt, checked before it is sent: its ids (one past 64
    bits could not even be sent) and its length (so a request of several prompts is refused
    whole, before any of them is recorded)."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    check_token_ids("prompt_token_ids", token_ids, vocab_size)
    check_prompt_fits(len(token_ids), max_model_len)


def state_dict_bytes(weights: Mapping[str, Any]) -> bytes:
    """A state_dict as safetensors bytes, to cross the process boundary (tied tensors are
    copied apart: safetensors refuses shared storage)."""
    import torch
    from safetensors.torch import save

    tensors = {}
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(  # noqa: TRY004 - a refused update is a ValueError, as the core's
                f"update_weights: {name!r} is not a tensor ({shown(t)}); nothing was changed"
            )
        tensors[name] = t.detach().to("cpu").contiguous().clone()
    return save(tensors)
