"""Model configs: the built-in ones, their checks, and their Hugging Face `config.json` form
(reading a checkpoint's config.json is hf_config.py's job: `config_from_hf`).

Field names follow Hugging Face's so a config converts both ways (the benchmark and the
logits cross-check build a transformers model from the same config).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tokentape.engine.model.rope import (
    DYNAMIC_LIMIT,
    RopeScaling,
    context_length,
    context_length_source,
)
from tokentape.engine.model_registry import BUILTIN_MODELS
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.errors import CheckpointError

_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)

# model_type -> the Hugging Face architecture it loads as
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


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
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
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
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:  # RoPE rotates pairs of dimensions
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{name} must be a token id or null, got {value!r}")

    @property
    def derived_max_model_len(self) -> int:
        """The model's context length, as vLLM derives it (max_position_embeddings, extended
        by a linear or YaRN RoPE scaling; rope.context_length)."""
        return context_length(self.max_position_embeddings, self.rope_scaling)

    @property
    def context_length_source(self) -> str:
        """Where derived_max_model_len comes from (config.json's fields), for messages."""
        source = context_length_source(self.max_position_embeddings, self.rope_scaling)
        source += " in the model's config"
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "dynamic":
            source += f"; {DYNAMIC_LIMIT}"
        return source

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent Hugging Face config.json contents, as transformers 4 writes them
        (top-level rope_theta and rope_scaling; transformers 5 reads them too)."""
        d = asdict(self)
        d.pop("qk_norm")
        d["rope_scaling"] = self.rope_scaling.to_hf_dict() if self.rope_scaling else None
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

# The shapes of the built-in models, by their names in the registry (in its order).
BUILTIN_CONFIGS = dict(zip(BUILTIN_MODELS, (TINY, QWEN3_0_6B), strict=True))
__all__ = ["BUILTIN_CONFIGS", "CheckpointError", "ModelConfig"]
