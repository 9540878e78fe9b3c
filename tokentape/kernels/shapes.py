"""The kernels' input checks, shared by the torch references and the Triton and CPU kernels:
one-line ValueErrors for tensors that do not fit the cache layout (docs/kernels.md), without
a device sync."""

from __future__ import annotations

import torch


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def check_kv_write_shapes(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """One-line ValueErrors for inputs that do not fit the cache layout."""
    _check_cache_pair(k_cache, v_cache)
    if slot_mapping.is_floating_point() or slot_mapping.is_complex():
        raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    expected = (slot_mapping.shape[0], k_cache.shape[2], k_cache.shape[3])
    if slot_mapping.dim() != 1 or key.shape != expected or value.shape != expected:
        raise ValueError(
            f"key/value must be [num_tokens, num_kv_heads, head_dim] = {expected}, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )


def check_attention_shapes(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """One-line ValueErrors for inputs that do not fit together (no device sync needed)."""
    _check_cache_pair(k_cache, v_cache)
    if query.dim() != 3 or query.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"query must be [total_q, num_heads, head_dim={k_cache.shape[3]}], "
            f"got {tuple(query.shape)}"
        )
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"num_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({k_cache.shape[2]})"
        )
    for name, t in (
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(
            f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries, "
            f"got shape {tuple(cu_seqlens_q.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], "
            f"got {tuple(block_tables.shape)}"
        )
