"""The compiled CPU kernels (`cpu/*.c`: the paged attention of decodes and of prompts (flash
attention), the KV write, the layers' row operations, the helper thread that lends a second
core to one thread's matmuls and decodes; `cpu/vec.h`: their vectors, as wide as the CPU's
registers): built at first use, called through ctypes.

The C source is compiled once per machine with the system C compiler (`$CC`, else `cc`) for
this CPU (`-march=native`) and cached under `$TOKENTAPE_CACHE_DIR`, else
`$XDG_CACHE_HOME/tokentape`, else `~/.cache/tokentape`, keyed by the source, the flags, the
compiler and the CPU; a build takes about a second. It links OpenMP by its soname, so in a
process that has imported torch it shares torch's own OpenMP runtime and thread pool. ctypes
releases the GIL for the call. Where no compiler works, `load()` returns None (with the reason
in `load_error()`) and the engine keeps the torch reference, which is also the kernel's oracle
in the tests.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import weakref
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokentape.kernels.reference import prefill_attention_ref
from tokentape.kernels.shapes import check_kv_write_shapes

# Compiled into one library: the attention and KV write (here), the layers' row operations
# and LoRA's per-row product (cpu_layers.py).
SOURCES = tuple(
    Path(__file__).with_name("cpu") / name
    for name in (
        "paged_attention.c",
        "prefill_attention.c",
        "layers.c",
        "lora.c",
        "helper.c",
        "decoder.c",
    )
)
HEADERS = tuple(
    Path(__file__).with_name("cpu") / name for name in ("vec.h", "helper.h", "kernels.h")
)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")

# The kernel's return codes (TT_* in the C source).
_ERRORS = {
    1: "has more new tokens than its seq_len (or a negative count)",
    2: "needs more blocks than block_tables has columns",
    3: "has a block id outside the cache",
}
_NO_MEMORY = 4
_UNSUPPORTED = 5  # the prefill kernel's: head_dim not a multiple of the CPU's vector width


def cache_dir() -> Path:
    root = os.environ.get("TOKENTAPE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "tokentape"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def build(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The library compiled with `flags` (cached; see the module's docstring). The tests also
    build it for narrower vectors than this CPU's (`-mno-avx512f`, ...), to run the kernels'
    other vector widths on it."""
    sources = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(flags).encode(), version.encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    target = cache_dir() / f"paged_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses each get a whole library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def c_compiler() -> str:
    """The C compiler the kernels are built with: `$CC`, else `cc`."""
    return os.environ.get("CC") or "cc"


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    compiler = c_compiler()
    if shutil.which(compiler) is None:
        return None, f"no C compiler ({compiler!r} not found)"
    try:
        return bind(ctypes.CDLL(str(build(compiler)))), ""
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"the CPU kernel could not be built: {exc}"


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's functions' argument and return types (ctypes calls them)."""
    fn = lib.tt_paged_decode_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    attention = [ptr] * 7 + [i64] * 7 + [ctypes.c_float, ctypes.c_int]
    fn.argtypes = [*attention, ptr, ctypes.POINTER(i64)]  # the decodes' helper, or None
    fn.restype = ctypes.c_int
    lib.tt_paged_prefill_f32.argtypes = [*attention, ctypes.POINTER(i64)]
    lib.tt_paged_prefill_f32.restype = ctypes.c_int
    write = lib.tt_write_kv_f32
    write.argtypes = [ptr] * 5 + [i64] * 3 + [ctypes.POINTER(i64)]
    write.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.tt_add_rms_norm_f32.argtypes = [ptr] * 4 + [i64] * 2 + [f32]
    lib.tt_add_rms_norm_f32.restype = None
    lib.tt_qk_norm_rope_f32.argtypes = [ptr] * 2 + [i64] * 4 + [ptr] * 2 + [f32] + [ptr] * 3
    lib.tt_qk_norm_rope_f32.restype = ctypes.c_int
    lib.tt_silu_mul_f32.argtypes = [ptr] * 3 + [i64]
    lib.tt_silu_mul_f32.restype = None
    lib.tt_lora_add_f32.argtypes = (
        [ptr] * 2 + [i64] * 2 + [ptr] * 2 + [i64] + [ptr] * 3 + [ctypes.c_int]
    )
    lib.tt_lora_add_f32.restype = ctypes.c_int
    lib.tt_helper_start.argtypes, lib.tt_helper_start.restype = [i64], ptr
    lib.tt_helper_stop.argtypes, lib.tt_helper_stop.restype = [ptr], None
    lib.tt_helper_items.argtypes, lib.tt_helper_items.restype = [ptr], i64
    lib.tt_helper_sgemm_f32.argtypes = [ptr] * 3 + [i64] * 2 + [ptr] * 2 + [i64, ptr]
    lib.tt_helper_sgemm_f32.restype = None
    lib.tt_decoder_work_floats.argtypes, lib.tt_decoder_work_floats.restype = [ptr], i64
    lib.tt_decoder_layers_f32.argtypes = [ptr, ptr, i64] + [ptr] * 4 + [ctypes.POINTER(i64)]
    lib.tt_decoder_layers_f32.restype = ctypes.c_int
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None where it cannot be built."""
    return _library()[0]


def load_error() -> str:
    return _library()[1]


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the compiled kernel takes these tensors: float32 on the CPU, caches contiguous."""
    return (
        query.device.type == "cpu"
        and query.dtype == k_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and load() is not None
    )


class Helper:
    """A helper thread (`cpu/helper.c`) that lends a second core to one thread at a time: while
    lent to a thread (`lent_to_this_thread`), that thread's decode attention and its matmuls
    on split weights (cpu_matmul.MklWeight.parts) share their items with it. Between jobs it
    spins for up to `spin_us`, then sleeps until the next. Which thread computes an item
    changes no bit of the results."""

    def __init__(self, spin_us: int = 200) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError(load_error())
        handle = lib.tt_helper_start(spin_us)
        if not handle:
            raise RuntimeError("the CPU kernels' helper thread could not be started")
        self.handle: int = handle
        self._lib = lib
        self._stop = weakref.finalize(self, lib.tt_helper_stop, handle)

    @property
    def items_done(self) -> int:
        """How many items of its callers' jobs the helper has run itself (a diagnostic: a
        helper that is never awake in time leaves every item to its caller)."""
        if not self._stop.alive:
            raise RuntimeError("the helper thread was stopped")
        return int(self._lib.tt_helper_items(self.handle))

    def close(self) -> None:
        """Stop the thread (no job of it may be running)."""
        self._stop()


_lent = threading.local()


@contextmanager
def lent_to_this_thread(helper: Helper | None) -> Iterator[None]:
    """Within it, the calling thread's kernels share their work with `helper` (None: none)."""
    before = getattr(_lent, "helper", None)
    _lent.helper = helper
    try:
        yield
    finally:
        _lent.helper = before


def helper_of_this_thread() -> Helper | None:
    """The helper lent to the calling thread, if any."""
    helper: Helper | None = getattr(_lent, "helper", None)
    return helper


def split_sgemm(
    helper: Helper | None,
    compute: int,
    x: torch.Tensor,
    parts: tuple[Any, ...],
    first_columns: array[int],
    out: torch.Tensor,
) -> None:
    """out = x @ W.T with W's output columns packed by MKL in `parts` (part i holds columns
    first_columns[i] up to first_columns[i + 1]), the parts shared with `helper`; `compute`
    is MKL's cblas_sgemm_compute. x and out contiguous float32."""
    lib = load()
    assert lib is not None, load_error()
    pointers = (ctypes.c_void_p * len(parts))(*(part.data_ptr() for part in parts))
    columns_ptr, _ = first_columns.buffer_info()
    lib.tt_helper_sgemm_f32(
        helper.handle if helper is not None else None,
        compute,
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        pointers,
        columns_ptr,
        len(parts),
        out.data_ptr(),
    )


@dataclass(slots=True)
class CpuBatch:
    """A forward pass's batch as the compiled kernels take it, made once per pass and shared
    by every layer's KV write and attention (a decoder makes both calls once per layer): the
    sequences' tensors contiguous in the kernels' dtypes, the thread count, the helper lent
    to the thread, and the kernels' error slot. One per thread: the model's lanes run their
    passes at once."""

    cu_seqlens_q: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32
    block_tables: torch.Tensor  # int32
    slots: torch.Tensor | None  # int64, for write_kv
    num_threads: int
    helper: int | None  # the handle of the Helper lent to the thread (the decodes share)
    bad: ctypes.c_int64  # the index a kernel reports an error at

    @classmethod
    def of(
        cls,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor | None = None,
    ) -> CpuBatch:
        slots = None if slot_mapping is None else slot_mapping.to(torch.int64).contiguous()
        helper = helper_of_this_thread()
        return cls(
            cu_seqlens_q.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(),
            block_tables.to(torch.int32).contiguous(),
            slots,
            torch.get_num_threads(),  # the calling thread's count
            helper.handle if helper is not None else None,
            ctypes.c_int64(-1),
        )


def paged_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention_ref's contract, computed by the compiled kernels on
    `torch.get_num_threads()` threads (the calling thread's count): the decodes by one, whole
    prompts and prefill chunks by the other (flash attention); where the CPU's vectors do
    not divide head_dim, the prompts by the reference's matmuls (`prefill_attention_ref`).
    Written into `out` (contiguous, the query's shape) where given."""
    batch = CpuBatch.of(cu_seqlens_q, seq_lens, block_tables)
    return attend(batch, query, k_cache, v_cache.contiguous(), scale, out)


def attend(
    batch: CpuBatch,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention_cpu over a batch already in the kernels' form (the caches contiguous)."""
    lib = load()
    assert lib is not None, load_error()
    query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    lens, tables = batch.seq_lens, batch.block_tables
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    args = (
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        batch.cu_seqlens_q.data_ptr(),
        lens.data_ptr(),
        tables.data_ptr(),
        lens.shape[0],
        tables.shape[1],
        num_blocks,
        query.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        batch.num_threads,
    )
    _check(lib.tt_paged_decode_f32, (*args, batch.helper), batch.bad)
    if query.shape[0] > lens.shape[0]:  # some sequence has more than one new token
        if _check(lib.tt_paged_prefill_f32, args, batch.bad) == _UNSUPPORTED:
            prefill_attention_ref(
                query,
                k_cache,
                v_cache,
                out,
                cu_seqlens_q=batch.cu_seqlens_q,
                seq_lens=lens,
                block_tables=tables,
                scale=scale,
            )
    return out


def _check(kernel: Any, args: tuple[Any, ...], bad: ctypes.c_int64) -> int:
    """Run an attention kernel; its return code, once it is 0 or _UNSUPPORTED."""
    code: int = kernel(*args, ctypes.byref(bad))
    if code != _UNSUPPORTED:
        raise_for(code, bad)
    return code


def raise_for(code: int, bad: ctypes.c_int64) -> None:
    """Raise the error an attention kernel's return code stands for (none for 0)."""
    if code == _NO_MEMORY:
        raise MemoryError("paged attention: no working memory for the score buffers")
    if code:
        raise ValueError(f"paged attention: sequence {bad.value} {_ERRORS[code]}")


def bad_slot(slots: torch.Tensor, token: int, num_slots: int) -> ValueError:
    """The KV write's error for `token`, whose slot is outside the cache's `num_slots`."""
    return ValueError(
        f"KV write: token {token}'s slot {slots[token].item()} is outside the cache "
        f"(0..{num_slots - 1}, or -1 to skip)"
    )


def write_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """write_kv_cache_ref's contract (a slot of -1 is skipped), as row copies in C."""
    # Checked as given: converted first, a float slot_mapping would pass as integers.
    check_kv_write_shapes(key, value, k_cache, v_cache, slot_mapping)
    write_kv(key, value, k_cache, v_cache, slot_mapping.to(torch.int64).contiguous())


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    bad: ctypes.c_int64 | None = None,
) -> None:
    """write_kv_cache_cpu with `slots` already contiguous int64, as a CpuBatch holds them;
    `bad` takes the index of an error."""
    lib = load()
    assert lib is not None, load_error()
    check_kv_write_shapes(key, value, k_cache, v_cache, slots)
    key, value = key.contiguous(), value.contiguous()
    num_blocks, block_size = k_cache.shape[:2]
    bad = bad if bad is not None else ctypes.c_int64(-1)
    code = lib.tt_write_kv_f32(
        key.data_ptr(),
        value.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        slots.shape[0],
        k_cache[0, 0].numel(),
        num_blocks * block_size,
        ctypes.byref(bad),
    )
    if code:
        raise bad_slot(slots, bad.value, num_blocks * block_size)
