"""Paged-attention and KV-cache kernels: Triton on CUDA, a compiled C kernel on the CPU, and
the torch references (the oracle every kernel is tested against).

Cache layout (vLLM / nano-vllm), per layer: ``k_cache``/``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; slot = block_id * block_size + offset.

Dispatch (``auto``): tensors on CUDA use the Triton kernels when triton imports; float32
tensors on the CPU use the compiled kernel of :mod:`tokentape.kernels.cpu_native` when a C
compiler is there to build it; anything else uses the torch reference in
:mod:`tokentape.kernels.reference`. ``backend=`` on a call, or the ``TOKENTAPE_KERNELS``
environment variable (``auto``, ``torch``, ``cpu``, ``triton``), overrides it; ``triton`` on
CPU tensors only works under the interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal, Protocol

import torch

from tokentape.kernels import cpu_native
from tokentape.kernels.reference import paged_attention_ref, write_kv_cache_ref

Backend = Literal["auto", "torch", "cpu", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "triton")
BACKEND_ENV = "TOKENTAPE_KERNELS"

__all__ = [
    "BACKEND_ENV",
    "Backend",
    "FusedOps",
    "fused_ops",
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


def resolve_backend(
    device: torch.device, backend: Backend | None = None, dtype: torch.dtype = torch.float32
) -> str:
    """``torch``, ``cpu`` or ``triton`` for tensors of ``dtype`` on ``device`` (argument, then
    env var, then auto)."""
    choice = backend or os.environ.get(BACKEND_ENV, "auto") or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {BACKENDS}")
    if choice == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        native = device.type == "cpu" and dtype == torch.float32 and cpu_native.load() is not None
        return "cpu" if native else "torch"
    if choice == "cpu" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"kernel backend 'cpu' takes float32 CPU tensors, got {dtype} on {device.type}"
        )
    if choice == "cpu" and cpu_native.load() is None:
        raise ValueError(f"kernel backend 'cpu' is not available: {cpu_native.load_error()}")
    if choice == "triton" and not triton_available():
        raise ValueError("kernel backend 'triton' requested but triton is not installed")
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"kernel backend 'triton' needs CUDA tensors (got {device.type}) or the interpreter "
            "(TRITON_INTERPRET=1 before triton is imported)"
        )
    return choice


class FusedOps(Protocol):
    """What the decoder's fused pass (engine/model/decoder.py) calls a backend for: its
    per-row operations, each one kernel where the torch modules make several, and the KV
    write and attention over a batch made once per pass. kernels/cpu_layers.py (compiled C,
    float32) and kernels/triton_layers.py (Triton) are the two; the modules are the oracle."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...

    def qk_norm_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        positions: torch.Tensor,
    ) -> None: ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...

    def pass_batch(
        self,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> Any: ...

    def write_kv(
        self,
        batch: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None: ...

    def attend(
        self,
        batch: Any,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None: ...


def fused_ops(backend: str) -> FusedOps | None:
    """The fused pass's operations for a resolved backend (resolve_backend), None for
    ``torch``: the modules' own ops."""
    if backend == "cpu":
        from tokentape.kernels import cpu_layers

        return cpu_layers
    if backend == "triton":
        from tokentape.kernels import triton_layers

        return triton_layers
    return None


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
    chosen = resolve_backend(k_cache.device, backend, k_cache.dtype)
    if chosen == "triton":
        from tokentape.kernels.triton_kv_write import write_kv_cache_triton

        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    elif (
        chosen == "cpu"
        and key.dtype == value.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    ):
        cpu_native.write_kv_cache_cpu(key, value, k_cache, v_cache, slot_mapping)
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
    out: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Causal attention of B sequences' new tokens (prefill chunks and decodes mixed).

    query [total_q, num_heads, head_dim] (ragged, ``cu_seqlens_q`` [B+1] int32); seq_lens [B]
    int32 counts each whole context including this step's tokens, already written with
    :func:`write_kv_cache`; block_tables [B, max_blocks_per_seq] int32. Every sequence has at
    least one new token. Returns [total_q, num_heads, head_dim] in query's dtype (fp32 math):
    ``out`` if given (contiguous, that shape and dtype), which the CPU kernels write in place.
    """
    if out is not None and (
        out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {query.dtype} tensor of the query's shape "
            f"{tuple(query.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    kwargs = {"cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens, "block_tables": block_tables}
    chosen = resolve_backend(query.device, backend, query.dtype)
    if chosen == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous():
        return cpu_native.paged_attention_cpu(
            query, k_cache, v_cache, scale=scale, out=out, **kwargs
        )
    if chosen == "triton":
        from tokentape.kernels.triton_layers import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, scale=scale, out=out, **kwargs)
    result = paged_attention_ref(query, k_cache, v_cache, scale=scale, **kwargs)
    return result if out is None else out.copy_(result)
