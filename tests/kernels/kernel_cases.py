"""Paged-attention test cases: a ragged batch in a paged cache plus a dense naive oracle.

Importing this module also turns on the Triton interpreter where there is no CUDA:
TRITON_INTERPRET must be in the environment before triton is first imported, so every kernel
test module imports this first. The variable holds for the whole test process, so where CUDA
is present it is left alone (the real model's CUDA runs must not be interpreted) and the
interpreted tests skip: benchmarks/gpu_check.py covers the kernels on hardware. (Not a
conftest.py: other test folders import their conftest by name.)
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokentape.engine.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from tokentape.kernels.reference import write_kv_cache_ref

# Padding in block tables: an out-of-range block id, so reading it would fail loudly.
PAD_BLOCK = 1_000_000


@dataclass
class PagedCase:
    query: torch.Tensor  # [total_q, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    dense_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], as stored in the cache
    dense_v: list[torch.Tensor]
    scale: float

    def attention_kwargs(self) -> dict[str, Any]:
        return {
            "cu_seqlens_q": self.cu_seqlens_q,
            "seq_lens": self.seq_lens,
            "block_tables": self.block_tables,
            "scale": self.scale,
        }

    def select(self, index: int) -> PagedCase:
        """The same sequence alone in a batch of one, sharing the cache."""
        start, end = self.cu_seqlens_q[index].item(), self.cu_seqlens_q[index + 1].item()
        return PagedCase(
            query=self.query[start:end].clone(),
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=self.seq_lens[index : index + 1].clone(),
            block_tables=self.block_tables[index : index + 1].clone(),
            dense_k=[self.dense_k[index]],
            dense_v=[self.dense_v[index]],
            scale=self.scale,
        )


def make_case(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    extra_blocks: int = 3,
    extra_table_columns: int = 2,
    seed: int = 0,
) -> PagedCase:
    """``seqs`` is a list of (seq_len, q_len): context length including the q_len new tokens.

    Blocks are handed out in a shuffled order, so block tables are not contiguous, and the
    K/V of every position (cached prefix and new tokens alike) is written with the reference
    KV write, as the engine does before attention.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(blocks_per_seq) + extra_table_columns
    block_tables = torch.full((len(seqs), width), PAD_BLOCK, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    queries, dense_k, dense_v, cu = [], [], [], [0]
    for index, ((seq_len, q_len), n) in enumerate(zip(seqs, blocks_per_seq)):
        assert 1 <= q_len <= seq_len
        table = [free.pop() for _ in range(n)]
        block_tables[index, :n] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        positions = torch.arange(seq_len)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        write_kv_cache_ref(k, v, k_cache, v_cache, slots)
        dense_k.append(k)
        dense_v.append(v)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        cu.append(cu[-1] + q_len)
    return PagedCase(
        query=torch.cat(queries),
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32),
        block_tables=block_tables,
        dense_k=dense_k,
        dense_v=dense_v,
        scale=head_dim**-0.5,
    )


def naive_attention(case: PagedCase) -> torch.Tensor:
    """Dense causal attention in float64, one head of one sequence at a time."""
    num_heads = case.query.shape[1]
    group = num_heads // case.k_cache.shape[2]
    out = torch.empty(case.query.shape, dtype=torch.float64)
    cu = case.cu_seqlens_q.tolist()
    for b, seq_len in enumerate(case.seq_lens.tolist()):
        q = case.query[cu[b] : cu[b + 1]].double()
        q_len = q.shape[0]
        k, v = case.dense_k[b].double(), case.dense_v[b].double()
        positions = torch.arange(seq_len - q_len, seq_len)
        allowed = torch.arange(seq_len)[None, :] <= positions[:, None]
        for h in range(num_heads):
            scores = q[:, h] @ k[:, h // group].T * case.scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[cu[b] : cu[b + 1], h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Replace `owner.name` for the test with a wrapper that calls it and records each call;
    returns the list the calls are recorded in (one entry per call)."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def check_qk_norm_rope(
    ops: Any, qk_norm: bool, dtype: torch.dtype, head_dim: int, **tolerance: float
) -> None:
    """A backend's qk_norm_rope (kernels.FusedOps) against the modules it fuses: Qwen3's
    per-head RMSNorms (when `qk_norm`), then RoPE, on 7 tokens at scattered positions."""
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    q = torch.randn(7, 4, head_dim, generator=gen).to(dtype)
    k = torch.randn(7, 2, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 300, 511, 2])
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(dtype), RMSNorm(head_dim, 1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(head_dim, generator=gen))
        k_norm.weight.copy_(torch.randn(head_dim, generator=gen))
        eq, ek = (q_norm(q), k_norm(k)) if qk_norm else (q, k)
        eq, ek = apply_rotary(eq, ek, *rope.cos_sin(positions, dtype))
    ours_q, ours_k = q.clone(), k.clone()
    ops.qk_norm_rope(
        ours_q,
        ours_k,
        q_norm.weight if qk_norm else None,
        k_norm.weight if qk_norm else None,
        1e-6,
        rope.cos_cached,
        rope.sin_cached,
        positions,
    )
    torch.testing.assert_close(ours_q, eq, **tolerance)
    torch.testing.assert_close(ours_k, ek, **tolerance)
