"""The CUDA graph runner's inputs, on the CPU: a decode batch copied into the static tensors
and padded to a capture size gives its rows the hidden states and K/V of the eager pass, and
the padding writes nothing. (The capture and the replay need CUDA: benchmarks/gpu_check.py.)"""

from __future__ import annotations

import pytest
import torch

from tokentape.engine.model.decoder import AttentionMetadata
from tokentape.engine.model.loader import builtin_model
from tokentape.engine.runners.cuda_graphs import CUDAGraphRunner, capture_sizes
from tokentape.engine.runners.input_batch import ForwardBatch

BLOCK_SIZE, NUM_BLOCKS = 4, 64


def decode_batch(contexts: list[int], tables: list[list[int]]) -> ForwardBatch:
    """One new token per sequence, at position context - 1 of its block table."""
    width = max(len(t) for t in tables)
    positions = [c - 1 for c in contexts]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(tables, positions)]
    gen = torch.Generator().manual_seed(len(contexts))
    return ForwardBatch(
        input_ids=torch.randint(3, 259, (len(contexts),), generator=gen),
        positions=torch.tensor(positions),
        meta=AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            cu_seqlens_q=torch.arange(len(contexts) + 1, dtype=torch.int32),
            seq_lens=torch.tensor(contexts, dtype=torch.int32),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
        ),
        sample_rows=torch.arange(len(contexts)),
    )


def test_capture_sizes_are_vllms_up_to_the_first_that_holds_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-3:] == [240, 248, 256]
    assert capture_sizes(10_000)[-1] == 512


@pytest.mark.parametrize("backend", ["auto", "torch"])  # the fused CPU pass; CUDA's modules
def test_a_padded_decode_batch_gives_the_eager_rows_and_writes_no_padding(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENTAPE_KERNELS", backend)
    config, model = builtin_model("tiny", 0)
    gen = torch.Generator().manual_seed(1)
    shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    kv = [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(config.num_hidden_layers)
    ]
    kv_eager = [(k.clone(), v.clone()) for k, v in kv]
    graphs = CUDAGraphRunner(model, max_num_seqs=16, max_blocks_per_seq=8, device=kv[0][0].device)
    # An earlier, wider batch leaves old block ids in the static table's later columns.
    wide = decode_batch(
        [30, 2, 9, 17, 5],
        [[9, 10, 11, 12, 13, 14, 15, 16], [20], [21, 22, 23], [24, 25, 26, 27, 28], [29, 30]],
    )
    batch = decode_batch([7, 1, 12], [[1, 2], [3], [4, 5, 6]])
    assert graphs.fits(batch) and graphs.fits(wide)
    with torch.inference_mode():
        graphs._load_inputs(wide, 5, 8)
        graphs._load_inputs(batch, 3, 4)
        padded = graphs.padded_pass(4, kv)
        eager = model(batch.input_ids, batch.positions, kv_eager, batch.meta)
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(padded).all()  # the padding row attended to one token
    for (k, v), (k_eager, v_eager) in zip(kv, kv_eager):  # the same K/V written, and no more
        assert torch.equal(k, k_eager) and torch.equal(v, v_eager)


def test_a_batch_a_graph_cannot_take_does_not_fit() -> None:
    _, model = builtin_model("tiny", 0)
    graphs = CUDAGraphRunner(
        model, max_num_seqs=4, max_blocks_per_seq=2, device=torch.device("cpu")
    )
    decodes = decode_batch([3, 5], [[0], [1, 2]])
    assert graphs.fits(decodes)
    prefill = ForwardBatch(
        input_ids=torch.tensor([5, 6, 7]),
        positions=torch.tensor([0, 1, 2]),
        meta=AttentionMetadata(
            torch.tensor([0, 1, 2]),
            torch.tensor([0, 3], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            torch.tensor([[0]], dtype=torch.int32),
        ),
        sample_rows=torch.tensor([2]),
    )
    assert not graphs.fits(prefill)  # more than one token for a sequence
    too_many = decode_batch([1] * 5, [[i] for i in range(5)])
    assert not graphs.fits(too_many)  # past the largest size (4)
    too_wide = decode_batch([9], [[0, 1, 2]])
    assert not graphs.fits(too_wide)  # a block table wider than the static one
    with_lora = decode_batch([3], [[0]])
    with_lora.lora_slots = torch.tensor([0], dtype=torch.int32)
    assert not graphs.fits(with_lora)
