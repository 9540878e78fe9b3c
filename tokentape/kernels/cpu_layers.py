"""The decoder's per-row operations as compiled CPU kernels (`cpu/layers.c`): RMSNorm with the
residual add folded in, Qwen3's q/k norms with RoPE, SwiGLU's silu(gate) * up, the KV write
and attention over the pass's batch (kernels.FusedOps, as triton_layers on CUDA), and LoRA's
per-row product with each row's own adapter (`cpu/lora.c`).

A decoder layer makes a handful of these calls where the torch modules make a few dozen ops,
each with its allocation, its dispatch and its trip through the GIL (which the model's lanes
share; see engine/runners/input_batch.py). The torch modules (engine/model/layers.py) are the
oracle: these compute the same formulas, with sums in another order. Float32, CPU, contiguous
tensors only (`supported`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tokentape.kernels import cpu_native
from tokentape.kernels.scratch import ThreadScratch


def supported(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_native.load() is not None


def _lib():  # type: ignore[no-untyped-def]
    lib = cpu_native.load()
    assert lib is not None, cpu_native.load_error()
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, as a new tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _lib().tt_add_rms_norm_f32(
        x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place), then rms_norm(residual): the step between two sublayers."""
    x = x.contiguous()
    assert residual.is_contiguous() and residual.shape == x.shape
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _lib().tt_add_rms_norm_f32(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
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
    given; Qwen3), then RoPE at `positions` [T] (int64) from the float32 tables [P, D]."""
    assert q.is_contiguous() and k.is_contiguous() and positions.dtype == torch.int64
    tokens, heads, dim = q.shape
    code = _lib().tt_qk_norm_rope_f32(
        q.data_ptr(),
        k.data_ptr(),
        tokens,
        heads,
        k.shape[1],
        dim,
        q_norm.data_ptr() if q_norm is not None else None,
        k_norm.data_ptr() if k_norm is not None else None,
        eps,
        cos_table.data_ptr(),
        sin_table.data_ptr(),
        positions.contiguous().data_ptr(),
    )
    if code:
        raise ValueError(f"qk_norm_rope: head size {dim} is not supported (even, at most 512)")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, as a new tensor."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    _lib().tt_silu_mul_f32(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def pass_batch(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> cpu_native.CpuBatch:
    """The pass's batch in the kernels' form, made once for every layer."""
    return cpu_native.CpuBatch.of(cu_seqlens_q, seq_lens, block_tables, slot_mapping)


def write_kv(
    batch: cpu_native.CpuBatch,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """The batch's new keys and values into the (contiguous) cache at its slots."""
    assert batch.slots is not None
    cpu_native.write_kv(key, value, k_cache, v_cache, batch.slots, batch.bad)


def attend(
    batch: cpu_native.CpuBatch,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The batch's attention into `out` (contiguous, the query's shape)."""
    cpu_native.attend(batch, query, k_cache, v_cache, scale, out)


def lora_order(slots: torch.Tensor) -> torch.Tensor:
    """The rows that have an adapter (slot >= 0), those of each adapter together, as the
    kernel takes them (int32): the kernel computes an adapter's rows as blocks, reading the
    adapter's B once a block."""
    rows = torch.nonzero(slots >= 0).squeeze(1)
    return rows[torch.argsort(slots[rows], stable=True)].to(torch.int32)


def lora_add(
    x: torch.Tensor,
    y: torch.Tensor,
    slots_ptr: int,
    order: torch.Tensor,
    a_ptrs: object,
    b_ptrs: object,
    ranks: object,
    num_threads: int,
) -> None:
    """reference.lora_add_ref's contract, in place on contiguous float32 x and y, for the
    rows `order` names (lora_order of the slots at `slots_ptr`, int32, worked out once per
    pass); the adapters as C arrays by slot (tokentape/lora/layers.py keeps them): pointers
    to each A^T and scaled B^T (NULL: no adapter on this layer), and their ranks."""
    code = _lib().tt_lora_add_f32(
        x.data_ptr(), y.data_ptr(), x.shape[1], y.shape[1], slots_ptr, order.data_ptr(),
        order.numel(), a_ptrs, b_ptrs, ranks, num_threads,
    )  # fmt: skip
    if code:
        raise ValueError("lora_add: an adapter's rank is above 512")


# The layer stack in one call (`cpu/decoder.c`): its arguments, as the C structs lay them out.
class LinearSpec(ctypes.Structure):
    """One linear layer for decoder_layers: its weight packed by MKL (and in two column
    parts, or none), its shape [n, k] and its bias (0: none); pointers as integers."""

    _fields_ = [
        ("whole", ctypes.c_void_p),
        ("parts", ctypes.c_void_p * 2),
        ("first_column", ctypes.c_int64 * 3),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


class LayerSpec(ctypes.Structure):
    """One decoder layer for decoder_layers: its linear layers, its norms' weights (the
    next layer's input norm, or the final norm, as `next_norm`; q/k norms 0 without), and
    its KV cache."""

    _fields_ = [(name, LinearSpec) for name in LINEAR_NAMES] + [
        (name, ctypes.c_void_p)
        for name in ("post_norm", "next_norm", "q_norm", "k_norm", "k_cache", "v_cache")
    ]


class _PassSpec(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in (
            "rows", "tokens", "hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim",
            "mlp_row_chunk",
        )),
        ("rms_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in (
            "cos_table", "sin_table", "positions", "cu_seqlens_q", "seq_lens", "block_tables",
            "slots",
        )),
        *((name, ctypes.c_int64) for name in (
            "num_seqs", "max_blocks", "num_blocks", "block_size",
        )),
        ("num_threads", ctypes.c_int),
        ("helper", ctypes.c_void_p),
        ("compute", ctypes.c_void_p),
        ("split_min_rows", ctypes.c_int64),
    ]  # fmt: skip


_LAYERS_UNSUPPORTED, _LAYERS_BAD_SLOT = 5, 6


@dataclass(frozen=True, slots=True)
class StackShape:
    """What decoder_layers needs of the model's config."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    scale: float
    mlp_row_chunk: int


def decoder_layers(
    batch: cpu_native.CpuBatch,
    layers: ctypes.Array[LayerSpec],
    shape: StackShape,
    first_norm: torch.Tensor,
    residual: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    num_tokens: int,
    kv_blocks: tuple[int, int],
    compute: int,
    split_min_rows: int,
    scratch: ThreadScratch | None = None,
) -> torch.Tensor | None:
    """The residual stream [rows, hidden] (contiguous; rows past `num_tokens` are row
    padding) through every layer of `layers` in one call, updated in place; returns the final
    norm of it, or None where the kernels leave these shapes to the caller (nothing done).
    `kv_blocks`: the caches' (num_blocks, block_size).
    The same kernels in the same order as the decoder's fused pass, so the same bits.
    `compute`: MKL's cblas_sgemm_compute; a split weight's parts are shared with the helper
    lent to this thread from `split_min_rows` rows (cpu_matmul). `scratch`: where the pass's
    intermediate rows go, kept between passes (None: made for this call)."""
    assert residual.is_contiguous() and batch.slots is not None
    rows = residual.shape[0]
    spec = _PassSpec(
        rows, num_tokens, shape.hidden, shape.intermediate, shape.num_heads,
        shape.num_kv_heads, shape.head_dim, shape.mlp_row_chunk, shape.rms_eps, shape.scale,
        cos_table.data_ptr(), sin_table.data_ptr(), positions.data_ptr(),
        batch.cu_seqlens_q.data_ptr(), batch.seq_lens.data_ptr(), batch.block_tables.data_ptr(),
        batch.slots.data_ptr(), batch.seq_lens.shape[0], batch.block_tables.shape[1],
        *kv_blocks, batch.num_threads, batch.helper, compute,
        split_min_rows,
    )  # fmt: skip
    out = torch.empty_like(residual)
    lib = _lib()
    floats = lib.tt_decoder_work_floats(ctypes.byref(spec))
    work = torch.empty(floats) if scratch is None else scratch.floats("decoder_layers", floats)
    code = lib.tt_decoder_layers_f32(
        ctypes.byref(spec),
        layers,
        len(layers),
        first_norm.data_ptr(),
        residual.data_ptr(),
        out.data_ptr(),
        work.data_ptr(),
        ctypes.byref(batch.bad),
    )
    if code == _LAYERS_UNSUPPORTED:
        return None
    if code == _LAYERS_BAD_SLOT:
        raise cpu_native.bad_slot(batch.slots, batch.bad.value, kv_blocks[0] * kv_blocks[1])
    cpu_native.raise_for(code, batch.bad)
    return out
