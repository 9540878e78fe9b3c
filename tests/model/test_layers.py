"""The decoder's building blocks keep Hugging Face's arithmetic bit for bit, whatever they do
in place or in chunks to save memory traffic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokentape.engine.model import cpu_matmul, layers
from tokentape.engine.model.layers import (
    MLP,
    RMSNorm,
    apply_rotary,
    calibrate_batch_invariant_rows,
)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hf_formula_bit_for_bit(dtype: torch.dtype) -> None:
    norm = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(64, seed=1))
    x = _randn(37, 3, 64).to(dtype)
    h = x.float()
    expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert torch.equal(x, _randn(37, 3, 64).to(dtype)), "the input is left alone"


def test_rotary_is_hf_formula_bit_for_bit() -> None:
    q, k = _randn(9, 4, 16, seed=2), _randn(9, 2, 16, seed=3)
    cos, sin = _randn(9, 1, 16, seed=4), _randn(9, 1, 16, seed=5)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)

    q_rot, k_rot = apply_rotary(q, k, cos, sin)
    assert torch.equal(q_rot, q * cos + rotate_half(q) * sin)
    assert torch.equal(k_rot, k * cos + rotate_half(k) * sin)


def test_mlp_chunks_of_rows_give_each_row_its_unchunked_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill-sized batch goes through the MLP in chunks; with the engine's calibrated row
    padding every row comes out as it does in one pass, and as HF's formula gives it."""
    mlp = MLP(32, 96)
    with torch.no_grad():
        for i, p in enumerate(mlp.parameters()):
            p.copy_(_randn(*p.shape, seed=10 + i) * 0.2)
    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    pad = calibrate_batch_invariant_rows([w.detach() for w in weights])
    if pad is None:
        pytest.skip("this machine's matmuls are not batch-invariant at any row padding")
    for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        m.pad_rows_to = pad
    monkeypatch.setattr(layers, "MLP_ROW_CHUNK", 64)
    x = _randn(64 * 3 + 5, 32, seed=6)
    with torch.no_grad():
        chunked = mlp(x)
        monkeypatch.setattr(layers, "MLP_ROW_CHUNK", 10**9)
        whole = mlp(x)
        formula = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert chunked.shape == (x.shape[0], 32)
    assert torch.equal(chunked, whole)
    assert torch.equal(whole, formula)


def test_the_calibrated_row_multiple_is_the_smallest_that_holds() -> None:
    from tokentape.engine.model.layers import ROW_MULTIPLES, _measure_row_multiple, linear

    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(96, 64, generator=gen), torch.randn(200, 96, generator=gen)]
    found = _measure_row_multiple(weights)
    assert found in ROW_MULTIPLES

    def holds(c: int) -> bool:
        for w in weights:
            x = torch.randn(1024, w.shape[1], generator=gen)
            ref = linear(x, w)
            if not all(
                torch.equal(linear(x[:m], w, None, c), ref[:m]) for m in range(1, 2 * c + 2)
            ):
                return False
        return True

    assert holds(found)
    assert not any(holds(c) for c in ROW_MULTIPLES if c < found)


def test_a_prepacked_linear_gives_the_plain_bits_and_follows_its_weight() -> None:
    from tokentape.engine.model.layers import Linear, linear

    for in_f, out_f in ((64, 96), (256, 768), (768, 256)):
        lin = Linear(in_f, out_f, bias=False)
        x = _randn(130, in_f, seed=in_f)
        with torch.inference_mode():
            lin.prepack()
            # From 2 rows: a single row takes oneDNN's matrix-vector path on a plain weight
            # (batch-invariant runs pad to 4 rows or more there, measured on the packed
            # weights). MKL packs a plain weight for the call: the same bits at every count.
            for rows in (2, 3, 4, 16, 63, 64, 65, 130):
                assert torch.equal(lin(x[:rows]), linear(x[:rows], lin.weight))
            with torch.no_grad():
                lin.weight.mul_(-0.5)  # changed in place: packed again before use
            assert torch.equal(lin(x), linear(x, lin.weight))
        lin.weight = torch.nn.Parameter(_randn(out_f, in_f, seed=7))  # replaced
        with torch.inference_mode():
            assert torch.equal(lin(x), linear(x, lin.weight))
            if cpu_matmul.BACKEND.pack is not None:  # the matmul reads the packed copy
                assert not lin.packed_weight.empty and lin.matmul_weight() is not lin.weight
