"""Triton kernel: paged prefill, variable length, causal over the cached prefix.

The batch is ragged: sequence b has q_len_b new tokens (a prefill chunk, or a single decode
token) whose K/V are already in the cache, after seq_len_b - q_len_b cached tokens. The grid
has one program per (tile of BLOCK_Q new tokens of one sequence, kv head), found without a
host sync: tile i of the flattened grid belongs to the last sequence b with
``cu_seqlens_q[b] // BLOCK_Q + b <= i`` (binary search). Each program packs its BLOCK_Q tokens
times the GROUP query heads sharing the kv head into BLOCK_M rows (GQA: K/V read once per
group) and runs a flash-attention online softmax over the sequence's blocks up to its last
token's position.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tokentape.kernels.triton_common import LOG2_E, dot_precision, prepare_attention_inputs

BLOCK_M = 64  # query rows per program: BLOCK_M // GROUP tokens times GROUP heads
# KV tokens per inner iteration, and warps: with Q, the accumulator and K/V tiles in fp32,
# 64-token tiles or 4 warps spill registers on sm_90 (`gpu_check.py --compile-only`).
TILE_N = 32
NUM_WARPS = 8


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles include flattened tile index ``tile``."""
    low: tl.int32 = 0  # typed, so the loop-carried value keeps one type on every triton
    high: tl.int32 = num_seqs
    while low < high:
        mid = (low + high) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            low = mid + 1
        else:
            high = mid
    return low - 1


# num_seqs is never specialized (a constexpr 1 would make a loop-carried constant above).
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_cache_b,
    stride_cache_s,
    stride_cache_h,
    stride_bt,
    num_seqs,
    head_dim,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, tile_index, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_tile = tile_index - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:  # the spare tile each sequence's rounding leaves
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP  # index among the sequence's new tokens
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(
        query_ptr + q_rows[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    q_pos = prefix_len + token  # absolute position of each row's token

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys after this tile's last token are masked for every row: never load them.
    kv_end = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_Q)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(0, kv_end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        offsets = block * stride_cache_b + (pos % block_size) * stride_cache_s
        offsets += kv_head * stride_cache_h
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, TILE]
        # Position 0 is visible to every row, so after the first tile each row's max is finite.
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    out = acc / l[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def prefill_kernel_meta(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> dict[str, Any]:
    """Compile-time parameters of the prefill kernel (shared with the ahead-of-time check)."""
    group = num_heads // num_kv_heads
    block_m = max(BLOCK_M, triton.next_power_of_2(group))
    return {
        "GROUP": group,
        "BLOCK_Q": block_m // group,
        "BLOCK_M": block_m,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "TILE": TILE_N,
        "PRECISION": dot_precision(dtype),
        "num_warps": NUM_WARPS,
    }


def paged_prefill_triton(
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
    """Paged attention over a ragged mix of prefill chunks and decodes (see ``paged_attention``).
    Written into ``out`` where given (the query's shape and dtype, unit stride over head_dim).
    """
    query, block_tables = prepare_attention_inputs(
        query, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables
    )
    total_q, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query) if out is None else out
    if total_q == 0:
        return out
    meta = prefill_kernel_meta(num_heads, num_kv_heads, head_dim, query.dtype)
    # Each sequence's tiles start at cu_seqlens_q[b] // BLOCK_Q + b: enough for all of them.
    num_tiles = total_q // meta["BLOCK_Q"] + num_seqs
    _prefill_kernel[(num_tiles, num_kv_heads)](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_seqs,
        head_dim,
        block_size,
        **meta,
    )
    return out
