"""Triton kernels: paged-attention decode (one new token per sequence), split over the KV.

Stage 1 runs one program per (sequence, kv head, split of the context): the group of query
heads sharing that kv head is padded to 16 rows so both products are ``tl.dot``s, and K/V are
read once per group (GQA). Each program keeps a flash-attention style running max, sum and
weighted value, written as partials. Stage 2 merges the splits of each (sequence, head); when
the block table is short enough for a single split, stage 1 writes the output itself.

The split length depends only on the block table's width. The engine pads every table to the
batch's widest, and a mixed batch sends its decodes through the prefill kernel, so on CUDA a
sequence's bits can depend on its batch past 16,384 tokens of table or in a mixed step: the
model runner refuses `batch_invariant=True` there; the CPU reference is the invariant path.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tokentape.kernels.triton_common import LOG2_E, dot_precision, prepare_attention_inputs

# KV tokens per inner iteration, and warps: K/V are upcast to fp32 in registers, and a 64-token
# tile at 4 warps spills on sm_90 (checked with `gpu_check.py --compile-only`), 32 does not.
TILE_N = 32
NUM_WARPS = 4
MIN_SPLIT_TOKENS = 256  # fewer tokens per split would cost more in merging than it gains
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    out_ptr,  # written directly when there is a single split
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    partial_out_ptr,  # [B, H, num_splits, head_dim] fp32
    partial_max_ptr,  # [B, H, num_splits] fp32, log2 domain
    partial_sum_ptr,  # [B, H, num_splits] fp32
    qk_scale,  # softmax scale * log2(e)
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_cache_b,
    stride_cache_s,
    stride_cache_h,
    stride_bt,
    num_heads,
    head_dim,
    block_size,
    split_tokens,
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, seq_len)

    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(
        query_ptr + q_row * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        pos_ok = pos < end
        block = tl.load(table + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        offsets = block * stride_cache_b + (pos % block_size) * stride_cache_s
        offsets += kv_head * stride_cache_h
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, TILE]
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    if SINGLE_SPLIT:
        # The whole context in one split: no merge. This gives the same bits as the merge
        # would (weight exactly 1, the empty splits' exactly 0).
        tl.store(
            out_ptr + q_row * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
            (acc / l[:, None]).to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # An empty split (past the end of the context) stores max -inf and sum 0: weight 0.
        partial = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(partial_max_ptr + partial, m, mask=row_ok)
        tl.store(partial_sum_ptr + partial, l, mask=row_ok)
        tl.store(
            partial_out_ptr + partial[:, None] * head_dim + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    cu_seqlens_q_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    stride_o_t,
    stride_o_h,
    num_heads,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    m = tl.load(partial_max_ptr + base + splits, mask=split_ok, other=float("-inf"))
    l = tl.load(partial_sum_ptr + base + splits, mask=split_ok, other=0.0)
    # Split 0 always holds the first token, so the overall max is finite.
    weight = tl.exp2(m - tl.max(m, axis=0))
    acc = tl.load(
        partial_out_ptr + (base + splits[:, None]) * head_dim + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    q_row = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    tl.store(
        out_ptr + q_row * stride_o_t + head * stride_o_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def split_kernel_meta(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_splits: int
) -> dict[str, Any]:
    """Compile-time parameters of the split kernel (shared with the ahead-of-time check)."""
    group = num_heads // num_kv_heads
    return {
        "SINGLE_SPLIT": num_splits == 1,
        "GROUP": group,
        "BLOCK_G": max(16, triton.next_power_of_2(group)),  # tl.dot needs 16 rows
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "TILE": TILE_N,
        "PRECISION": dot_precision(dtype),
        "num_warps": NUM_WARPS,
    }


def merge_kernel_meta(head_dim: int, num_splits: int) -> dict[str, Any]:
    """Compile-time parameters of the merge kernel."""
    return {
        "BLOCK_S": max(2, triton.next_power_of_2(num_splits)),
        "BLOCK_D": triton.next_power_of_2(head_dim),
    }


def decode_split_tokens(max_context: int) -> int:
    """Tokens per split for a block table covering ``max_context`` tokens."""
    per_split = max(MIN_SPLIT_TOKENS, triton.cdiv(max_context, MAX_SPLITS))
    return triton.cdiv(per_split, TILE_N) * TILE_N


def paged_decode_triton(
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
    """Paged attention when every sequence has exactly one new token (see ``paged_attention``).
    Written into ``out`` where given (the query's shape and dtype, unit stride over head_dim).
    """
    query, block_tables = prepare_attention_inputs(
        query, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables
    )
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"decode needs one new token per sequence: {query.shape[0]} tokens for "
            f"{seq_lens.shape[0]} sequences"
        )
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    split_tokens = decode_split_tokens(max_context)
    num_splits = triton.cdiv(max_context, split_tokens)
    if num_splits == 1:  # the kernel writes `out` itself; the partials are never touched
        partial_out = partial_max = partial_sum = out
    else:
        partial_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        partial_max = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        partial_out,
        partial_max,
        partial_sum,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        head_dim,
        block_size,
        split_tokens,
        num_splits,
        **split_kernel_meta(num_heads, num_kv_heads, head_dim, query.dtype, num_splits),
    )
    if num_splits == 1:
        return out
    _decode_merge_kernel[(num_seqs, num_heads)](
        out,
        cu_seqlens_q,
        partial_out,
        partial_max,
        partial_sum,
        out.stride(0),
        out.stride(1),
        num_heads,
        head_dim,
        num_splits,
        **merge_kernel_meta(head_dim, num_splits),
    )
    return out
