"""A checkpoint folder's config.json and generation_config.json as a ModelConfig. Whatever is
wrong with them (a missing or unreadable file, bytes that are not UTF-8 JSON, a list where an
object belongs, a field of the wrong type or out of range, a RoPE setting this engine cannot
compute exactly) is a CheckpointError that names the file and the problem."""

from __future__ import annotations

import json
import os
from typing import Any

from tokentape.engine.model.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from tokentape.engine.model.rope import rope_from_hf
from tokentape.errors import CheckpointError

# The fields read as integers; the first five must be in config.json.
_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def read_json_object(file: str, what: str) -> dict[str, Any]:
    """A JSON object from `file`; `what` says why the folder needs it when it is missing."""
    try:
        with open(file, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing ({what})") from None
    except IsADirectoryError:
        raise CheckpointError(f"{file}: is a directory, not a JSON file") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read it ({exc.strerror or exc})") from None
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not a text file (byte {exc.start} is not UTF-8)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{file}: not valid JSON (nested too deeply)") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: holds a JSON {_json_type(raw)}, not an object")
    return raw


def config_from_hf(path: str | os.PathLike[str]) -> ModelConfig:
    """Parse `config.json` (and generation_config.json's EOS ids) of a Llama, Qwen2 or Qwen3
    checkpoint folder; a CheckpointError names the file and the problem."""
    file = os.path.join(path, "config.json")
    raw = read_json_object(file, "a checkpoint folder needs config.json")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{file}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"{file}: hidden_act {raw['hidden_act']!r} is not supported (silu only)"
        )
    for name in _REQUIRED_INTS:
        if name not in raw:
            raise CheckpointError(f"{file}: missing required field {name!r}")
    ints = {name: _int(raw, name, file) for name in (*_REQUIRED_INTS, *_OPTIONAL_INTS)}
    heads, hidden = ints["num_attention_heads"], ints["hidden_size"]
    rope_theta, rope_scaling = rope_from_hf(raw, file)
    eos_ids = _checkpoint_eos_token_ids(path, raw, file)
    rms_norm_eps = _float(raw, "rms_norm_eps", 1e-6, file)
    tie, bias = _bool(raw, "tie_word_embeddings", file), _bool(raw, "attention_bias", file)
    try:
        return ModelConfig(
            model_type=model_type,
            vocab_size=ints["vocab_size"],  # type: ignore[arg-type]
            hidden_size=hidden,  # type: ignore[arg-type]
            intermediate_size=ints["intermediate_size"],  # type: ignore[arg-type]
            num_hidden_layers=ints["num_hidden_layers"],  # type: ignore[arg-type]
            num_attention_heads=heads,  # type: ignore[arg-type]
            num_key_value_heads=ints["num_key_value_heads"] or heads,  # type: ignore[arg-type]
            head_dim=ints["head_dim"] or hidden // heads,  # type: ignore[operator]
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=ints["max_position_embeddings"] or 4096,
            tie_word_embeddings=tie,
            attention_bias=model_type == "qwen2" or bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids[0] if eos_ids else None,
            extra_eos_token_ids=tuple(eos_ids[1:]),
        )
    except ValueError as exc:  # ModelConfig's own checks (ranges, head counts)
        raise CheckpointError(f"{file}: {exc}") from None


def _int(raw: dict[str, Any], name: str, file: str) -> int | None:
    """An integer field, None when absent or null (ModelConfig checks the range)."""
    value = raw.get(name)
    if value is not None and (type(value) is not int or value < 1):
        raise CheckpointError(f"{file}: {name} must be a positive integer, got {value!r}")
    return value


def _float(raw: dict[str, Any], name: str, default: float, file: str) -> float:
    value = raw.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{file}: {name} must be a number, got {value!r}")
    return float(value)


def _bool(raw: dict[str, Any], name: str, file: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise CheckpointError(f"{file}: {name} must be true or false, got {value!r}")
    return value


def _checkpoint_eos_token_ids(
    path: str | os.PathLike[str], raw: dict[str, Any], file: str
) -> list[int]:
    """The end-of-sequence ids of config.json, then those only generation_config.json adds
    (vLLM reads both; Llama 3 lists several ids in each). Each file's faults are its own."""
    ids = _eos_ids(raw.get("eos_token_id"), file)
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.lexists(gen_file):
        gen = read_json_object(gen_file, "")
        ids += [i for i in _eos_ids(gen.get("eos_token_id"), gen_file) if i not in ids]
    return ids


def _eos_ids(value: object, file: str) -> list[int]:
    """`eos_token_id` as config files write it: absent, one id or a list of ids."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise CheckpointError(
            f"{file}: eos_token_id must be a token id or a list of them, got {value!r}"
        )
    return list(dict.fromkeys(ids))


def _json_type(value: object) -> str:
    names = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
