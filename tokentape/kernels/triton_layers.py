"""The decoder's per-row operations as Triton kernels, for the fused pass on CUDA: RMSNorm
with the residual add folded in, the q/k norms with RoPE, SwiGLU's silu(gate) * up, and the
KV write and attention over the pass's batch (the attention kernels chosen as
kernels.paged_attention chooses them on CUDA: paged_attention_triton).

The torch modules spend a few dozen kernels a layer on these (RMSNorm alone is seven, RoPE
six per tensor), and a decode step of a small model is the time to launch them, graphs or
not (docs/benchmarks.md, "On a GPU"). Here each is one kernel.

The torch modules (engine/model/layers.py) are the oracle. Each intermediate the module
rounds to the activations' dtype is rounded here too, so in bfloat16 the results differ from
the modules' only by the order of a row's sum (and in float32 the roundings are no-ops).
The same interface as cpu_layers (kernels.FusedOps); contiguous tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokentape.kernels import triton_decode, triton_prefill
from tokentape.kernels.triton_kv_write import write_kv_cache_triton

SILU_BLOCK = 1024  # elements per program of silu_mul


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * dim + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * dim + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    y = (xf * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (y * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    NORM: tl.constexpr,
    HALF: tl.constexpr,
):
    # One program per (token, head), the query heads first, then the key heads.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_heads:
        row_ptr = q_ptr + (token * num_heads + head) * head_dim
        norm_ptr = q_norm_ptr
    else:
        row_ptr = k_ptr + (token * num_kv_heads + head - num_heads) * head_dim
        norm_ptr = k_norm_ptr
    dtype = q_ptr.dtype.element_ty
    half = head_dim // 2
    offs = tl.arange(0, HALF)
    mask = offs < half
    x1 = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=0) / head_dim + eps)
        w1 = tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    # NeoX layout, as HF's rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the
    # tables cast to the activations' dtype and each product rounded to it.
    table = tl.load(positions_ptr + token) * head_dim
    c1 = tl.load(cos_ptr + table + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + table + half + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + table + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + table + half + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    o1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(row_ptr + offs, o1.to(dtype), mask=mask)
    tl.store(row_ptr + half + offs, o2.to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + offs, (silu * up).to(dtype), mask=mask)


def rms_norm_kernel_meta(dim: int) -> dict[str, int]:
    """Compile-time parameters of the norm kernel (shared with the ahead-of-time check)."""
    block = triton.next_power_of_2(dim)
    return {"BLOCK": block, "num_warps": max(1, min(8, block // 256))}


def qk_norm_rope_kernel_meta(head_dim: int, norm: bool) -> dict[str, int | bool]:
    """Compile-time parameters of the q/k norm and RoPE kernel."""
    return {"NORM": norm, "HALF": triton.next_power_of_2(max(1, head_dim // 2)), "num_warps": 1}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, as a new tensor."""
    return _norm(x.contiguous(), None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place), then rms_norm(residual): the step between two sublayers."""
    assert residual.is_contiguous() and residual.shape == x.shape
    return _norm(x.contiguous(), residual, weight, eps)


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    out = torch.empty_like(x)
    dim = x.shape[-1]
    rows = x.numel() // dim
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            **rms_norm_kernel_meta(dim),
        )
    return out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """In place on contiguous q [T, H, D] and k [T, Hkv, D]: the per-head RMSNorms (when
    given; Qwen3), then RoPE at `positions` [T] from the float32 tables [P, D]."""
    assert q.is_contiguous() and k.is_contiguous() and q.dtype == k.dtype
    tokens, heads, dim = q.shape
    if dim % 2 or cos_table.shape[-1] != dim:
        raise ValueError(f"qk_norm_rope: head size {dim} needs even RoPE tables of that width")
    if not tokens:
        return
    norm = q_norm is not None and k_norm is not None
    _qk_norm_rope_kernel[(tokens, heads + k.shape[1])](
        q,
        k,
        q_norm if norm else q,
        k_norm if norm else k,
        cos_table,
        sin_table,
        positions,
        heads,
        k.shape[1],
        dim,
        eps,
        **qk_norm_rope_kernel_meta(dim, norm),
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, as a new tensor."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, SILU_BLOCK),)](gate, up, out, n, BLOCK=SILU_BLOCK)
    return out


@dataclass(slots=True)
class TritonBatch:
    """A forward pass's batch as the attention kernels take it (AttentionMetadata's tensors),
    shared by every layer's KV write and attention."""

    cu_seqlens_q: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32
    block_tables: torch.Tensor  # int32
    slot_mapping: torch.Tensor  # int64, -1: not written


def pass_batch(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> TritonBatch:
    return TritonBatch(cu_seqlens_q, seq_lens, block_tables, slot_mapping)


def write_kv(
    batch: TritonBatch,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """The batch's new keys and values into the cache at its slots."""
    write_kv_cache_triton(key, value, k_cache, v_cache, batch.slot_mapping)


def attend(
    batch: TritonBatch,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The batch's attention into `out` (contiguous, the query's shape)."""
    paged_attention_triton(
        query,
        k_cache,
        v_cache,
        cu_seqlens_q=batch.cu_seqlens_q,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        scale=scale,
        out=out,
    )


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """kernels.paged_attention on CUDA: the split-KV decode kernel when every sequence has
    one new token (each has at least one), else the prefill kernel."""
    attention = (
        triton_decode.paged_decode_triton
        if query.shape[0] == seq_lens.shape[0]
        else triton_prefill.paged_prefill_triton
    )
    return attention(
        query,
        k_cache,
        v_cache,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_tables=block_tables,
        scale=scale,
        out=out,
    )
