"""Model configs: the built-in ones and Hugging Face `config.json` parsing.

Field names follow Hugging Face's so a config converts both ways (the benchmark and the
logits cross-check build a transformers model from the same config).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from tokentape.engine.tokenizer import ByteTokenizer

# model_type -> the Hugging Face architecture it loads as
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and the tensor."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model_type: str  # llama, qwen2 or qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # A checkpoint's other end-of-sequence ids (Llama 3 lists three). As vLLM does with a
    # generation config's EOS ids, the engine stops requests on them as stop_token_ids.
    extra_eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent Hugging Face config.json contents."""
        d = asdict(self)
        d.pop("qk_norm")
        extra = d.pop("extra_eos_token_ids")
        if extra:
            d["eos_token_id"] = [self.eos_token_id, *extra]
        d["architectures"] = [SUPPORTED_MODEL_TYPES[self.model_type]]
        d["hidden_act"] = "silu"
        d["torch_dtype"] = "float32"
        if self.model_type == "qwen2":
            d.pop("attention_bias")  # Qwen2 always has q/k/v biases
        return d


# The built-in default: small enough for fast tests and a CPU benchmark, with the byte
# tokenizer's vocabulary. Weights come from a fixed seed (see loader.init_weights).
TINY = ModelConfig(
    model_type="qwen3",
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    qk_norm=True,
    bos_token_id=ByteTokenizer.bos_token_id,
    eos_token_id=ByteTokenizer.eos_token_id,
)

# Qwen3-0.6B's shapes (for the GPU benchmark; weights drawn from a seed, no download).
QWEN3_0_6B = ModelConfig(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    qk_norm=True,
    bos_token_id=151643,
    eos_token_id=151645,
)

BUILTIN_CONFIGS = {"tiny": TINY, "qwen3-0.6b": QWEN3_0_6B}


def config_from_hf(path: str | os.PathLike[str]) -> ModelConfig:
    """Parse `config.json` of a Llama, Qwen2 or Qwen3 checkpoint folder."""
    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (a checkpoint folder needs config.json)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{file}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
        None,
        "default",
    ):
        raise CheckpointError(f"{file}: rope_scaling {rope_scaling!r} is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"{file}: hidden_act {raw['hidden_act']!r} is not supported (silu only)"
        )
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos_ids = _checkpoint_eos_token_ids(path, raw, file)
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids[0] if eos_ids else None,
            extra_eos_token_ids=tuple(eos_ids[1:]),
        )
    except KeyError as exc:
        raise CheckpointError(f"{file}: missing required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{file}: {exc}") from None


def _checkpoint_eos_token_ids(
    path: str | os.PathLike[str], raw: dict[str, Any], file: str
) -> list[int]:
    """The end-of-sequence ids of config.json, then those only generation_config.json adds
    (vLLM reads both; Llama 3 lists several ids in each)."""
    ids = _eos_ids(raw.get("eos_token_id"), file)
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_file):
        try:
            with open(gen_file, encoding="utf-8") as f:
                gen = json.load(f)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{gen_file}: not valid JSON ({exc})") from None
        if isinstance(gen, dict):
            ids += [i for i in _eos_ids(gen.get("eos_token_id"), gen_file) if i not in ids]
    return ids


def _eos_ids(value: object, file: str) -> list[int]:
    """`eos_token_id` as config files write it: absent, one id or a list of ids."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{file}: eos_token_id must be a token id or a list of them, got {value!r}")
    return list(dict.fromkeys(ids))
