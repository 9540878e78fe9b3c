"""The decoder's row operations as Triton kernels (under the interpreter, see kernel_cases)
against their oracle, the torch modules: float32 to its rounding, float16 with the modules'
intermediate roundings reproduced, and the whole fused pass against the modules' own."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import check_qk_norm_rope, count_calls

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "interpreter off (CUDA present): gpu_check.py tests the kernels", allow_module_level=True
    )

from tokentape.engine.model.decoder import AttentionMetadata
from tokentape.engine.model.layers import MLP, RMSNorm, RotaryEmbedding
from tokentape.engine.model.loader import builtin_model
from tokentape.kernels import fused_ops, triton_layers

GEN = torch.Generator().manual_seed(0)
# float16 (not bfloat16: the interpreter's bfloat16 math is numpy's float32, unrounded).
# Between the kernels and the modules only a row sum's order differs: a few units in the
# last place of float16.
TOLERANCE = {
    torch.float32: {"rtol": 2e-6, "atol": 2e-6},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [64, 100, 7])
def test_rms_norm_and_the_residual_add_match_the_module(dim: int, dtype: torch.dtype) -> None:
    norm = RMSNorm(dim, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(dim))
    x, residual = randn(13, dim, dtype=dtype), randn(13, dim, dtype=dtype)
    with torch.no_grad():
        expected = norm(x)
        torch.testing.assert_close(triton_layers.rms_norm(x, norm.weight, norm.eps), expected)
        expected_residual = residual + x
        out = triton_layers.add_rms_norm(x, residual, norm.weight, norm.eps)
        assert torch.equal(residual, expected_residual)  # added in place, rounded as torch does
        torch.testing.assert_close(out, norm(expected_residual), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norms_and_rope_match_the_modules(qk_norm: bool, dtype: torch.dtype) -> None:
    check_qk_norm_rope(triton_layers, qk_norm, dtype, 32, **TOLERANCE[dtype])


def test_qk_norm_rope_refuses_tables_of_another_width() -> None:
    rope = RotaryEmbedding(16, 8, 10000.0)
    q, k = randn(1, 2, 32), randn(1, 1, 32)
    with pytest.raises(ValueError, match="head size 32"):
        triton_layers.qk_norm_rope(
            q, k, None, None, 1e-6, rope.cos_cached, rope.sin_cached, torch.tensor([0])
        )


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_matches_the_mlp_for_every_magnitude(dtype: torch.dtype) -> None:
    gate = randn(5, 700, dtype=dtype) * 40  # past exp's overflow in both directions
    up = randn(5, 700, dtype=dtype)
    expected = torch.nn.functional.silu(gate).mul_(up)  # the module's order and roundings
    torch.testing.assert_close(triton_layers.silu_mul(gate, up), expected, **TOLERANCE[dtype])


def test_the_mlp_through_the_fused_ops_matches_the_module() -> None:
    mlp = MLP(32, 48)
    x = randn(9, 32)
    with torch.no_grad():
        fused = mlp.forward_fused(x, torch.nn.functional.linear, False, triton_layers)
        torch.testing.assert_close(fused, mlp(x), rtol=2e-5, atol=2e-5)


def _small_batch() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A 6-token prompt and a decode at position 9, on blocks 0-1 and 2-4 of 4 tokens."""
    meta = AttentionMetadata(
        torch.tensor([0, 1, 2, 3, 4, 5, 4 * 4 + 1]),
        torch.tensor([0, 6, 7], dtype=torch.int32),
        torch.tensor([6, 10], dtype=torch.int32),
        torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int32),
    )
    return torch.randint(3, 259, (7,), generator=GEN), torch.tensor([0, 1, 2, 3, 4, 5, 9]), meta


def _decodes() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Two decodes (the split-KV kernel's path), at positions 5 and 9."""
    meta = AttentionMetadata(
        torch.tensor([5, 4 * 4 + 1]),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([6, 10], dtype=torch.int32),
        torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int32),
    )
    return torch.randint(3, 259, (2,), generator=GEN), torch.tensor([5, 9]), meta


@pytest.mark.parametrize("batch", [_small_batch, _decodes], ids=["prefill+decode", "decodes"])
def test_the_fused_pass_through_triton_matches_the_modules(
    batch: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENTAPE_KERNELS", "triton")
    assert fused_ops("triton") is triton_layers
    norms = count_calls(monkeypatch, triton_layers, "add_rms_norm")
    _, model = builtin_model("tiny", 0)
    kv = [(randn(16, 4, 2, 64), randn(16, 4, 2, 64)) for _ in range(len(model.model.layers))]
    kv_copy = [(k.clone(), v.clone()) for k, v in kv]
    ids, positions, meta = batch()  # type: ignore[operator]
    with torch.inference_mode():
        model.fused = True
        fused = model(ids, positions, kv, meta)
        model.fused = False
        reference = model(ids, positions, kv_copy, meta)
    assert len(norms) == 2 * len(model.model.layers)  # the fused pass ran, through Triton
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-5)
    for (k, v), (k_ref, v_ref) in zip(kv, kv_copy):  # the K/V written agree too
        torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-5)
