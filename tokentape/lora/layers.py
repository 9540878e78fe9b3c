"""LoRA on the decoder's linear layers: each layer an adapter may change holds the adapters'
weights by slot (`LoRASlots`), and a forward pass adds `(x A^T) B^T * scaling` to the rows of
the requests that run with an adapter (`LoRABatch`: the slot of every row).

A batch may mix adapters and rows with none: on the CPU in float32 one compiled call per
layer does every row (kernels/cpu/lora.c, row by row, so a row's result never depends on its
batch), elsewhere a gather, two matmuls and a scatter per adapter in the batch
(kernels/reference.py). A pass whose requests run with no adapter gets no LoRABatch and
costs nothing more.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from tokentape.kernels import cpu_layers, cpu_native
from tokentape.kernels.reference import lora_add_ref


@dataclass(slots=True)
class LoRABatch:
    """The adapter slot of each row of one forward pass (-1: none), int32 on its device,
    and what the layers' products need of it, worked out once per pass."""

    slots: torch.Tensor
    num_threads: int = 1  # the threads the compiled product may use (the lane's)
    # float32 on the CPU with the compiled kernels: one C call per layer (else torch's ops).
    compiled: bool = field(init=False)
    num_rows: int = field(init=False)
    slots_ptr: int = field(init=False)
    order: torch.Tensor | None = field(init=False)  # the compiled kernel's (lora_order)

    def __post_init__(self) -> None:
        self.compiled = self.slots.device.type == "cpu" and cpu_native.load() is not None
        self.num_rows = self.slots.numel()
        self.slots_ptr = self.slots.data_ptr()
        self.order = cpu_layers.lora_order(self.slots) if self.compiled else None

    def rows(self, start: int, end: int) -> LoRABatch:
        """The batch of rows [start, end) (the MLP's chunks of a long prefill)."""
        return LoRABatch(self.slots[start:end], self.num_threads)


class LoRASlots:
    """One linear layer's LoRA weights, by slot of the runner's adapter table: A transposed
    [in, r] and B transposed [r, out] times the adapter's scaling, in the layer's dtype and
    on its device, or None where the adapter leaves the layer alone. Changed only between
    steps (the runner's worker thread), read by every pass."""

    def __init__(self, capacity: int, in_features: int, out_features: int) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.a: list[torch.Tensor | None] = [None] * capacity
        self.b: list[torch.Tensor | None] = [None] * capacity
        # The same, as the C arrays the compiled product reads.
        self._a_ptrs = (ctypes.c_void_p * capacity)()
        self._b_ptrs = (ctypes.c_void_p * capacity)()
        self._ranks = (ctypes.c_int32 * capacity)()
        self.num_set = 0

    def set(self, slot: int, a_t: torch.Tensor, b_t: torch.Tensor) -> None:
        self.clear(slot)
        a_t, b_t = a_t.contiguous(), b_t.contiguous()
        self.a[slot], self.b[slot] = a_t, b_t
        self._a_ptrs[slot], self._b_ptrs[slot] = a_t.data_ptr(), b_t.data_ptr()
        self._ranks[slot] = a_t.shape[1]
        self.num_set += 1

    def clear(self, slot: int) -> None:
        if self.a[slot] is None:
            return
        self.a[slot] = self.b[slot] = None
        self._a_ptrs[slot] = self._b_ptrs[slot] = None
        self._ranks[slot] = 0
        self.num_set -= 1

    def apply(self, x: torch.Tensor, y: torch.Tensor, lora: LoRABatch) -> None:
        """y += each row's adapter product, in place (x [rows, in], y [rows, out]); rows past
        the batch's slots (row padding) are left alone."""
        if not self.num_set:
            return
        n = lora.num_rows
        if (
            lora.order is not None
            and x.dtype == torch.float32
            and y.dtype == torch.float32
            and x.is_contiguous()
            and y.is_contiguous()
        ):
            # The kernel reads the rows `order` names: no views of x and y to make.
            cpu_layers.lora_add(
                x, y, lora.slots_ptr, lora.order, self._a_ptrs, self._b_ptrs, self._ranks,
                lora.num_threads,
            )  # fmt: skip
        else:
            lora_add_ref(x[:n], y[:n], lora.slots, self.a, self.b)
