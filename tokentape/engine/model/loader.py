"""Weights: the built-in models' seeded init, Hugging Face checkpoint folders (safetensors),
validated weight updates and the content hash that identifies a set of weights."""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Mapping

import torch

from tokentape.engine.model.config import (
    BUILTIN_CONFIGS,
    CheckpointError,
    ModelConfig,
    config_from_hf,
)
from tokentape.engine.model.decoder import CausalLM

WeightsSource = Mapping[str, torch.Tensor] | str | os.PathLike[str]

# Buffers older checkpoints carry that this model computes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(model: CausalLM) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def init_weights(model: CausalLM, seed: int) -> None:
    """Deterministic weights: normal(0, 0.02) for matrices and embeddings, ones for norms,
    zeros for biases, drawn on the CPU in float32 in parameter order from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                value = torch.ones(p.shape)
            elif name.endswith(".bias"):
                value = torch.zeros(p.shape)
            else:
                value = torch.empty(p.shape).normal_(0.0, 0.02, generator=gen)
            p.copy_(value)


def builtin_model(name: str, seed: int = 0) -> tuple[ModelConfig, CausalLM]:
    """A built-in config ('tiny', 'qwen3-0.6b'), weights drawn from `seed`, CPU, float32."""
    config = BUILTIN_CONFIGS[name]
    model = CausalLM(config)
    init_weights(model, seed)
    return config, model


def read_checkpoint(
    path: str | os.PathLike[str],
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, str]]:
    """config.json and every tensor of the folder's *.safetensors, with the file of each."""
    from safetensors import safe_open

    config = config_from_hf(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(
            f"{os.path.join(path, '*.safetensors')}: no weight files in the checkpoint folder"
        )
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    tensors[name] = f.get_tensor(name)
                    origin[name] = file
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 (safetensors has its own error types)
            raise CheckpointError(f"{file}: cannot read the safetensors file ({exc})") from None
    return config, tensors, origin


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[ModelConfig, CausalLM]:
    """Build the model of a Hugging Face checkpoint folder (Llama, Qwen2, Qwen3) on the CPU."""
    config, tensors, origin = read_checkpoint(path)
    model = CausalLM(config)
    shapes = expected_shapes(model)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the same tensor as the embeddings
    where = os.path.join(path, "*.safetensors")
    for name in shapes:
        if name not in tensors:
            raise CheckpointError(f"{where}: missing tensor {name!r}")
    for name, t in tensors.items():
        if name not in shapes:
            raise CheckpointError(
                f"{origin[name]}: unexpected tensor {name!r} for a {config.model_type} model"
            )
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(
                f"{origin[name]}: tensor {name!r} has shape {tuple(t.shape)}, "
                f"config.json implies {shapes[name]}"
            )
        if not t.is_floating_point():  # as update_weights refuses it: a cast would hide the error
            raise CheckpointError(f"{origin[name]}: tensor {name!r} is {t.dtype}, not floating point")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name].to(torch.float32))
    return config, model


def load_tokenizer(path: str | os.PathLike[str]) -> object | None:
    """The folder's tokenizer.json through `tokenizers`, or None when it has none."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    from tokentape.engine.tokenizer import HFTokenizer

    return HFTokenizer(file)


def prepare_update(model: CausalLM, weights: WeightsSource) -> dict[str, torch.Tensor]:
    """Validate a weight update against the model without touching it: names known, shapes
    equal, floating point; returns the tensors cast to the model's dtype and device."""
    if isinstance(weights, (str, os.PathLike)):
        _, tensors, origin = read_checkpoint(weights)
    elif isinstance(weights, Mapping):
        tensors = {k: v for k, v in weights.items() if not k.endswith(_IGNORED_SUFFIXES)}
        origin = {}
    else:
        raise TypeError(
            "update_weights takes a state_dict or a checkpoint folder, "
            f"got {type(weights).__name__}"
        )
    params = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if not tensors:
        raise ValueError("update_weights: the update holds no tensors")
    out = {}
    for name, t in tensors.items():
        where = f"{origin[name]}: " if name in origin else ""
        p = params.get(name)
        if p is None:
            raise ValueError(f"{where}update_weights: unknown tensor {name!r}; nothing was changed")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(
                f"{where}update_weights: tensor {name!r} is not a floating-point tensor; "
                "nothing was changed"
            )
        if t.shape != p.shape:
            raise ValueError(
                f"{where}update_weights: tensor {name!r} has shape {tuple(t.shape)}, "
                "the model's is "
                f"{tuple(p.shape)}; nothing was changed"
            )
        out[name] = t.detach().to(device=p.device, dtype=p.dtype)
    return out


def apply_update(model: CausalLM, tensors: Mapping[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)


def weights_hash(model: CausalLM) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = p.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def save_checkpoint(model: CausalLM, path: str | os.PathLike[str]) -> str:
    """Write `model` as a Hugging Face checkpoint folder (config.json, model.safetensors) that
    this loader, transformers and vLLM all read; returns the folder's path. Tied embeddings
    are written once, as Hugging Face does."""
    import json

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = model.config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return os.fspath(path)
