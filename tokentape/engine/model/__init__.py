"""The real model: a Llama/Qwen2/Qwen3-style decoder over the paged KV cache, its configs,
checkpoint loading and sampling."""

from tokentape.engine.model.decoder import AttentionMetadata, CausalLM
from tokentape.engine.model.loader import builtin_model, load_checkpoint
from tokentape.engine.model.model_config import BUILTIN_CONFIGS, CheckpointError, ModelConfig

__all__ = [
    "BUILTIN_CONFIGS",
    "AttentionMetadata",
    "CausalLM",
    "CheckpointError",
    "ModelConfig",
    "builtin_model",
    "load_checkpoint",
]
