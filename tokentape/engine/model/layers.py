"""The decoder's building blocks, computed as Hugging Face's Llama/Qwen modules compute them
(same op order and dtype casts), so logits match transformers on the same weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# On the CPU a row of `x @ W.T` can come out differently depending on how many rows the
# matmul has (oneDNN/MKL pick other kernels and edge tiles for small M). Padding the rows to a
# multiple of this keeps every row on the same code path, so a sequence gets the same logits
# whether it is batched alone or with 31 others.
BATCH_INVARIANT_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """x @ weight.T + bias; with `batch_invariant`, rows padded as explained above."""
    if batch_invariant:
        rows = x.shape[0]
        pad = -rows % BATCH_INVARIANT_ROWS
        if pad:
            return F.linear(F.pad(x, (0, 0, 0, pad)), weight, bias)[:rows]
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear with an optional batch-invariant mode."""

    batch_invariant: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.batch_invariant)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (NeoX layout, as HF's rotate_half), cos/sin cached per position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_cached", torch.empty(0), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0), persistent=False)
        self.extend(max_positions)

    def extend(self, num_positions: int) -> None:
        """Cache cos/sin for positions [0, num_positions) (float32, as HF computes them)."""
        if self.cos_cached.shape[0] >= num_positions:
            return
        inv_freq = self.inv_freq.float()
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32, device=inv_freq.device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached, self.sin_cached = emb.cos(), emb.sin()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Keep the tables in float32 when the model is cast (HF computes RoPE in float32).
        cos, sin, inv = self.cos_cached, self.sin_cached, self.inv_freq
        super()._apply(fn, recurse)
        dev = self.cos_cached.device
        self.cos_cached, self.sin_cached, self.inv_freq = cos.to(dev), sin.to(dev), inv.to(dev)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cached[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin_cached[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
