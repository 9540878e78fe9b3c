"""The one list of the models tokentape serves by name, read by the engine factory, the model
loader and every command's --model: the oracles (fake models whose token streams are known
without weights, so replays, storms and the postmortem check a run against them) and the
built-in models (their shapes in engine/model/model_config.py, weights drawn from the engine seed).
Any other name is a local Hugging Face checkpoint folder. No imports: it sits below them all."""

from __future__ import annotations

ORACLE_MODELS = ("oracle", "oracle-random")
BUILTIN_MODELS = ("tiny", "qwen3-0.6b")
DEFAULT_MODEL = "tiny"

MODEL_HELP = (
    "'tiny' (default: the built-in model, random weights drawn from the seed), 'qwen3-0.6b' "
    "(its shapes, random weights), a local Hugging Face checkpoint folder, or the fake "
    "models 'oracle' and 'oracle-random'"
)


def is_oracle(model: str) -> bool:
    return model in ORACLE_MODELS


def unknown_model(name: str) -> ValueError:
    """The error for a name that is no model here and no folder."""
    names = ", ".join(repr(m) for m in (*BUILTIN_MODELS, *ORACLE_MODELS))
    return ValueError(
        f"unknown model {name!r}: use {names} or a local Hugging Face checkpoint folder"
    )
