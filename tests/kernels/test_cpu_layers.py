"""The compiled row operations of the decoder against their oracle, the torch modules: the
same results to float32 rounding, row by row whatever the batch, and the whole fused forward
pass against the modules' own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import check_qk_norm_rope, count_calls

from tokentape.engine.model import cpu_matmul
from tokentape.engine.model import decoder as decoder_module
from tokentape.engine.model import layers as layers_module
from tokentape.engine.model.decoder import AttentionMetadata, CausalLM
from tokentape.engine.model.layers import (
    MLP,
    RMSNorm,
    matmul_for,
)
from tokentape.engine.model.loader import BUILTIN_CONFIGS, builtin_model
from tokentape.kernels import cpu_layers, cpu_native

pytestmark = pytest.mark.skipif(
    cpu_native.load() is None, reason=f"no compiled CPU kernels here: {cpu_native.load_error()}"
)
GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


@pytest.mark.parametrize("dim", [64, 256, 100, 7])
def test_rms_norm_and_the_residual_add_match_the_module(dim: int) -> None:
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(dim))
    x, residual = randn(37, dim), randn(37, dim)
    torch.testing.assert_close(cpu_layers.rms_norm(x, norm.weight, norm.eps), norm(x))
    expected_residual = residual + x
    out = cpu_layers.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(residual, expected_residual)  # added in place, exactly
    torch.testing.assert_close(out, norm(expected_residual))
    # Row by row: a row's result is the same alone as in the batch, to the bit.
    assert torch.equal(
        cpu_layers.rms_norm(x[5:6], norm.weight, norm.eps),
        cpu_layers.rms_norm(x, norm.weight, norm.eps)[5:6],
    )


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norms_and_rope_match_the_modules(qk_norm: bool) -> None:
    check_qk_norm_rope(cpu_layers, qk_norm, torch.float32, 64)


def test_silu_mul_matches_the_mlp_for_every_magnitude() -> None:
    mlp = MLP(32, 48)
    x = randn(70, 32) * 40  # gate values far past exp's overflow in both directions
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(cpu_layers.silu_mul(gate, up), expected, rtol=2e-6, atol=1e-6)
    with torch.no_grad():
        fused = mlp.forward_fused(x, *matmul_for(x), cpu_layers)
        torch.testing.assert_close(fused, mlp(x), rtol=2e-5, atol=2e-5)


def _small_batch() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A 6-token prompt and a decode at position 9, on blocks 0-1 and 2-4 of 4 tokens."""
    tables = torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 9])
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 4 * 4 + 1])
    meta = AttentionMetadata(
        slots,
        torch.tensor([0, 6, 7], dtype=torch.int32),
        torch.tensor([6, 10], dtype=torch.int32),
        tables,
    )
    return torch.randint(3, 259, (7,), generator=GEN), positions, meta


def test_the_fused_forward_pass_matches_the_modules() -> None:
    _, model = builtin_model("tiny", 0)
    block_size, num_blocks = 4, 64
    kv = [
        (randn(num_blocks, block_size, 2, 64), randn(num_blocks, block_size, 2, 64))
        for _ in range(len(model.model.layers))
    ]
    kv_copy = [(k.clone(), v.clone()) for k, v in kv]
    ids, positions, meta = _small_batch()
    with torch.inference_mode():
        model.fused = True
        fused = model(ids, positions, kv, meta)
        model.fused = False
        reference = model(ids, positions, kv_copy, meta)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-5)
    for (k, v), (k_ref, v_ref) in zip(kv, kv_copy):  # the K/V written agree too
        torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_the_fused_pass_runs_only_where_the_compiled_kernels_are_chosen(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fused pass calls the compiled attention directly; TOKENTAPE_KERNELS=torch (the
    # reference, for debugging) must still reach every layer's attention.
    monkeypatch.setenv("TOKENTAPE_KERNELS", backend)
    calls = count_calls(monkeypatch, cpu_native, "attend")
    _, model = builtin_model("tiny", 0)
    kv = [(randn(64, 4, 2, 64), randn(64, 4, 2, 64)) for _ in range(len(model.model.layers))]
    ids, positions, meta = _small_batch()
    with torch.inference_mode():
        model(ids, positions, kv, meta)
    assert len(calls) == (len(model.model.layers) if backend == "auto" else 0)


# The layer stack in one call runs MKL's packed matmuls.
NEEDS_MKL = pytest.mark.skipif(
    cpu_matmul.mkl_compute_address() is None, reason="this torch has no MKL"
)


def _packed_model(**changes: object) -> CausalLM:
    """tiny with `changes` to its config, weights drawn at random (norms and biases too, so
    that every operand matters), packed for MKL and split for a helper."""
    config = dataclasses.replace(BUILTIN_CONFIGS["tiny"], **changes)
    model = CausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(randn(*p.shape) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    model.prepack(split=True)
    return model


def _run_both(
    model: CausalLM,
    ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    helper: cpu_native.Helper | None = None,
    num_blocks: int = 64,
) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], tuple[torch.Tensor, list[torch.Tensor]]]:
    """(hidden states, every K/V cache after) of the pass in one call, then layer by layer."""
    c = model.config
    shape = (num_blocks, 4, c.num_key_value_heads, c.head_dim)
    kv = [(randn(*shape), randn(*shape)) for _ in range(c.num_hidden_layers)]
    results = []
    for one_call in (True, False):
        caches = [(k.clone(), v.clone()) for k, v in kv]
        model.layers_in_one_call = one_call
        with torch.inference_mode(), cpu_native.lent_to_this_thread(helper):
            hidden = model(ids, positions, caches, meta)
        results.append((hidden, [t for pair in caches for t in pair]))
    return results[0], results[1]


def _assert_same(
    hidden: torch.Tensor, kv: list[torch.Tensor], want: torch.Tensor, want_kv: list[torch.Tensor]
) -> None:
    """The same hidden states and every K/V cache the same, to the bit."""
    assert torch.equal(hidden, want)
    assert all(torch.equal(a, b) for a, b in zip(kv, want_kv, strict=True))


@NEEDS_MKL
@pytest.mark.parametrize(
    "changes",
    [{}, {"qk_norm": False, "attention_bias": True, "model_type": "qwen2"}],
    ids=["qwen3", "qwen2"],
)
@pytest.mark.parametrize("helped", [False, True])
@pytest.mark.parametrize("pad_rows_to", [0, 8])
def test_the_layer_stack_in_one_call_gives_the_fused_pass_bits(
    changes: dict[str, object], helped: bool, pad_rows_to: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpu/decoder.c runs the fused pass's kernels in its order: the hidden states and every
    K/V written are the same bits as the pass layer by layer from Python (a prompt and a
    decode; with and without row padding; q/k norms or biases; the helper lent or not), and
    the Python pass's attention is not called."""
    model = _packed_model(**changes)
    model.set_batch_invariant(pad_rows_to)
    helper = cpu_native.Helper(spin_us=1_000_000) if helped else None
    try:
        calls = count_calls(monkeypatch, cpu_native, "attend")
        (hidden, kv), (want, want_kv) = _run_both(model, *_small_batch(), helper=helper)
    finally:
        if helper is not None:
            helper.close()
    assert len(calls) == len(model.model.layers)  # the layer-by-layer pass only
    _assert_same(hidden, kv, want, want_kv)


@NEEDS_MKL
def test_the_layer_stack_in_one_call_runs_the_mlp_in_the_same_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decoder_module, "MLP_ROW_CHUNK", 3)
    monkeypatch.setattr(layers_module, "MLP_ROW_CHUNK", 3)
    (hidden, kv), (want, want_kv) = _run_both(_packed_model(), *_small_batch())
    _assert_same(hidden, kv, want, want_kv)


@NEEDS_MKL
def test_the_layer_stack_shares_the_per_row_kernels_of_a_big_step_out_without_a_bit_changed() -> (
    None
):
    """Two prompts of 1,100 tokens and a decode: enough rows that the norms, RoPE and SwiGLU's
    middle run on the pass's threads (cpu/decoder.c), each row cut where one call would
    compute it; the same bits as the pass layer by layer, single-threaded."""
    if torch.get_num_threads() < 2:
        pytest.skip("this process computes on one thread: nothing to share out")
    block_size, prompt, per_seq = 4, 1100, 280  # blocks: 1,100 tokens and the decode's 98
    starts = [0, per_seq, 2 * per_seq]  # each sequence's first block
    tables = torch.tensor([[b + s for b in range(per_seq)] for s in starts], dtype=torch.int32)
    positions = torch.cat([torch.arange(prompt), torch.arange(prompt), torch.tensor([97])])
    slots = torch.cat(
        [
            starts[0] * block_size + torch.arange(prompt),
            starts[1] * block_size + torch.arange(prompt),
            torch.tensor([starts[2] * block_size + 97]),
        ]
    )
    meta = AttentionMetadata(
        slots,
        torch.tensor([0, prompt, 2 * prompt, 2 * prompt + 1], dtype=torch.int32),
        torch.tensor([prompt, prompt, 98], dtype=torch.int32),
        tables,
    )
    ids = torch.randint(3, 259, (2 * prompt + 1,), generator=GEN)
    (hidden, kv), (want, want_kv) = _run_both(
        _packed_model(), ids, positions, meta, num_blocks=3 * per_seq
    )
    _assert_same(hidden, kv, want, want_kv)


@NEEDS_MKL
def test_the_layer_stack_leaves_what_its_kernels_do_not_take_to_the_python_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head size the flash kernel does not take (24) sends a prompt's pass back to Python,
    whose fallback computes it (the same bits either way); a bad slot is refused with the KV
    write's own error."""
    (hidden, _), (want, _) = _run_both(_packed_model(head_dim=24), *_small_batch())
    assert torch.equal(hidden, want)
    ids, positions, meta = _small_batch()
    meta.slot_mapping[3] = 64 * 4  # one past the cache
    model = _packed_model()
    kv = [(randn(64, 4, 2, 64), randn(64, 4, 2, 64)) for _ in range(len(model.model.layers))]
    for one_call in (True, False):
        model.layers_in_one_call = one_call
        with pytest.raises(ValueError, match="token 3's slot 256 is outside the cache"):
            with torch.inference_mode():
                model(ids, positions, kv, meta)
