"""For the model tests: small Hugging Face checkpoint folders written by the tests themselves
(config.json in the form transformers 4 or transformers 5 writes it, sharded safetensors, a
word-level tokenizer.json). A plain module (not conftest.py), imported by its name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokentape.engine.model.decoder import CausalLM
from tokentape.engine.model.loader import init_weights
from tokentape.engine.model.model_config import ModelConfig

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(62)]


def small_config(model_type: str, tie: bool = False) -> ModelConfig:
    return ModelConfig(
        model_type=model_type,
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        bos_token_id=None,
        eos_token_id=1,
    )


def transformers5_form(hf: dict[str, Any]) -> dict[str, Any]:
    """A transformers 4 config.json (top-level rope_theta and rope_scaling) as transformers 5
    writes it: both in `rope_parameters`, a legacy `type` kept beside `rope_type`."""
    out = dict(hf)
    theta = out.pop("rope_theta")
    scaling = dict(out.pop("rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    out["rope_parameters"] = {**scaling, "rope_theta": theta}
    return out


def write_checkpoint(
    path: Path,
    config: ModelConfig,
    seed: int = 1,
    hf_config: dict[str, Any] | None = None,
    attention_gain: float = 1.0,
) -> CausalLM:
    """A checkpoint folder of `config` with weights drawn from `seed` (non-zero biases and
    norms, so that a mix-up would show), in two shards with their index, and a tokenizer of
    WORDS; `hf_config` replaces the config.json written. `attention_gain` scales the q and k
    projections: with init_weights' small weights attention is nearly uniform, and positions
    (RoPE) hardly matter. Returns the model it holds."""
    model = CausalLM(config)
    init_weights(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "norm.weight")):
                p.add_(torch.linspace(-0.3, 0.3, p.numel()).view(p.shape))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(attention_gain)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config or config.to_hf_dict()))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return model
