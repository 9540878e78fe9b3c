"""ThreadScratch: a buffer per thread and use, kept while it is big enough."""

from __future__ import annotations

import threading

import torch

from tokentape.kernels.scratch import ThreadScratch


def test_a_buffer_is_kept_while_big_enough_and_grows_to_a_power_of_two() -> None:
    scratch = ThreadScratch()
    first = scratch.rows("logits", 5, 3)
    assert first.shape == (8, 3) and first.dtype == torch.float32 and first.is_contiguous()
    first.fill_(7.0)
    again = scratch.rows("logits", 8, 3)
    assert again.data_ptr() == first.data_ptr() and bool((again == 7.0).all())
    grown = scratch.rows("logits", 9, 3)
    assert grown.shape == (16, 3) and grown.data_ptr() != first.data_ptr()
    assert scratch.rows("logits", 1, 4).shape == (1, 4)  # another row size: a new buffer
    assert len(scratch) == 1


def test_uses_and_threads_get_buffers_of_their_own() -> None:
    scratch = ThreadScratch()
    mine = scratch.floats("work", 100)
    assert mine.shape == (100,) and mine.is_contiguous()
    assert scratch.rows("logits", 100, 1).data_ptr() != mine.data_ptr()
    theirs: list[int] = []
    thread = threading.Thread(target=lambda: theirs.append(scratch.floats("work", 100).data_ptr()))
    thread.start()
    thread.join()
    assert theirs[0] != mine.data_ptr()
    assert scratch.floats("work", 64).data_ptr() == mine.data_ptr()
    assert len(scratch) == 3
    scratch.clear()
    assert len(scratch) == 0
