"""Paged-attention and KV-cache kernels: Triton on CUDA, torch references everywhere else.

Cache layout (vLLM / nano-vllm), per layer: ``k_cache``/``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; slot = block_id * block_size + offset.

Dispatch: tensors on CUDA use the Triton kernels when triton imports, anything else uses the
torch reference in :mod:`tokentape.kernels.reference`. ``backend=`` on a call, or the
``TOKENTAPE_KERNELS`` environment variable (``auto``, ``torch``, ``triton``), overrides it;
``triton`` on CPU tensors only works under the interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

from tokentape.kernels.reference import paged_attention_ref, write_kv_cache_ref

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
BACKEND_ENV = "TOKENTAPE_KERNELS"

__all__ = [
    "BACKEND_ENV",
    "Backend",
    "paged_attention",
    "paged_attention_ref",
    "resolve_backend",
    "triton_available",
    "write_kv_cache",
    "write_kv_cache_ref",
]


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (it is optional: the `cuda` and `test` extras install it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(device: torch.device, backend: Backend | None = None) -> str:
    """``torch`` or ``triton`` for tensors on ``device`` (argument, then env var, then auto)."""
    choice = backend or os.environ.get(BACKEND_ENV, "auto") or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {BACKENDS}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if choice == "triton" and not triton_available():
        raise ValueError("kernel backend 'triton' requested but triton is not installed")
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"kernel backend 'triton' needs CUDA tensors (got {device.type}) or the interpreter "
            "(TRITON_INTERPRET=1 before triton is imported)"
        )
    return choice


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Backend | None = None,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at ``slot_mapping`` (-1: skip)."""
    if resolve_backend(k_cache.device, backend) == "triton":
        from tokentape.kernels.triton_kv_write import write_kv_cache_triton

        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Causal attention of B sequences' new tokens (prefill chunks and decodes mixed).

    query [total_q, num_heads, head_dim] (ragged, ``cu_seqlens_q`` [B+1] int32); seq_lens [B]
    int32 counts each whole context including this step's tokens, already written with
    :func:`write_kv_cache`; block_tables [B, max_blocks_per_seq] int32. Every sequence has at
    least one new token. Returns [total_q, num_heads, head_dim] in query's dtype (fp32 math).
    """
    kwargs = {"cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens, "block_tables": block_tables}
    if resolve_backend(query.device, backend) == "triton":
        if query.shape[0] == seq_lens.shape[0]:
            # One new token per sequence (each has at least one): the split-KV decode kernel.
            from tokentape.kernels.triton_decode import paged_decode_triton

            return paged_decode_triton(query, k_cache, v_cache, scale=scale, **kwargs)
        from tokentape.kernels.triton_prefill import paged_prefill_triton

        return paged_prefill_triton(query, k_cache, v_cache, scale=scale, **kwargs)
    return paged_attention_ref(query, k_cache, v_cache, scale=scale, **kwargs)
