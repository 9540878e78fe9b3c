"""Triton kernel: write new tokens' keys and values into the paged KV cache."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tokentape.kernels.shapes import check_kv_write_shapes
from tokentape.kernels.triton_common import check_cache_strides


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_b,
    stride_cache_s,
    stride_cache_h,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: all its heads at once.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # not cached (padding)
        return
    block_id = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    token64 = token.to(tl.int64)
    key = tl.load(
        key_ptr + token64 * stride_key_t + heads[:, None] * stride_key_h + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token64 * stride_value_t + heads[:, None] * stride_value_h + dims[None, :],
        mask=mask,
    )
    cache_offsets = (
        block_id * stride_cache_b
        + offset * stride_cache_s
        + heads[:, None] * stride_cache_h
        + dims[None, :]
    )
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_write_kernel_meta(num_kv_heads: int, head_dim: int) -> dict[str, Any]:
    """Compile-time parameters of the KV write kernel (shared with the ahead-of-time check)."""
    return {
        "BLOCK_H": triton.next_power_of_2(num_kv_heads),
        "BLOCK_D": triton.next_power_of_2(head_dim),
    }


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`tokentape.kernels.reference.write_kv_cache_ref`."""
    check_kv_write_shapes(key, value, k_cache, v_cache, slot_mapping)
    check_cache_strides(k_cache, v_cache)
    # The kernel indexes head_dim with unit stride.
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        **kv_write_kernel_meta(num_kv_heads, head_dim),
    )
