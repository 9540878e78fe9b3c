"""PEFT LoRA adapter folders: `adapter_config.json` and `adapter_model.safetensors`, as
`peft`'s `save_pretrained` writes them, read and checked before anything serves them.

An adapter changes some of the decoder's linear layers: for each, `lora_A` [r, in] and
`lora_B` [out, r], and the layer computes `x W^T + scaling * (x A^T) B^T`, where scaling is
`lora_alpha / r` (`lora_alpha / sqrt(r)` with use_rslora), as peft computes it. Every check
runs on reading, so a refused adapter loads nothing: a folder or file missing or damaged, a
rank above the engine's max_lora_rank, options tokentape does not serve (DoRA, biases,
modules_to_save, per-module ranks or alphas), and, against the model, a layer it does not
have or shapes of another base model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tokentape.errors import LoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The decoder's linear layers an adapter may change: attention's and the MLP's projections.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."  # peft's prefix on the model's own parameter names
# Options a config may carry only at their no-op values (peft's defaults).
_NO_OP_OPTIONS: dict[str, tuple[object, ...]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "fan_in_fan_out": (False, None),
    "layers_to_transform": (None,),
    "lora_bias": (False, None),
    "layer_replication": (None,),
    "target_parameters": (None,),
    "trainable_token_indices": (None,),
}


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    """An adapter as read from its folder: per layer it changes (the model's module name,
    e.g. `model.layers.0.self_attn.q_proj`), lora_A [r, in] and lora_B [out, r] in float32."""

    path: str
    adapter_id: str  # SHA-256 of adapter_config.json's bytes, then adapter_model.safetensors'
    rank: int
    scaling: float
    target_modules: tuple[str, ...]  # the kinds of layer it changes, in TARGET_MODULES' order
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def check_against(self, modules: Mapping[str, tuple[int, int]]) -> None:
        """Refuse an adapter for another base model: `modules` gives each linear layer of
        the served model as (in_features, out_features), by module name."""
        for name, (a, b) in self.weights.items():
            shape = modules.get(name)
            if shape is None:
                raise LoRAError(
                    f"LoRA adapter {self.path}: the model has no layer {name} (an adapter for "
                    "another base model?)"
                )
            in_features, out_features = shape
            if a.shape[1] != in_features or b.shape[0] != out_features:
                raise LoRAError(
                    f"LoRA adapter {self.path}: {name} maps {a.shape[1]} -> {b.shape[0]} "
                    f"features, the model's layer {in_features} -> {out_features} (an adapter "
                    "for another base model)"
                )


def load_peft_adapter(path: str, max_rank: int) -> PeftAdapter:
    """Read and check a PEFT LoRA folder (see the module's docstring); LoRAError if it
    cannot serve."""
    if not isinstance(path, str) or not path:
        raise LoRAError("LoRA adapter: lora_path must name the adapter's folder")
    if not os.path.isdir(path):
        what = "is not a folder" if os.path.exists(path) else "does not exist"
        raise LoRAError(f"LoRA adapter {path}: the folder {what}")
    config_bytes = _read(path, CONFIG_FILE)
    weights_bytes = _read(path, WEIGHTS_FILE)
    config = _parse_config(path, config_bytes)
    rank, alpha = config["r"], config["lora_alpha"]
    if rank > max_rank:
        raise LoRAError(
            f"LoRA adapter {path}: rank {rank} is above max_lora_rank={max_rank} (raise "
            "max_lora_rank to serve it)"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _parse_weights(path, weights_bytes, rank)
    digest = hashlib.sha256(config_bytes)
    digest.update(weights_bytes)
    kinds = {name.rsplit(".", 1)[-1] for name in weights}
    return PeftAdapter(
        path=path,
        adapter_id=digest.hexdigest(),
        rank=rank,
        scaling=float(scaling),
        target_modules=tuple(k for k in TARGET_MODULES if k in kinds),
        weights=weights,
    )


def check_recorded_adapter(
    lora_name: str, lora_path: str, recorded_id: str, loaded_id: str
) -> None:
    """Refuse a recorded adapter (a tape's LoRAAdded) whose folder, read again, holds another
    adapter than the one recorded: a replay would run with other weights."""
    if loaded_id != recorded_id:
        raise LoRAError(
            f"LoRA adapter {lora_name!r}: {lora_path} holds another adapter than the one "
            f"recorded (SHA-256 {loaded_id[:16]}..., recorded {recorded_id[:16]}...)"
        )


def _read(folder: str, name: str) -> bytes:
    try:
        with open(os.path.join(folder, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise LoRAError(
            f"LoRA adapter {folder}: no {name} (a PEFT LoRA folder holds {CONFIG_FILE} "
            f"and {WEIGHTS_FILE})"
        ) from None
    except OSError as exc:
        raise LoRAError(f"LoRA adapter {folder}: cannot read {name}: {exc.strerror}") from None


def _parse_config(folder: str, data: bytes) -> dict[str, Any]:
    where = f"LoRA adapter {folder}: {CONFIG_FILE}"
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{where} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{where} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type!r} is not a LoRA adapter")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type,operator]
            raise LoRAError(f"{where}: {key} must be a number > 0, got {value!r}")
    if not isinstance(config["r"], int):
        raise LoRAError(f"{where}: r must be an integer, got {config['r']!r}")
    for key, allowed in _NO_OP_OPTIONS.items():
        if config.get(key) not in allowed:
            raise LoRAError(
                f"{where}: {key}={config[key]!r} is not served (tokentape serves plain LoRA "
                "on the decoder's linear layers)"
            )
    return config


def _parse_weights(
    folder: str, data: bytes, rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    where = f"LoRA adapter {folder}: {WEIGHTS_FILE}"
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise LoRAError(f"{where} is damaged ({exc})") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PREFIX)
        module, _, part = name.rpartition(".lora_")
        if not module or part not in ("A.weight", "B.weight"):
            raise LoRAError(f"{where}: tensor {key} is not a LoRA A or B weight")
        if module.rsplit(".", 1)[-1] not in TARGET_MODULES:
            raise LoRAError(
                f"{where}: {key} changes {module}; tokentape applies LoRA to "
                f"{', '.join(TARGET_MODULES)}"
            )
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise LoRAError(
                f"{where}: {key} must be a 2-D float tensor, got {tuple(tensor.shape)} "
                f"{tensor.dtype}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise LoRAError(f"{where}: {key} holds a NaN or an infinity")
        halves.setdefault(module, {})[part[0]] = tensor.float()
    if not halves:
        raise LoRAError(f"{where} holds no LoRA weights")
    weights = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise LoRAError(f"{where}: {module} has no lora_{missing}")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(
                f"{where}: {module}'s lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"not of the config's rank r={rank}"
            )
        weights[module] = (a.contiguous(), b.contiguous())
    return weights


def save_peft_adapter(
    path: str,
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    lora_alpha: float,
    base_model_name: str | None = None,
) -> None:
    """Write a PEFT LoRA folder as peft's save_pretrained does, for a trainer that keeps its
    own A and B: `weights` by the model's module name (`model.layers.0.self_attn.q_proj`),
    each (lora_A [r, in], lora_B [out, r]), every one of the same rank."""
    from safetensors.torch import save_file

    ranks = {a.shape[0] for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"save_peft_adapter: the modules' ranks differ: {sorted(ranks)}")
    kinds = sorted({name.rsplit(".", 1)[-1] for name in weights})
    config = {
        "peft_type": "LORA",
        "r": ranks.pop(),
        "lora_alpha": lora_alpha,
        "target_modules": kinds,
        "bias": "none",
        "base_model_name_or_path": base_model_name,
    }
    tensors = {}
    for name, (a, b) in weights.items():
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = a.detach().float().contiguous().cpu()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = b.detach().float().contiguous().cpu()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
