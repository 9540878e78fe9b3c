"""RoPE settings of Llama and Qwen checkpoints: read from config.json in either form
transformers writes, checked, and turned into inverse frequencies as transformers'
ROPE_INIT_FUNCTIONS compute them (the same ops in the same order, so the same bits).

transformers 4 writes a top-level `rope_theta` and `rope_scaling`; transformers 5 writes both
into `rope_parameters` ({"rope_type": ..., "rope_theta": ..., <the scaling's keys>}).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from tokentape.errors import CheckpointError

DEFAULT_ROPE_THETA = 10000.0  # what transformers uses when a config names none

# The keys each supported rope_type may carry besides rope_type/type and rope_theta: those
# transformers' validation knows for it. Any other key is refused (it may change the math).
_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "llama3": frozenset(
        {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}
    ),
}
_REQUIRED: dict[str, frozenset[str]] = {
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor"}),  # may be null: then max_position_embeddings / original
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
}
ROPE_TYPES = tuple(_KEYS)
_ORIGINAL_LEN = ("llama3", "yarn")  # the types with a pretraining length of their own


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling, its keys as config.json names them; None: not given."""

    rope_type: str  # linear, dynamic, yarn or llama3
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json's `rope_scaling` (the keys that were given)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None}

    def original_len(self, max_position_embeddings: int) -> int:
        """The pretraining context length (transformers defaults it to max_position_embeddings)."""
        return self.original_max_position_embeddings or max_position_embeddings


def rope_from_hf(raw: dict[str, Any], file: str) -> tuple[float, RopeScaling | None]:
    """`rope_theta` and the scaling of a config.json in either form. transformers 5 reads
    `rope_scaling` when there is one (and drops `rope_parameters`), taking rope_theta from it
    or the top level; a config whose two forms disagree is refused rather than guessed at, and
    so is anything this engine does not compute as transformers does (named, with its value)."""
    _check_partial_rotary("partial_rotary_factor", raw.get("partial_rotary_factor"), file)
    legacy = _dict_or_none("rope_scaling", raw.get("rope_scaling"), file)
    params = _dict_or_none("rope_parameters", raw.get("rope_parameters"), file)
    where = "rope_scaling" if legacy else "rope_parameters"
    chosen = dict(legacy or params or {})
    _check_partial_rotary(
        f"{where}['partial_rotary_factor']", chosen.pop("partial_rotary_factor", None), file
    )
    top, nested = raw.get("rope_theta"), chosen.pop("rope_theta", None)
    if top is not None and nested is not None and top != nested:
        raise CheckpointError(
            f"{file}: rope_theta = {top!r} and {where}['rope_theta'] = {nested!r} disagree"
        )
    theta = nested if nested is not None else top
    if legacy and params:
        other = dict(params)
        other.pop("partial_rotary_factor", None)
        other_theta = other.pop("rope_theta", None)
        if _normalized(other) != _normalized(chosen) or other_theta not in (None, theta):
            raise CheckpointError(
                f"{file}: rope_scaling = {legacy!r} and rope_parameters = {params!r} disagree "
                "(transformers reads rope_scaling, with rope_theta from it or the top level, "
                "and drops rope_parameters); keep one of them"
            )
    theta = DEFAULT_ROPE_THETA if theta is None else _number("rope_theta", theta, file, 0)
    scaling = _scaling(where, chosen, file)
    top_original = raw.get("original_max_position_embeddings")
    if scaling is not None and top_original is not None and scaling.rope_type in _ORIGINAL_LEN:
        # transformers takes a top-level original length over the scaling's own (Phi-3 style)
        given = scaling.original_max_position_embeddings
        if type(top_original) is not int or top_original < 1 or given not in (None, top_original):
            raise CheckpointError(
                f"{file}: original_max_position_embeddings = {top_original!r} must be a positive "
                f"integer that agrees with {where}['original_max_position_embeddings'] = {given!r}"
            )
        scaling = replace(scaling, original_max_position_embeddings=top_original)
    return theta, scaling


def _scaling(where: str, given: dict[str, Any], file: str) -> RopeScaling | None:
    values = dict(given)
    kind, old = values.pop("rope_type", None), values.pop("type", None)
    if kind is not None and old is not None and kind != old:
        raise CheckpointError(
            f"{file}: {where}['rope_type'] = {kind!r} and {where}['type'] = {old!r} disagree"
        )
    kind = kind if kind is not None else old if old is not None else "default"
    if kind not in _KEYS:
        raise CheckpointError(
            f"{file}: {where}['rope_type'] = {kind!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    for key, value in values.items():
        if key not in _KEYS[kind]:
            raise CheckpointError(
                f"{file}: {where}[{key!r}] = {value!r} is not supported with rope_type {kind!r}"
            )
    for key in sorted(_REQUIRED.get(kind, ())):
        if key not in values:
            raise CheckpointError(f"{file}: {where} with rope_type {kind!r} needs {key!r}")
    if kind == "default":
        return None
    checked: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{where}[{key!r}]"
        if key == "truncate":
            if not isinstance(value, bool):
                raise CheckpointError(f"{file}: {name} = {value!r} must be true or false")
            checked[key] = value
        elif key == "original_max_position_embeddings":
            if type(value) is not int or value < 1:
                raise CheckpointError(f"{file}: {name} = {value!r} must be a positive integer")
            checked[key] = value
        elif value is None and key == "factor" and kind == "yarn":
            checked[key] = None
        elif key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
            checked[key] = _number(name, value, file, 1 if key == "factor" else 0)
        else:  # beta_fast, beta_slow, mscale, mscale_all_dim: 0 and null mean unset
            checked[key] = None if value is None else _number(name, value, file, None)
    scaling = RopeScaling(kind, **checked)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    if low is not None and high is not None and high <= low:
        raise CheckpointError(
            f"{file}: {where}['high_freq_factor'] = {high!r} must be greater "
            f"than low_freq_factor = {low!r}"
        )
    return scaling


def _number(name: str, value: object, file: str, minimum: float | None) -> float:
    """A finite number; above 0 for minimum 0, at least `minimum` otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > 0 if minimum == 0 else value >= minimum  # type: ignore[operator]
    if not ok:
        need = (
            "a finite number"
            if minimum is None
            else "a number > 0"
            if minimum == 0
            else f"a number >= {minimum}"
        )
        raise CheckpointError(f"{file}: {name} = {value!r} must be {need}")
    return float(value)  # type: ignore[arg-type]


def _dict_or_none(name: str, value: object, file: str) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    raise CheckpointError(f"{file}: {name} = {value!r} must be an object or null")


def _check_partial_rotary(name: str, value: object, file: str) -> None:
    if value is not None and value != 1.0:
        raise CheckpointError(
            f"{file}: {name} = {value!r} is not supported (RoPE over part of "
            "each head; this engine rotates whole heads)"
        )


def _normalized(scaling: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return out


def context_length(max_position_embeddings: int, scaling: RopeScaling | None) -> int:
    """The model's context length, derived as vLLM derives max_model_len: `linear` extends
    max_position_embeddings by its factor, `yarn` extends its original length by its factor;
    `llama3` and plain RoPE keep max_position_embeddings. `dynamic` keeps it too (vLLM would
    multiply): see DYNAMIC_LIMIT."""
    if scaling is None or scaling.rope_type in ("llama3", "dynamic"):
        return max_position_embeddings
    if scaling.rope_type == "linear":
        return int(max_position_embeddings * _factor(scaling, max_position_embeddings))
    return int(
        scaling.original_len(max_position_embeddings) * _factor(scaling, max_position_embeddings)
    )


def context_length_source(max_position_embeddings: int, scaling: RopeScaling | None) -> str:
    """Where context_length's figure comes from, for messages."""
    if scaling is None or scaling.rope_type in ("llama3", "dynamic"):
        return f"max_position_embeddings = {max_position_embeddings}"
    factor = _factor(scaling, max_position_embeddings)
    if scaling.rope_type == "linear":
        return f"max_position_embeddings = {max_position_embeddings} x linear factor {factor}"
    original = scaling.original_len(max_position_embeddings)
    return f"original_max_position_embeddings = {original} x yarn factor {factor}"


# Why a `dynamic` checkpoint serves only max_position_embeddings positions, in the words the
# engine uses when it refuses a longer max_model_len.
DYNAMIC_LIMIT = (
    "rope_type 'dynamic' (NTK) is plain RoPE up to max_position_embeddings; past it "
    "transformers recomputes the base from the longest position of each forward pass and "
    "rotates every key with it, while a paged KV cache rotates a key once, when it is written, "
    "so tokentape serves such a model up to max_position_embeddings only"
)


def _factor(scaling: RopeScaling, max_position_embeddings: int) -> float:
    if scaling.factor is not None:
        return scaling.factor
    return max_position_embeddings / scaling.original_len(max_position_embeddings)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies [head_dim / 2] (float32) and the factor its cos and sin are
    multiplied by, as transformers computes them at model init."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    if scaling is None:
        return 1.0 / (theta**exponents), 1.0
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "linear":
        assert factor is not None
        inv_freq = 1.0 / (theta**exponents)
        inv_freq /= factor
        return inv_freq, 1.0
    if kind == "dynamic":
        # transformers' init value: the base at seq_len = max_position_embeddings, which the
        # formula leaves unchanged up to rounding (computed the same way for the same bits).
        assert factor is not None
        seq_len = max_position_embeddings
        base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        return 1.0 / (base**exponents), 1.0
    if kind == "llama3":
        return _llama3(theta, exponents, scaling, max_position_embeddings), 1.0
    return _yarn(dim, theta, scaling, max_position_embeddings)


def _llama3(
    theta: float, exponents: torch.Tensor, scaling: RopeScaling, max_position_embeddings: int
) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, a smooth
    blend between (transformers' _compute_llama3_parameters)."""
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    assert factor is not None and low is not None and high is not None
    old_context_len = scaling.original_len(max_position_embeddings)
    inv_freq = 1.0 / (theta**exponents)
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def _yarn(
    dim: int, theta: float, scaling: RopeScaling, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between, and
    cos/sin scaled by the attention factor (mscale) (transformers' _compute_yarn_parameters)."""
    original = scaling.original_len(max_position_embeddings)
    factor = _factor(scaling, max_position_embeddings)

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, scaling.mscale) / get_mscale(factor, scaling.mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.beta_fast or 32  # `or`: transformers treats 0 as unset too
    beta_slow = scaling.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate is None or scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor
