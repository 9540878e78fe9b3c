"""The compiled LoRA product (kernels/cpu/lora.c) against its torch reference, and a row's
result independent of its batch."""

from __future__ import annotations

import pytest
import torch

from tokentape.kernels import cpu_native
from tokentape.kernels.reference import lora_add_ref
from tokentape.lora.layers import LoRABatch, LoRASlots

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler")


def _slots(in_features: int, out_features: int, ranks: list[int | None]) -> LoRASlots:
    gen = torch.Generator().manual_seed(0)
    table = LoRASlots(len(ranks), in_features, out_features)
    for slot, r in enumerate(ranks):
        if r is not None:  # None: an adapter that leaves this layer alone
            a = torch.randn(in_features, r, generator=gen)
            b = torch.randn(r, out_features, generator=gen) * 0.1
            table.set(slot, a, b)
    return table


@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_product_matches_the_reference(threads: int) -> None:
    table = _slots(96, 160, [8, None, 16, 64])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 96, generator=gen)
    y = torch.randn(40, 160, generator=gen)
    slots = torch.randint(-1, 4, (40,), generator=gen, dtype=torch.int32)
    want = y.clone()
    lora_add_ref(x, want, slots, table.a, table.b)
    got = y.clone()
    table.apply(x, got, LoRABatch(slots, threads))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = (slots < 0) | (slots == 1)
    assert torch.equal(got[untouched], y[untouched])


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    table = _slots(64, 64, [16, 4])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(33, 64, generator=gen)
    slots = torch.tensor([i % 3 - 1 for i in range(33)], dtype=torch.int32)
    batch = torch.zeros(33, 64)
    table.apply(x, batch, LoRABatch(slots, 2))
    for i in (0, 5, 32):
        alone = torch.zeros(1, 64)
        table.apply(x[i : i + 1].contiguous(), alone, LoRABatch(slots[i : i + 1], 1))
        assert torch.equal(alone[0], batch[i])


def test_padding_rows_past_the_slots_are_left_alone() -> None:
    table = _slots(32, 48, [8])
    x = torch.randn(8, 32)
    y = torch.zeros(8, 48)
    table.apply(x, y, LoRABatch(torch.zeros(5, dtype=torch.int32)))
    assert y[:5].abs().sum() > 0 and torch.equal(y[5:], torch.zeros(3, 48))
