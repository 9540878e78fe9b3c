"""The decoder's building blocks, computed as Hugging Face's Llama/Qwen modules compute them
(same op order and dtype casts), so logits match transformers on the same weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokentape.engine.model import cpu_matmul
from tokentape.engine.model.cpu_matmul import LinearFn
from tokentape.engine.model.rope import RopeScaling, inverse_frequencies
from tokentape.kernels import FusedOps
from tokentape.lora.layers import LoRABatch, LoRASlots


def matmul_for(x: torch.Tensor) -> tuple[LinearFn, bool]:
    """The matmul a layer applies to inputs like `x` (cpu_matmul.BACKEND's for 2-D float32 CPU
    tensors, else torch's), and whether it reads packed weights (Linear.weight_for). For a
    forward pass to choose once, not per layer."""
    fn = cpu_matmul.linear_fn(x)
    return fn, fn is cpu_matmul.BACKEND.linear and cpu_matmul.BACKEND.pack is not None


# On the CPU a row of `x @ W.T` can come out differently depending on how many rows the
# matmul has: BLAS picks other kernels for small M and handles the rows past the last full
# micro-tile separately. Padding the rows to a multiple of the micro-tile keeps every row on
# the same code path, so a sequence gets the same logits alone or batched with 31 others.
# The multiple is measured on the machine (calibrate_batch_invariant_rows); 0 means off, 1
# that the matmul needs none (MKL's packed GEMM: a row's result never depends on the rest).
ROW_MULTIPLES = (1, 4, 8, 16, 32, 64)


def linear(
    x: torch.Tensor,
    weight: Any,
    bias: torch.Tensor | None = None,
    pad_rows_to: int = 0,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, with the rows padded to a multiple of `pad_rows_to` (if > 0).
    `weight`: a tensor, or its packed copy for the matmul (cpu_matmul.PackedWeight); `into`:
    a buffer the result may be written into (cpu_matmul.linear_fn), padding rows included."""
    matmul = cpu_matmul.linear_fn(x, into)
    if pad_rows_to:
        rows = x.shape[0]
        pad = -rows % pad_rows_to
        if pad:
            return matmul(F.pad(x, (0, 0, 0, pad)), weight, bias)[:rows]
    return matmul(x, weight, bias)


# The answer depends on the BLAS and the shapes, not on the weights' values: measured once per
# process for each set of shapes, dtype and device.
_calibrated: dict[tuple[object, ...], int | None] = {}


def calibrate_batch_invariant_rows(weights: list[torch.Tensor]) -> int | None:
    """The smallest row multiple in ROW_MULTIPLES for which every row of a padded matmul with
    these weights' shapes equals the same row computed among 64, 256 and 1024 rows; None if
    none does (this BLAS is not batch-invariant even for large batches)."""
    key = (
        tuple((tuple(w.shape), str(w.layout)) for w in weights),
        tuple(sorted({str(w.dtype) for w in weights})),
        tuple(sorted({str(w.device) for w in weights})),
    )
    if key not in _calibrated:
        _calibrated[key] = _measure_row_multiple(weights)
    return _calibrated[key]


def _measure_row_multiple(weights: list[torch.Tensor]) -> int | None:
    gen = torch.Generator().manual_seed(0)
    shapes = {tuple(w.shape): w for w in weights}
    probes = []  # per shape: rows, the weight, and the first rows' results among 1024
    for w in shapes.values():
        x = torch.randn(1024, w.shape[1], generator=gen, dtype=w.dtype).to(w.device)
        ref = linear(x, w)
        if not all(torch.equal(linear(x[:m], w), ref[:m]) for m in (64, 256)):
            return None
        need = 2 * ROW_MULTIPLES[-1] + 2
        probes.append((x[:need], w, ref[:need].clone()))
        del ref
    # The smallest multiple that every shape passes, tried smallest first: most machines stop
    # at the first (each try is up to 2c + 1 matmuls per shape, an LM head's among them).
    for c in ROW_MULTIPLES:
        if all(
            torch.equal(linear(x[:m], w, None, c), ref[:m])
            for x, w, ref in probes
            for m in range(1, 2 * c + 2)
        ):
            return c
    return None


class Linear(nn.Linear):
    """nn.Linear with optional row padding for batch invariance (see above), and optionally a
    packed copy of its weight for the CPU's matmul (cpu_matmul.py), made once: a matmul handed
    the plain weight would pack it at every call."""

    pad_rows_to: int = 0
    lora: LoRASlots | None = None  # the LoRA adapters' weights on it, with LoRA enabled

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed_weight = cpu_matmul.PackedWeight()

    def add_lora(self, x: torch.Tensor, y: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """y (this layer's output for x) plus the LoRA products of the rows that run with
        an adapter, in place."""
        if lora is not None and self.lora is not None:
            self.lora.apply(x, y, lora)
        return y

    def prepack(self) -> None:
        """Keep the weight's packed copy for float32 CPU inputs (cpu_matmul.PackedWeight)."""
        self.packed_weight.pack(self.weight)

    def matmul_weight(self) -> object:
        """The weight the matmul reads: the packed copy if there is a current one."""
        return self.packed_weight.packed_as_is(self.weight)

    def weight_for(self, packed: bool) -> object:
        """The weight a matmul reads (packed or not, see matmul_for): the packed copy, if
        there is one, packed again if the weight changed since; else the weight."""
        return self.packed_weight.current(self.weight) if packed else self.weight

    def forward(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """`into`: a buffer the result may be written into (linear)."""
        _, packed = matmul_for(x)
        return linear(x, self.weight_for(packed), self.bias, self.pad_rows_to, into)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        inv_rms = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        # HF's `weight * (x * inv_rms).to(dtype)`, multiplied in place into the one fresh
        # tensor (a product is the same either way round).
        y = (x * inv_rms).to(dtype)
        return y.mul_(self.weight) if y.dtype == self.weight.dtype else self.weight * y


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (NeoX layout, as HF's rotate_half), cos/sin cached per position,
    with a checkpoint's RoPE scaling (rope.py): its inverse frequencies, and its attention
    factor multiplied into the cached cos and sin as transformers multiplies them."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        inv_freq, self.attention_factor = inverse_frequencies(
            head_dim, theta, scaling, max_position_embeddings or max_positions
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.cos_cached: torch.Tensor
        self.sin_cached: torch.Tensor
        self.register_buffer("cos_cached", torch.empty(0), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0), persistent=False)
        self.extend(max_positions)

    def extend(self, num_positions: int) -> None:
        """Cache cos/sin for positions [0, num_positions) (float32, as HF computes them)."""
        if self.cos_cached.shape[0] >= num_positions:
            return
        inv_freq = self.inv_freq.float()
        freqs = torch.outer(
            torch.arange(num_positions, dtype=torch.float32, device=inv_freq.device), inv_freq
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # YaRN's mscale
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.cos_cached, self.sin_cached = cos, sin

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Keep the tables in float32 when the model is cast (HF computes RoPE in float32).
        cos, sin, inv = self.cos_cached, self.sin_cached, self.inv_freq
        super()._apply(fn, recurse)
        dev = self.cos_cached.device
        self.cos_cached, self.sin_cached, self.inv_freq = cos.to(dev), sin.to(dev), inv.to(dev)
        return self

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] at the positions, in `dtype`: once per forward pass."""
        cos = self.cos_cached[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cached[positions].to(dtype).unsqueeze(1)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, *self.cos_sin(positions, q.dtype))


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, with the products and sum made in place."""
    return (x * cos).add_(_rotate_half(x).mul_(sin))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# On the CPU, prefill-sized batches go through the MLP in chunks of rows: each chunk's
# [rows, intermediate] activations stay in cache, where the whole batch's would be fresh
# multi-MB allocations whose pages fault in on first touch. A multiple of every row padding
# in ROW_MULTIPLES, so each row's result is the one it gets unchunked.
MLP_ROW_CHUNK = 1024


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        return _in_row_chunks(self._swiglu, x, lora)

    def _swiglu(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        act = F.silu(gate.add_lora(x, gate(x), lora), inplace=True)
        act.mul_(up.add_lora(x, up(x), lora))
        return down.add_lora(act, down(act), lora)

    def forward_fused(
        self,
        x: torch.Tensor,
        matmul: LinearFn,
        packed: bool,
        ops: FusedOps,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """forward() with silu(gate) * up in one call of the backend's fused operations, the
        layers' matmuls called directly (matmul_for; the rows come padded, see linear)."""
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        w_gate, w_up, w_down = (m.weight_for(packed) for m in (gate, up, down))

        def swiglu(rows: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
            g = gate.add_lora(rows, matmul(rows, w_gate, gate.bias), lora)
            u = up.add_lora(rows, matmul(rows, w_up, up.bias), lora)
            middle = ops.silu_mul(g, u)
            return down.add_lora(middle, matmul(middle, w_down, down.bias), lora)

        return _in_row_chunks(swiglu, x, lora)


def _in_row_chunks(
    swiglu: Callable[[torch.Tensor, LoRABatch | None], torch.Tensor],
    x: torch.Tensor,
    lora: LoRABatch | None,
) -> torch.Tensor:
    """swiglu over x's rows, on the CPU in chunks of MLP_ROW_CHUNK rows (see above)."""
    if x.shape[0] <= MLP_ROW_CHUNK or x.device.type != "cpu":
        return swiglu(x, lora)
    return torch.cat(
        [
            swiglu(rows, lora and lora.rows(i, i + MLP_ROW_CHUNK))
            for rows, i in zip(x.split(MLP_ROW_CHUNK), range(0, x.shape[0], MLP_ROW_CHUNK))
        ]
    )
