"""The checks a weight update passes before any parameter changes (names known, shapes equal,
floating point, no NaN or infinity once cast), and the copy that loads it: shared by whole
updates, a transfer's chunks, a checkpoint's loading and the model's vLLM-style
load_weights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

_SUMMABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The first tensor holding a NaN or an infinity, or None. One pass over each tensor: its
    sum, which any NaN or infinity makes non-finite (a sum that merely overflows is checked
    again element by element); the sums go to the host together, one sync on a GPU."""
    if not tensors:
        return None
    sums = torch.stack([_sum(t) for t in tensors.values()])
    suspects = torch.nonzero(~torch.isfinite(sums)).flatten().tolist()
    names = list(tensors)
    for i in suspects:
        if not bool(torch.isfinite(tensors[names[i]]).all()):
            return names[i]
    return None


def _sum(t: torch.Tensor) -> torch.Tensor:
    # torch accumulates a half sum in float32 and rounds the result: a float16 sum past 65504
    # is rechecked, which is cheaper than sum(dtype=float32) (25x slower on the CPU).
    if t.dtype in _SUMMABLE:
        return t.sum().float()
    return t.float().sum()  # float8 and the like have no sum of their own


def non_finite_values(t: torch.Tensor) -> str:
    """What is wrong with a tensor first_non_finite named, for the message."""
    t = t.float()
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    parts = [f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else ""]
    return f"holds {' and '.join(p for p in parts if p)} value(s) out of {t.numel()}"


def checked_update(
    params: Mapping[str, torch.Tensor],
    tensors: Mapping[str, Any],
    origin: Mapping[str, str],
) -> dict[str, torch.Tensor]:
    """`tensors` checked against the parameters they replace (`origin`: the file of each, for
    the message) and cast to their dtype and device; ValueError naming the first bad one."""
    if not tensors:
        raise ValueError("update_weights: the update holds no tensors")
    out = {}
    for name, t in tensors.items():
        where = f"{origin[name]}: " if name in origin else ""
        p = params.get(name)
        if p is None:
            raise ValueError(f"{where}update_weights: unknown tensor {name!r}; nothing was changed")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(
                f"{where}update_weights: tensor {name!r} is not a floating-point tensor; "
                "nothing was changed"
            )
        if t.shape != p.shape:
            raise ValueError(
                f"{where}update_weights: tensor {name!r} has shape {tuple(t.shape)}, "
                "the model's is "
                f"{tuple(p.shape)}; nothing was changed"
            )
        out[name] = t.detach().to(device=p.device, dtype=p.dtype)
    # Checked as the model would hold them: a cast to a narrower dtype can overflow.
    bad = first_non_finite(out)
    if bad is not None:
        where = f"{origin[bad]}: " if bad in origin else ""
        cast = f" once cast to {out[bad].dtype}" if out[bad].dtype != tensors[bad].dtype else ""
        raise ValueError(
            f"{where}update_weights: tensor {bad!r} "
            f"{non_finite_values(out[bad])}{cast}; nothing was changed"
        )
    return out


def apply_update(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)
