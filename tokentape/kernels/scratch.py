"""CPU float32 buffers kept from one step to the next, one per thread and use.

A buffer made fresh at every step costs the page faults of its first writes every time, and
in a VM whose host backs a guest page only when it is first written they are dear (about 20
us a 4 KiB page on the 2-vCPU machines this project is measured on). Qwen3-0.6B's prompt
steps of 8,192 tokens each wrote 270 MB of fresh scratch: every step after the first now
faults 16,000 pages, not 105,000. Its LM head wrote 39 MB of fresh logits at every decode
step.

A buffer serves one thread, which finishes with it before its next step (a step's work runs
on the thread that started it). It grows to the next power of two of its rows; only the pages
written are committed (a large `torch.empty` is an anonymous mapping), so the headroom costs
no memory. `clear` frees them all: a sleeping or closed engine's memory.
"""

from __future__ import annotations

import threading

import torch


class ThreadScratch:
    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}

    def rows(self, use: str, rows: int, row_size: int) -> torch.Tensor:
        """The calling thread's buffer for `use`: float32, [at least `rows`, row_size],
        contiguous; what it held before is left as it was."""
        key = (threading.get_ident(), use)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != row_size:
            buffer = torch.empty(1 << max(rows - 1, 0).bit_length(), row_size)
            self._buffers[key] = buffer
        return buffer

    def floats(self, use: str, n: int) -> torch.Tensor:
        """The calling thread's buffer for `use` as `n` floats, one dimension."""
        return self.rows(use, n, 1)[:n].view(-1)

    def clear(self) -> None:
        self._buffers.clear()

    def __len__(self) -> int:
        return len(self._buffers)
