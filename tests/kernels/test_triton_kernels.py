"""The Triton kernels under the interpreter (TRITON_INTERPRET=1, see kernel_cases) on the CPU,
against the torch references, with tiny shapes."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import PAD_BLOCK, PagedCase, count_calls, make_case, naive_attention

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "interpreter off (CUDA present): gpu_check.py tests the kernels", allow_module_level=True
    )

from tokentape.kernels import paged_attention
from tokentape.kernels.reference import paged_attention_ref, write_kv_cache_ref
from tokentape.kernels.triton_decode import MIN_SPLIT_TOKENS, paged_decode_triton
from tokentape.kernels.triton_kv_write import write_kv_cache_triton
from tokentape.kernels.triton_prefill import paged_prefill_triton

# (seq_len, q_len). Decodes: a 3-block prefix, a one-token context, a context long enough to
# span several decode splits, a last block holding one token.
DECODES = [(11, 1), (1, 1), (600, 1), (17, 1)]
# Prefill chunks and decodes mixed: a whole prompt, a chunk after a cached prefix longer than
# one block, a decode, a chunk ending mid-block, a chunk spanning several query tiles.
MIXED = [(6, 6), (13, 5), (11, 1), (9, 3), (150, 70)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def reference_of(case: PagedCase) -> torch.Tensor:
    """The reference on the same (possibly low-precision) inputs, in float32."""
    return paged_attention_ref(
        case.query.float(), case.k_cache.float(), case.v_cache.float(), **case.attention_kwargs()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_write_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 16
    # key and value are views into one fused projection, as a model produces them.
    kv = torch.randn(6, 2 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = kv[:, : num_kv_heads * head_dim].view(6, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim :].view(6, num_kv_heads, head_dim)
    slots = torch.tensor([17, -1, 3, 4, -1, 19])
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)]
    caches.append(torch.randn(caches[0].shape, generator=gen).to(dtype))
    expected = [c.clone() for c in caches]
    write_kv_cache_ref(key, value, expected[0], expected[1], slots)
    write_kv_cache_triton(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,dtype",
    [(4, 4, torch.float32), (4, 2, torch.float32), (6, 2, torch.float32), (8, 2, torch.bfloat16)],
)
def test_decode_kernel_matches_reference(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    case = make_case(
        DECODES,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=8,
        dtype=dtype,
    )
    out = paged_decode_triton(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), reference_of(case), rtol=tol, atol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), naive_attention(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,dtype",
    [(4, 4, torch.float32), (4, 2, torch.float32), (6, 2, torch.float32), (4, 2, torch.float16)],
)
def test_prefill_kernel_matches_reference(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    case = make_case(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=4,
        dtype=dtype,
    )
    out = paged_prefill_triton(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), reference_of(case), rtol=tol, atol=tol)


def test_triton_kernels_are_batch_invariant() -> None:
    """A sequence alone gives the same bits as in a batch, through either kernel."""
    for seqs, kernel in ((DECODES, paged_decode_triton), (MIXED[:3], paged_prefill_triton)):
        case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=5)
        batched = kernel(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
        cu = case.cu_seqlens_q.tolist()
        for index in range(len(seqs)):
            alone = case.select(index)
            out = kernel(alone.query, alone.k_cache, alone.v_cache, **alone.attention_kwargs())
            assert torch.equal(out, batched[cu[index] : cu[index + 1]]), (kernel, index)


def test_decode_single_split_equals_merged_splits() -> None:
    """A short block table runs one split that writes the output itself; the same sequences
    with the table padded to several splits go through the merge: the same bits."""
    case = make_case(
        DECODES[:2] + DECODES[3:], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8
    )
    assert case.block_tables.shape[1] * 8 <= MIN_SPLIT_TOKENS  # a single split
    single = paged_decode_triton(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    wide = torch.full((case.block_tables.shape[0], 100), PAD_BLOCK, dtype=torch.int32)
    wide[:, : case.block_tables.shape[1]] = case.block_tables
    kwargs = {**case.attention_kwargs(), "block_tables": wide}  # 800 tokens: 4 splits
    merged = paged_decode_triton(case.query, case.k_cache, case.v_cache, **kwargs)
    assert torch.equal(single, merged)


def test_dispatch_to_triton_picks_decode_or_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokentape.kernels.triton_decode as decode_module

    calls = count_calls(monkeypatch, decode_module, "paged_decode_triton")
    for seqs, expect_decode in ((DECODES[:2], True), (MIXED[:2], False)):
        calls.clear()
        case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
        out = paged_attention(
            case.query, case.k_cache, case.v_cache, **case.attention_kwargs(), backend="triton"
        )
        assert bool(calls) == expect_decode
        torch.testing.assert_close(out.double(), naive_attention(case), rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    seqs=st.lists(
        st.integers(1, 80).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
        min_size=1,
        max_size=4,
    ),
    group=st.sampled_from([1, 2, 3, 4]),
    num_kv_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([16, 24]),  # 24: the kernels pad head_dim to a power of two
    block_size=st.sampled_from([1, 3, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_kernels_property(
    seqs: list[tuple[int, int]],
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int,
) -> None:
    """Random ragged batches: the prefill kernel, and the decode kernel on the same contexts."""

    def case_of(seqs: list[tuple[int, int]]) -> PagedCase:
        return make_case(
            seqs,
            num_heads=group * num_kv_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            seed=seed,
        )

    case = case_of(seqs)
    out = paged_prefill_triton(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=1e-5, atol=1e-5)
    case = case_of([(seq_len, 1) for seq_len, _ in seqs])
    out = paged_decode_triton(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=1e-5, atol=1e-5)
