"""The compiled CPU paged attention (decodes in one C kernel, prompts and chunks in another,
flash attention) against its oracle, the torch reference: the same results to float32
rounding, bit-identical for a sequence whatever its batch, thread count and chunking, and
clear errors for inputs that do not fit."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest
import torch
from kernel_cases import make_case, naive_attention

from tokentape.engine.runners.worker import ModelWorker
from tokentape.kernels import cpu_native, paged_attention, resolve_backend
from tokentape.kernels.reference import paged_attention_ref, write_kv_cache_ref

pytestmark = pytest.mark.skipif(
    cpu_native.load() is None, reason=f"no compiled CPU kernel here: {cpu_native.load_error()}"
)

# (seq_len, q_len): decodes (one of a one-token context, one of several blocks), whole prompts
# and chunks after a cached prefix, mixed in one batch.
MIXED = [(11, 1), (6, 6), (13, 5), (1, 1), (9, 3), (150, 70), (600, 1), (40, 33)]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    # Blocks smaller than, equal to and larger than the decode kernel's prefetch distance
    # (PREFETCH_TOKENS: 16), so its look-ahead crosses blocks or stays inside one.
    [
        (4, 2, 64, 16),
        (4, 4, 16, 4),
        (8, 1, 32, 1),
        (16, 8, 128, 16),
        (2, 2, 24, 5),
        (4, 2, 64, 64),
        (2, 1, 32, 128),
    ],
)
def test_matches_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    case = make_case(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    ours = cpu_native.paged_attention_cpu(
        case.query, case.k_cache, case.v_cache, **case.attention_kwargs()
    )
    ref = paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    torch.testing.assert_close(ours, ref, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(ours.double(), naive_attention(case), rtol=1e-5, atol=1e-5)


def test_a_sequence_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count() -> None:
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    results = {}
    for threads in (1, 2):  # run where the engine runs it: a worker thread with its own count
        worker = ModelWorker(threads)
        results[threads] = worker.run(
            lambda: cpu_native.paged_attention_cpu(
                case.query, case.k_cache, case.v_cache, **case.attention_kwargs()
            )
        )
        worker.close()
    assert torch.equal(results[1], results[2])
    cu = case.cu_seqlens_q.tolist()
    for index in range(len(MIXED)):
        alone = case.select(index)
        out = cpu_native.paged_attention_cpu(
            alone.query, alone.k_cache, alone.v_cache, **alone.attention_kwargs()
        )
        assert torch.equal(out, results[1][cu[index] : cu[index + 1]]), index


def test_decodes_shared_with_a_helper_thread_get_the_same_bits() -> None:
    """A helper (cpu/helper.c) lent to the thread takes some of the decodes: every output the
    same bits as on the thread alone, over many jobs back to back, and the helper did take
    part (its spin keeps it awake between them)."""
    seqs = MIXED + [(5 + 37 * i % 300, 1) for i in range(40)]
    case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    worker = ModelWorker(1)
    helper = cpu_native.Helper(spin_us=1_000_000)

    def attend() -> torch.Tensor:
        return cpu_native.paged_attention_cpu(
            case.query, case.k_cache, case.v_cache, **case.attention_kwargs()
        )

    def with_helper() -> list[torch.Tensor]:
        with cpu_native.lent_to_this_thread(helper):
            return [attend() for _ in range(300)]

    try:
        alone = worker.run(attend)
        for out in worker.run(with_helper):
            assert torch.equal(out, alone)
        assert helper.items_done > 0
    finally:
        helper.close()
        worker.close()


def test_a_helper_stops_asleep_or_spinning() -> None:
    for spin_us in (0, 1_000_000):
        helper = cpu_native.Helper(spin_us=spin_us)
        helper.close()
        helper.close()  # a second close does nothing
        with pytest.raises(RuntimeError, match="stopped"):
            _ = helper.items_done


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(4, 2, 64), (16, 8, 128), (8, 1, 64), (12, 4, 32), (4, 2, 48)],
)
def test_long_prompts_and_chunks_match_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Many key tiles and query tiles: whole prompts, a chunk after a long cached prefix,
    groups of 1, 2, 3 and 8 query heads per kv head (3: tiles padded to whole row quads)."""
    seqs = [(300, 300), (500, 200), (70, 1), (129, 129)]
    case = make_case(
        seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16
    )
    ours = cpu_native.paged_attention_cpu(
        case.query, case.k_cache, case.v_cache, **case.attention_kwargs()
    )
    torch.testing.assert_close(ours.double(), naive_attention(case), rtol=1e-5, atol=1e-5)


# The kernels' narrower vectors (vec.h: 8 floats with AVX, 4 without), built for this CPU
# with its wider instructions turned off: CI's AVX-512 machines never run them otherwise.
NARROWER = {"avx2": ("-mno-avx512f",), "sse": ("-mno-avx512f", "-mno-avx2", "-mno-avx")}


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 vector widths"
)
@pytest.mark.parametrize("isa", sorted(NARROWER))
def test_narrower_vectors_match_the_reference(
    isa: str, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("TOKENTAPE_CACHE_DIR", str(tmp_path))
    flags = cpu_native.FLAGS + NARROWER[isa]
    lib = cpu_native.bind(ctypes.CDLL(str(cpu_native.build(cpu_native.c_compiler(), flags))))
    monkeypatch.setattr(cpu_native, "_library", lambda: (lib, ""))
    for heads, seqs in (
        ((4, 2, 64), MIXED),
        ((16, 8, 128), MIXED),
        ((6, 2, 48), [(300, 300), (500, 200), (70, 1)]),
    ):
        num_heads, num_kv_heads, head_dim = heads
        case = make_case(
            seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16
        )
        ours = cpu_native.paged_attention_cpu(
            case.query, case.k_cache, case.v_cache, **case.attention_kwargs()
        )
        torch.testing.assert_close(ours.double(), naive_attention(case), rtol=1e-5, atol=1e-5)


def test_a_prompt_gets_the_same_bits_in_one_chunk_or_several() -> None:
    """Key tiles start at fixed positions and a row reads no key past its own, so cutting a
    prompt into prefill chunks changes nothing of its rows. (A chunk of one token is a
    decode's shape, and goes to the decode kernel: equal to rounding only.)"""
    whole = make_case([(200, 200)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    out = cpu_native.paged_attention_cpu(
        whole.query, whole.k_cache, whole.v_cache, **whole.attention_kwargs()
    )
    for start, end in ((0, 77), (77, 200), (77, 150), (150, 152)):
        chunk = whole.select(0)
        chunk.query = whole.query[start:end].clone()
        chunk.cu_seqlens_q = torch.tensor([0, end - start], dtype=torch.int32)
        chunk.seq_lens = torch.tensor([end], dtype=torch.int32)
        part = cpu_native.paged_attention_cpu(
            chunk.query, chunk.k_cache, chunk.v_cache, **chunk.attention_kwargs()
        )
        assert torch.equal(part, out[start:end]), (start, end)


def test_inputs_that_do_not_fit_are_refused_before_anything_is_read() -> None:
    case = make_case([(11, 1), (9, 3)], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    kwargs = case.attention_kwargs()
    bad_lens = case.seq_lens.clone()
    bad_lens[1] = 2  # 3 new tokens in a context of 2
    with pytest.raises(ValueError, match="sequence 1 has more new tokens than its seq_len"):
        cpu_native.paged_attention_cpu(
            case.query, case.k_cache, case.v_cache, **{**kwargs, "seq_lens": bad_lens}
        )
    bad_table = case.block_tables.clone()
    bad_table[0, 1] = case.k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="sequence 0 has a block id outside the cache"):
        cpu_native.paged_attention_cpu(
            case.query, case.k_cache, case.v_cache, **{**kwargs, "block_tables": bad_table}
        )
    bad_table = case.block_tables.clone()
    bad_table[1, 0] = -1  # in the prompt's table (sequence 1 has 3 new tokens)
    with pytest.raises(ValueError, match="sequence 1 has a block id outside the cache"):
        cpu_native.paged_attention_cpu(
            case.query, case.k_cache, case.v_cache, **{**kwargs, "block_tables": bad_table}
        )
    too_long = case.seq_lens.clone()
    too_long[0] = 4 * case.block_tables.shape[1] + 1
    with pytest.raises(ValueError, match="sequence 0 needs more blocks than block_tables has"):
        cpu_native.paged_attention_cpu(
            case.query, case.k_cache, case.v_cache, **{**kwargs, "seq_lens": too_long}
        )


def test_dispatch_picks_it_for_float32_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENTAPE_KERNELS", raising=False)
    cpu = torch.device("cpu")
    assert resolve_backend(cpu) == "cpu"
    assert resolve_backend(cpu, dtype=torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="takes float32 CPU tensors"):
        resolve_backend(cpu, "cpu", torch.bfloat16)
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    ours = paged_attention(case.query, case.k_cache, case.v_cache, **case.attention_kwargs())
    assert torch.equal(
        ours,
        cpu_native.paged_attention_cpu(
            case.query, case.k_cache, case.v_cache, **case.attention_kwargs()
        ),
    )
    monkeypatch.setenv("TOKENTAPE_KERNELS", "torch")
    assert torch.equal(
        paged_attention(case.query, case.k_cache, case.v_cache, **case.attention_kwargs()),
        paged_attention_ref(case.query, case.k_cache, case.v_cache, **case.attention_kwargs()),
    )


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_out_is_written_in_place_with_the_same_bits(backend: str) -> None:
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    kwargs = {**case.attention_kwargs(), "backend": backend}
    expected = paged_attention(case.query, case.k_cache, case.v_cache, **kwargs)
    # A view into a wider buffer, as the decoder hands it (o_proj's input, padding rows after)
    buffer = torch.full((case.query.shape[0] + 3, *case.query.shape[1:]), float("nan"))
    out = buffer[: case.query.shape[0]]
    returned = paged_attention(case.query, case.k_cache, case.v_cache, out=out, **kwargs)
    assert returned.data_ptr() == out.data_ptr()
    assert torch.equal(out, expected)
    assert buffer[case.query.shape[0] :].isnan().all()  # nothing written past the batch
    with pytest.raises(ValueError, match="out must be a contiguous"):
        paged_attention(case.query, case.k_cache, case.v_cache, out=buffer, **kwargs)


def test_without_a_compiler_the_engine_keeps_the_reference(tmp_path: object) -> None:
    code = (
        "import torch\n"
        "from tokentape.kernels import cpu_native, resolve_backend\n"
        "assert cpu_native.load() is None, 'built without a compiler?'\n"
        "print(cpu_native.load_error())\n"
        "assert resolve_backend(torch.device('cpu')) == 'torch'\n"
    )
    env = {**os.environ, "CC": "no-such-compiler", "TOKENTAPE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "no C compiler ('no-such-compiler' not found)" in done.stdout


def test_the_kv_write_matches_the_reference_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([9, -1, 0, 6, 15])  # -1: not cached
    caches = [torch.randn(4, 4, 2, 8, generator=gen) for _ in range(2)]
    ours = [c.clone() for c in caches]
    write_kv_cache_ref(key, value, *caches, slots)
    cpu_native.write_kv_cache_cpu(key, value, *ours, slots)
    assert torch.equal(ours[0], caches[0]) and torch.equal(ours[1], caches[1])
    before = [c.clone() for c in ours]
    with pytest.raises(ValueError, match="token 1's slot 16 is outside the cache"):
        cpu_native.write_kv_cache_cpu(key[:2], value[:2], *ours, torch.tensor([3, 16]))
    assert torch.equal(ours[0], before[0]) and torch.equal(ours[1], before[1])  # nothing written
    # Checked as given, before the conversion to int64 would make float slots look valid.
    with pytest.raises(ValueError, match="slot_mapping must be an integer tensor"):
        cpu_native.write_kv_cache_cpu(key[:2], value[:2], *ours, torch.tensor([3.0, 4.0]))
    assert torch.equal(ours[0], before[0]) and torch.equal(ours[1], before[1])
