"""RoPE settings read from config.json: both forms transformers writes, inverse frequencies
with the bits of transformers' ROPE_INIT_FUNCTIONS, and every setting this engine cannot
compute exactly refused with the key and the value named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tokentape.engine.model.hf_config import config_from_hf
from tokentape.engine.model.model_config import CheckpointError
from tokentape.engine.model.rope import RopeScaling, inverse_frequencies, rope_from_hf

LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
SETTINGS: list[tuple[str, float, dict[str, Any] | None, int]] = [
    ("default", 10000.0, None, 64),
    ("linear", 10000.0, {"rope_type": "linear", "factor": 3.7}, 64),
    ("dynamic", 10000.0, {"type": "dynamic", "factor": 1.7}, 97),  # 1.7 * 97 / 97 != 1.7
    ("llama3.1", 500000.0, LLAMA31, 128),
    ("llama3.2", 500000.0, {**LLAMA31, "factor": 32.0}, 128),
    ("yarn", 1e6, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 32),
    (
        "yarn-betas",
        1e6,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
        128,
    ),
    (
        "yarn-mscale",
        1e4,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 32,
        },
        128,
    ),
    (
        "yarn-attention",
        1e4,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "attention_factor": 0.9,
            "original_max_position_embeddings": 32,
        },
        128,
    ),
    (
        "yarn-no-factor",
        1e4,
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32},
        128,
    ),
]


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("name,theta,scaling,max_positions", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_inverse_frequencies_have_the_bits_of_transformers(
    name: str, theta: float, scaling: dict[str, Any] | None, max_positions: int, head_dim: int
) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "vocab_size": 256,
        "max_position_embeddings": max_positions,
        "rope_theta": theta,
        "rope_scaling": dict(scaling) if scaling else None,
    }
    hf_config = transformers.LlamaConfig(**json.loads(json.dumps(raw)))
    kind = hf_config.rope_parameters["rope_type"]
    if kind == "default":
        init = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
        expected, expected_factor = init.compute_default_rope_parameters(hf_config)
    else:
        expected, expected_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    got_theta, got_scaling = rope_from_hf(raw, "config.json")
    inv_freq, attention_factor = inverse_frequencies(
        head_dim, got_theta, got_scaling, max_positions
    )
    assert torch.equal(inv_freq, expected)
    assert attention_factor == expected_factor
    if name.startswith("yarn"):
        assert attention_factor != 1.0  # the mscale that multiplies cos and sin
    if scaling is not None:  # and the scaling does change the frequencies
        plain, _ = inverse_frequencies(head_dim, got_theta, None, max_positions)
        assert not torch.equal(inv_freq, plain) or kind == "dynamic"


def test_both_forms_read_the_same() -> None:
    legacy = {"rope_theta": 500000.0, "rope_scaling": dict(LLAMA31)}
    current = {"rope_parameters": {**LLAMA31, "rope_theta": 500000.0}}
    expected = (500000.0, RopeScaling("llama3", 8.0, 32, 1.0, 4.0))
    assert rope_from_hf(legacy, "c") == rope_from_hf(current, "c") == expected
    # transformers 5's plain RoPE: theta is not lost to the 10000 default
    assert rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "c") == (
        1e6,
        None,
    )
    assert rope_from_hf({}, "c") == (10000.0, None)
    # a top-level original length (Phi-3's spelling) is the one transformers takes
    top = {"original_max_position_embeddings": 64, "rope_scaling": {"type": "yarn", "factor": 2}}
    assert rope_from_hf(top, "c") == (10000.0, RopeScaling("yarn", 2.0, 64))
    # both forms written, agreeing (a legacy `type` beside `rope_type`, as transformers 5 keeps)
    both = {
        "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0},
        "rope_parameters": {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
    }
    assert rope_from_hf(both, "c") == (1e6, RopeScaling("yarn", 4.0))


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
            r"rope_scaling\['rope_type'\] = 'longrope' is not supported "
            r"\(supported: default, linear",
        ),
        (
            {"rope_scaling": {"rope_type": "su"}},
            r"rope_scaling\['rope_type'\] = 'su' is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
            r"rope_parameters\['rope_type'\] = 'proportional' is not supported",
        ),
        (
            {"rope_scaling": {**LLAMA31, "finetuned": True}},
            r"rope_scaling\['finetuned'\] = True is not supported with rope_type 'llama3'",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "extrapolation_factor": 0.5}},
            r"rope_scaling\['extrapolation_factor'\] = 0.5 is not supported with rope_type 'yarn'",
        ),
        (
            {
                "rope_scaling": {"factor": 2.0}
            },  # no type: plain RoPE, so the factor would be ignored
            r"rope_scaling\['factor'\] = 2.0 is not supported with rope_type 'default'",
        ),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor = 0.5 is not supported"),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.25,
                }
            },
            r"rope_parameters\['partial_rotary_factor'\] = 0.25 is not supported",
        ),
        (
            {"rope_scaling": {"rope_type": "linear"}},
            r"rope_scaling with rope_type 'linear' needs 'factor'",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 0.5}},
            r"rope_scaling\['factor'\] = 0.5 must be a number >= 1",
        ),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": "2"}},
            r"rope_scaling\['factor'\] = '2' must be a number >= 1",
        ),
        (
            {"rope_scaling": {**LLAMA31, "high_freq_factor": 1.0}},
            r"rope_scaling\['high_freq_factor'\] = 1.0 must be greater than low_freq_factor = 1.0",
        ),
        (
            {"rope_scaling": {**LLAMA31, "original_max_position_embeddings": 32.5}},
            r"rope_scaling\['original_max_position_embeddings'\] = 32.5 must be a positive integer",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": None}},
            r"rope_scaling\['truncate'\] = None must be true or false",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "type": "linear", "factor": 4.0}},
            r"rope_scaling\['rope_type'\] = 'yarn' and rope_scaling\['type'\] = 'linear' disagree",
        ),
        ({"rope_scaling": ["linear", 2.0]}, r"rope_scaling = \['linear', 2.0\] must be an object"),
        (
            {"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
            r"rope_theta = 1000000.0 and rope_parameters\['rope_theta'\] = 10000.0 disagree",
        ),
        (
            {
                "rope_theta": 1e6,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            },
            r"rope_scaling = .* and rope_parameters = .* disagree",
        ),
        (
            {"original_max_position_embeddings": 64, "rope_scaling": LLAMA31},
            (
                r"original_max_position_embeddings = 64 must be a positive integer "
                r"that agrees with rope_scaling\['original_max_position_embeddings'\] = 32"
            ),
        ),
        ({"rope_theta": -1.0}, r"rope_theta = -1.0 must be a number > 0"),
        ({"rope_theta": "1e6"}, r"rope_theta = '1e6' must be a number > 0"),
    ],
)
def test_settings_it_cannot_compute_exactly_are_refused_by_name(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    raw = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        **change,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=rf"config\.json: {message}"):
        config_from_hf(tmp_path)


def test_llama_3_2_style_scaling_loads_with_its_context_length(tmp_path: Path) -> None:
    """Llama 3.2's config.json (rope_scaling of rope_type llama3) was refused; it loads, and the
    model's context length is max_position_embeddings (llama3 does not extend it, as in vLLM),
    while yarn and linear extend theirs by the factor."""
    raw = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "rope_scaling": {**LLAMA31, "factor": 32.0, "original_max_position_embeddings": 8192},
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = config_from_hf(tmp_path)
    assert config.rope_scaling == RopeScaling("llama3", 32.0, 8192, 1.0, 4.0)
    assert config.derived_max_model_len == 131072
    for scaling, length in [
        ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
        ({"type": "linear", "factor": 2.0}, 262144),
        ({"type": "dynamic", "factor": 2.0}, 131072),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, "rope_scaling": scaling}))
        assert config_from_hf(tmp_path).derived_max_model_len == length
