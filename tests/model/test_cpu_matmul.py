"""The CPU's float32 matmul backends (engine/model/cpu_matmul.py): each computes
x @ weight.T + bias, from its packed copy and from the plain weight alike, and the choice of
one per process follows TOKENTAPE_CPU_MATMUL, else the CPU's vendor."""

from __future__ import annotations

import pytest
import torch

from tokentape.engine.model import cpu_matmul
from tokentape.kernels import cpu_native

BACKENDS = cpu_matmul.available()


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_computes_the_linear_layer(name: str) -> None:
    backend = BACKENDS[name]
    for in_f, out_f in ((64, 96), (256, 768), (768, 259)):
        w, b = _randn(out_f, in_f, seed=in_f), _randn(out_f, seed=out_f)
        weight = backend.pack(w) if backend.pack is not None else w
        for rows in (0, 1, 3, 16, 130):
            x = _randn(rows, in_f, seed=rows)
            want = (x.double() @ w.double().T + b.double()).float()
            got = backend.linear(x, weight, b)
            assert got.shape == (rows, out_f)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            # A plain weight gives the packed copy's bits (the copy is only a layout).
            if rows > 1:
                assert torch.equal(backend.linear(x, w, b), got)


def test_a_matmul_into_a_buffer_gives_the_fresh_result_s_bits() -> None:
    backend = cpu_matmul.BACKEND
    w = _randn(300, 64, seed=1)
    weight = backend.pack(w) if backend.pack is not None else w
    buffer = torch.full((8, 300), float("nan"))
    for rows in (1, 5, 8):
        x = _randn(rows, 64, seed=rows)
        got = cpu_matmul.linear_fn(x, buffer)(x, weight, None)
        assert torch.equal(got, backend.linear(x, weight, None))
        # MKL's writes into the buffer's first rows; the others return their own tensor.
        assert (got.data_ptr() == buffer.data_ptr()) == (backend.name == "mkl")


@pytest.mark.skipif(cpu_matmul.BACKEND.name != "mkl", reason="MKL is not the backend")
def test_a_buffer_too_small_or_of_another_width_is_refused() -> None:
    w = cpu_matmul.BACKEND.pack(_randn(300, 64, seed=1))  # type: ignore[misc]
    x = _randn(5, 64, seed=2)
    for buffer in (
        torch.empty(4, 300),
        torch.empty(8, 299),
        torch.empty(8, 300, dtype=torch.float64),
    ):
        with pytest.raises(ValueError, match="cannot take"):
            cpu_matmul.linear_fn(x, buffer)(x, w, None)


@pytest.mark.skipif(
    cpu_matmul.BACKEND.name != "mkl", reason="MKL is not this machine's backend (an Intel CPU's)"
)
def test_mkl_rows_do_not_depend_on_the_batch() -> None:
    """Why a batch-invariant engine pads no rows on an Intel CPU (layers.ROW_MULTIPLES starts
    at 1): MKL's AVX-512 kernels give a row the same bits at any row count. (Elsewhere the
    engine's calibration measures what padding its backend needs.)"""
    mkl = BACKENDS["mkl"]
    w = _randn(768, 256, seed=1)
    packed = mkl.pack(w)  # type: ignore[misc]
    x = _randn(1024, 256, seed=2)
    whole = mkl.linear(x, packed, None)
    for rows in range(1, 70):
        assert torch.equal(mkl.linear(x[:rows], packed, None), whole[:rows]), rows


@pytest.mark.skipif("mkl" not in BACKENDS, reason="this torch has no MKL")
@pytest.mark.skipif(cpu_native.load() is None, reason="no compiled CPU kernels here")
def test_a_matmul_shared_with_a_helper_gives_the_whole_weight_s_bits() -> None:
    """A weight packed for a helper (in two parts of its columns, cpu_native.Helper) gives
    every row the bits of the whole weight, at every row count, the helper lent or not; and
    over many back-to-back calls (the helper spinning between them) no part is lost."""
    mkl = BACKENDS["mkl"]
    assert mkl.pack_split is not None
    helper = cpu_native.Helper(spin_us=1_000_000)
    try:
        for in_f, out_f in ((256, 768), (768, 256), (256, 320), (512, 1024)):
            w = _randn(out_f, in_f, seed=out_f)
            whole, split = mkl.pack(w), mkl.pack_split(w)  # type: ignore[misc]
            assert len(split.parts) == 2
            x = _randn(300, in_f, seed=in_f)
            for rows in (*range(1, 70), 128, 255, 300):
                want = mkl.linear(x[:rows], whole, None)
                assert torch.equal(mkl.linear(x[:rows], split, None), want), rows
                with cpu_native.lent_to_this_thread(helper):
                    assert torch.equal(mkl.linear(x[:rows], split, None), want), rows
        x = _randn(16, 512, seed=3)
        want = mkl.linear(x, whole, None)
        with cpu_native.lent_to_this_thread(helper):
            for _ in range(2_000):
                assert torch.equal(mkl.linear(x, split, None), want)
        assert helper.items_done > 0  # it did take parts
    finally:
        helper.close()


def test_a_small_weight_is_not_split() -> None:
    """Under two parts' worth of columns there is nothing to share: the whole only."""
    if "mkl" not in BACKENDS:
        pytest.skip("this torch has no MKL")
    split = BACKENDS["mkl"].pack_split(_randn(24, 64, seed=0))  # type: ignore[misc]
    assert split.parts == () and split.first_columns is None


def test_the_backend_follows_the_variable_else_the_vendor() -> None:
    everything = {
        n: cpu_matmul.Backend(n, torch.nn.functional.linear, None)
        for n in ("torch", "onednn", "mkl")
    }
    no_mkl = {n: b for n, b in everything.items() if n != "mkl"}
    assert cpu_matmul.choose(None, "GenuineIntel", everything).name == "mkl"
    assert cpu_matmul.choose(None, "AuthenticAMD", everything).name == "onednn"
    assert cpu_matmul.choose(None, "GenuineIntel", no_mkl).name == "onednn"
    assert cpu_matmul.choose(None, "", {"torch": everything["torch"]}).name == "torch"
    assert cpu_matmul.choose("torch", "GenuineIntel", everything).name == "torch"
    assert cpu_matmul.choose("onednn", "GenuineIntel", everything).name == "onednn"
    with pytest.raises(ValueError, match="must be mkl, onednn or torch"):
        cpu_matmul.choose("blas", "GenuineIntel", everything)
    with pytest.raises(ValueError, match="this torch has no mkl"):
        cpu_matmul.choose("mkl", "GenuineIntel", no_mkl)


def test_a_packed_copy_is_made_again_when_its_weight_changes() -> None:
    w = torch.nn.Parameter(_randn(32, 16, seed=3))
    x = _randn(5, 16, seed=4)
    kept = cpu_matmul.PackedWeight()
    assert kept.empty and kept.current(w) is w  # nothing packed yet: the plain weight
    kept.pack(w)
    if cpu_matmul.BACKEND.pack is None:  # this backend reads the plain weight
        assert kept.empty
        return
    first = kept.current(w)
    assert first is not w and kept.current(w) is first and kept.packed_as_is(w) is first
    with torch.no_grad():
        w.mul_(2.0)  # in place: the version counter moves
    assert kept.packed_as_is(w) is w  # stale: not read as it is
    again = kept.current(w)
    assert again is not first
    linear = cpu_matmul.BACKEND.linear
    assert torch.equal(linear(x, again, None), linear(x, w.detach(), None))
    kept.pack(torch.ones(3, 3, dtype=torch.float64))  # none to make for float64
    assert kept.empty
    kept.pack(w)
    kept.drop()
    assert kept.empty
