"""Checkpoints in the styles of Llama 2, 3, 3.1, 3.2, Qwen2, 2.5 and Qwen3, with each RoPE
scaling they ship, each written as transformers 4 and as transformers 5 write config.json,
against transformers' own model on the same folder: the same greedy tokens, logprobs and
logits, over 100 positions, past the 32 positions the scalings were "pretrained" on."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_files import transformers5_form, write_checkpoint
from dense_reference import dense_logits

from tokentape import LLM, SamplingParams
from tokentape.engine.model.decoder import CausalLM
from tokentape.engine.model.loader import load_checkpoint
from tokentape.engine.model.model_config import ModelConfig
from tokentape.engine.model.rope import RopeScaling

transformers = pytest.importorskip("transformers")

ORIGINAL = 32  # the "pretraining" length of the scaled styles; the sequences run to 100
LLAMA3 = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
}
YARN = {"factor": 4.0, "original_max_position_embeddings": ORIGINAL}


@dataclasses.dataclass(frozen=True)
class Style:
    name: str
    model_type: str
    theta: float
    scaling: dict[str, Any] | None = None
    max_positions: int = 128
    tie: bool = False


STYLES = [
    Style("llama2", "llama", 10000.0),
    Style("llama2-linear", "llama", 10000.0, {"type": "linear", "factor": 2.0}, max_positions=64),
    Style("llama3", "llama", 500000.0),
    Style("llama3.1", "llama", 500000.0, {**LLAMA3, "factor": 8.0}),
    Style("llama3.2", "llama", 500000.0, {**LLAMA3, "factor": 32.0}, tie=True),
    Style("qwen2", "qwen2", 1000000.0, tie=True),
    Style("qwen2.5-yarn", "qwen2", 1000000.0, {"type": "yarn", **YARN}, max_positions=ORIGINAL),
    Style("qwen3", "qwen3", 1000000.0, tie=True),
    Style("qwen3-yarn", "qwen3", 1000000.0, {"rope_type": "yarn", **YARN}, tie=True),
]


def style_config(style: Style) -> ModelConfig:
    scaling = None
    if style.scaling:
        values = {k: v for k, v in style.scaling.items() if k not in ("type", "rope_type")}
        scaling = RopeScaling(style.scaling.get("rope_type") or style.scaling["type"], **values)
    return ModelConfig(
        model_type=style.model_type,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=style.theta,
        rope_scaling=scaling,
        max_position_embeddings=style.max_positions,
        tie_word_embeddings=style.tie,
        attention_bias=style.model_type == "qwen2",
        qk_norm=style.model_type == "qwen3",
        eos_token_id=1,
    )


def config_json(style: Style, config: ModelConfig, form: str) -> dict[str, Any]:
    legacy = {**config.to_hf_dict(), "rope_scaling": style.scaling}  # its own spelling
    return legacy if form == "transformers4" else transformers5_form(legacy)


@pytest.mark.parametrize("form", ["transformers4", "transformers5"])
@pytest.mark.parametrize("style", STYLES, ids=[s.name for s in STYLES])
def test_a_checkpoint_generates_as_transformers_does(
    tmp_path: Path, style: Style, form: str
) -> None:
    config = style_config(style)
    folder = tmp_path / "ckpt"
    raw = config_json(style, config, form)
    model = write_checkpoint(folder, config, seed=7, hf_config=raw, attention_gain=8.0)
    assert ("rope_parameters" in json.loads((folder / "config.json").read_text())) == (
        form == "transformers5"
    )
    loaded, loaded_model = load_checkpoint(folder)
    assert loaded == config  # theta and scaling read from either form
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)

    prompt = torch.randint(2, 256, (92,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(model=str(folder), device="cpu", tape=None, block_size=4, num_kv_blocks=64)
    assert llm.config.max_model_len == config.derived_max_model_len == 128  # not the KV's 256
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], greedy)[0].outputs[0]
    sequence = prompt + out.token_ids
    with torch.no_grad():
        expected = hf(torch.tensor([sequence])).logits[0]
    want = expected.log_softmax(-1)
    steps = range(len(prompt) - 1, len(sequence) - 1)
    assert out.token_ids == [int(want[i].argmax()) for i in steps]
    chosen = [float(want[i, t]) for i, t in zip(steps, out.token_ids, strict=True)]
    assert out.logprobs == pytest.approx(chosen, abs=1e-4)
    # every position's logits, the dense way (no paging), scaled ones past ORIGINAL included
    assert torch.allclose(dense_logits(loaded_model, sequence), expected, atol=1e-4)
    assert torch.equal(dense_logits(loaded_model, sequence), dense_logits(model, sequence))
    if style.scaling:  # and the check can fail: plain RoPE is 100 tolerances off
        plain = CausalLM(dataclasses.replace(config, rope_scaling=None))
        plain.load_state_dict(model.state_dict())
        assert not torch.allclose(dense_logits(plain, sequence), expected, atol=1e-2)
    if style.theta != 10000.0:  # and so is the 10000 a loader falls back to
        default = CausalLM(dataclasses.replace(config, rope_theta=10000.0))
        default.load_state_dict(model.state_dict())
        assert not torch.allclose(dense_logits(default, sequence), expected, atol=1e-2)


DYNAMIC = Style("llama2-dynamic", "llama", 10000.0, {"type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("form", ["transformers4", "transformers5"])
def test_dynamic_ntk_is_served_up_to_max_position_embeddings(tmp_path: Path, form: str) -> None:
    """Up to max_position_embeddings, transformers' dynamic NTK is plain RoPE and the engine
    gives its tokens. Past it, transformers rescales every position from the longest one in
    the forward pass, so a key written earlier would need rotating again: the engine serves
    such a checkpoint up to max_position_embeddings and refuses a longer max_model_len."""
    config = style_config(DYNAMIC)
    folder = tmp_path / "ckpt"
    write_checkpoint(
        folder, config, seed=7, hf_config=config_json(DYNAMIC, config, form), attention_gain=8.0
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    prompt = torch.randint(2, 256, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    llm = LLM(model=str(folder), device="cpu", tape=None, block_size=4, num_kv_blocks=64)
    assert llm.config.max_model_len == 128
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], greedy)[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == 128  # up to the last position served
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + out.token_ids])).logits[0]
        assert out.token_ids == [int(expected[i].argmax()) for i in range(119, 127)]
        # Why no further: one position more and transformers rotates position 0 differently.
        longer = hf(torch.tensor([prompt + out.token_ids + [5]])).logits[0]
    assert not torch.allclose(longer[:128], expected, atol=1e-3)
    with pytest.raises(
        ValueError,
        match=r"max_model_len \(129\) is greater than the model's "
        r"context length \(128: max_position_embeddings = 128 .*'dynamic'",
    ):
        LLM(
            model=str(folder),
            device="cpu",
            tape=None,
            block_size=4,
            num_kv_blocks=64,
            max_model_len=129,
        )
