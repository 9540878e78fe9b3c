"""The torch references (the engine's CPU path) against a dense naive attention."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import PAD_BLOCK, make_case, naive_attention

from tokentape.kernels import (
    cpu_native,
    paged_attention,
    resolve_backend,
    triton_available,
    write_kv_cache,
)
from tokentape.kernels.reference import paged_attention_ref, write_kv_cache_ref

# (seq_len, q_len): a decode with a 3-block prefix, a whole prompt, a chunk after a cached
# prefix longer than one block, a one-token context, a chunk ending mid-block.
MIXED = [(11, 1), (6, 6), (13, 5), (1, 1), (9, 3)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2), (4, 1)])
def test_reference_matches_naive_attention(num_heads: int, num_kv_heads: int) -> None:
    case = make_case(
        MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=8, block_size=4
    )
    out = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    assert out.dtype == torch.float32 and out.shape == case.query.shape
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=1e-5, atol=1e-5)


def test_reference_chunks_long_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunking the new tokens (to bound memory) gives the same attention."""
    from tokentape.kernels import reference

    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    whole = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    monkeypatch.setattr(reference, "SCORE_ELEMENTS_PER_CHUNK", 4 * 13 * 2)  # 2-token chunks
    chunked = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    torch.testing.assert_close(chunked.double(), naive_attention(case), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_returns_query_dtype(dtype: torch.dtype) -> None:
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype)
    out = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=2e-2, atol=2e-2)


def test_reference_is_batch_invariant() -> None:
    """Each sequence alone gives bit-identical results to the same sequence in the batch."""
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=3)
    batched = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    cu = case.cu_seqlens_q.tolist()
    for index in range(len(MIXED)):
        alone = case.select(index)
        out = paged_attention_ref(
            alone.query, alone.k_cache, alone.v_cache, **alone.attention_kwargs()
        )
        assert torch.equal(out, batched[cu[index] : cu[index + 1]]), index


def test_reference_decode_batch_is_batch_invariant() -> None:
    """A batch of decodes only (the engine's steady state, its fastest path): each sequence
    alone, with GQA, odd lengths and contexts of one to several blocks, gives the same bits."""
    decodes = [(n, 1) for n in (1, 3, 4, 5, 17, 31, 64, 9)]
    case = make_case(decodes, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, seed=5)
    batched = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    torch.testing.assert_close(batched.double(), naive_attention(case), rtol=1e-5, atol=1e-5)
    for index in range(len(decodes)):
        alone = case.select(index)
        out = paged_attention_ref(
            alone.query, alone.k_cache, alone.v_cache, **alone.attention_kwargs()
        )
        assert torch.equal(out[0], batched[index]), index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scripted_decode_loop_gives_the_python_functions_bits(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The decode loop runs as TorchScript; run as plain Python it gives the same bits."""
    from tokentape.kernels import reference

    decodes = [(n, 1) for n in (1, 3, 4, 5, 17, 31)]
    case = make_case(decodes, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype)
    scripted = paged_attention_ref(
        case.query, case.k_cache, case.v_cache, **case.attention_kwargs()
    )
    assert isinstance(reference._decode_loop(), torch.jit.ScriptFunction)
    monkeypatch.setattr(reference, "_decode_loop", lambda: reference._attend_decodes)
    plain = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    assert torch.equal(scripted, plain)


def test_a_torch_that_cannot_script_the_loop_runs_it_as_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokentape.kernels import reference

    def refuse(fn: object) -> None:
        raise RuntimeError("torch.jit.script is gone")

    monkeypatch.setattr(torch.jit, "script", refuse)
    reference._decode_loop.cache_clear()
    try:
        assert reference._decode_loop() is reference._attend_decodes
        case = make_case([(5, 1), (9, 1)], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
        out = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
        torch.testing.assert_close(out.double(), naive_attention(case), rtol=1e-5, atol=1e-5)
    finally:
        reference._decode_loop.cache_clear()  # the next caller scripts it again


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(
        st.integers(1, 20).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
        min_size=1,
        max_size=4,
    ),
    group=st.sampled_from([1, 2, 3]),
    num_kv_heads=st.sampled_from([1, 2]),
    block_size=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_reference_property(
    seqs: list[tuple[int, int]], group: int, num_kv_heads: int, block_size: int, seed: int
) -> None:
    case = make_case(
        seqs,
        num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=4,
        block_size=block_size,
        seed=seed,
    )
    out = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=1e-5, atol=1e-5)


def test_write_kv_cache_ref_skips_negative_slots() -> None:
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slots = torch.tensor([9, -1, 0, 6])
    write_kv_cache_ref(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for token, slot in ((0, 9), (2, 0), (3, 6)):
        expected_k[slot // 4, slot % 4] = key[token]
        expected_v[slot // 4, slot % 4] = value[token]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_dispatch_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENTAPE_KERNELS", raising=False)
    monkeypatch.setattr(cpu_native, "load", lambda: None)  # no compiled kernel: the reference
    assert resolve_backend(torch.device("cpu")) == "torch"
    if triton_available() and os.environ.get("TRITON_INTERPRET") == "1":
        assert resolve_backend(torch.device("cpu"), "triton") == "triton"  # interpreter is on
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            resolve_backend(torch.device("cpu"), "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENTAPE_KERNELS", "torch")
    assert resolve_backend(torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        resolve_backend(torch.device("cpu"), "cuda")  # type: ignore[arg-type]
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    out = paged_attention(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=1e-5, atol=1e-5)
    k_cache, v_cache = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    write_kv_cache(torch.ones(1, 2, 8), torch.ones(1, 2, 8), k_cache, v_cache, torch.tensor([5]))
    assert k_cache[1, 1].eq(1).all() and k_cache.sum() == 16


def test_reference_rejects_bad_shapes() -> None:
    case = make_case([(5, 2)], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    kwargs = case.attention_kwargs()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_ref(case.query[:, :3], case.k_cache, case.v_cache, **kwargs)
    with pytest.raises(ValueError, match="num_seqs \\+ 1"):
        paged_attention_ref(
            case.query, case.k_cache, case.v_cache, **{**kwargs, "cu_seqlens_q": case.seq_lens}
        )
    with pytest.raises(ValueError, match="seq_lens must be an integer tensor"):
        paged_attention_ref(
            case.query,
            case.k_cache,
            case.v_cache,
            **{**kwargs, "seq_lens": case.seq_lens.float()},
        )
    with pytest.raises(ValueError, match="slot_mapping must be an integer tensor"):
        write_kv_cache_ref(
            case.dense_k[0], case.dense_v[0], case.k_cache, case.v_cache, torch.zeros(5)
        )
    short_table = case.block_tables[:, :1]
    with pytest.raises(ValueError, match="needs 2 blocks"):
        paged_attention_ref(
            case.query, case.k_cache, case.v_cache, **{**kwargs, "block_tables": short_table}
        )
    assert case.block_tables[0, -1] == PAD_BLOCK
