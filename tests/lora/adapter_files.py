"""For the LoRA tests: PEFT adapter folders, written by peft's own save_pretrained on a
transformers model of the base checkpoint (random, non-zero A and B), and base checkpoints
of the built-in tiny model's shapes. A plain module, imported by its name."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from tokentape.engine.model.loader import builtin_model
from tokentape.engine.model.model_config import ModelConfig

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hf_model(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = config.to_hf_dict()
    model_type = hf.pop("model_type")
    hf.pop("architectures"), hf.pop("torch_dtype")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **hf))
    model.load_state_dict(state_dict, strict=False)
    return model.float().eval()


def write_tiny_base(path: Path) -> torch.nn.Module:
    """The built-in tiny model's weights as a checkpoint folder; its transformers model."""
    config, ours = builtin_model("tiny", 0)
    model = hf_model(config, ours.state_dict())
    model.save_pretrained(path)
    return model


def write_adapter(
    path: Path,
    base: torch.nn.Module,
    rank: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ALL_TARGETS,
    seed: int = 1,
    use_rslora: bool = False,
) -> None:
    """A PEFT LoRA folder for `base` (a transformers model), with random A and B."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=use_rslora,
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    # peft's random init draws B near zero scale: make the adapter change the tokens.
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(path)
