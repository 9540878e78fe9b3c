"""Input checks and layout fixes shared by the Triton attention kernels."""

from __future__ import annotations

import torch

from tokentape.kernels.shapes import check_attention_shapes

LOG2_E = 1.4426950408889634  # the kernels use exp2: scores are scaled by log2(e) up front


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision: bf16/fp16 values are exact in tf32; fp32 inputs keep full
    fp32 products."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # Both caches are addressed with k_cache's strides.
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head_dim")


def prepare_attention_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the arguments of `paged_attention` and return (query, block_tables) with the unit
    innermost strides the kernels' pointer arithmetic assumes."""
    check_attention_shapes(query, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    check_cache_strides(k_cache, v_cache)
    query = query if query.stride(2) == 1 else query.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    return query, block_tables
