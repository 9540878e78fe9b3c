"""The CPU's float32 matmul for the model's linear layers, `x @ weight.T + bias`, each weight
packed once into the layout its library computes from.

Three libraries can do it, all in exact float32:
- `mkl`: MKL's packed GEMM (`cblas_sgemm_pack` once, `cblas_sgemm_compute` per call), from the
  MKL that torch links in. On an Intel CPU the fastest at every shape the built-in models have,
  with a fraction of oneDNN's fixed cost per call, and a row's result does not depend on how
  many rows the call has (docs/benchmarks-history.md, "Measurements that shaped the
  code").
- `onednn`: oneDNN's linear on its blocked weight layout (`torch.ops.mkldnn`). MKL runs its
  AVX2 code on other vendors' CPUs, where oneDNN uses AVX-512.
- `torch`: `F.linear` on the plain weight, where neither is there.

BACKEND is chosen once per process, so a process always computes the same bits: the
environment's `TOKENTAPE_CPU_MATMUL` (`mkl`, `onednn` or `torch`) where set, else `mkl` on an
Intel CPU, else `onednn`, else `torch`, each only where torch has it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokentape.kernels import cpu_native

# x [rows, in], the weight as the backend reads it (packed, or plain), bias [out] or None.
LinearFn = Callable[[torch.Tensor, Any, "torch.Tensor | None"], torch.Tensor]

# CBLAS's constants (mkl_cblas.h).
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
# The row count MKL packs a weight for: only a hint, every row count computes from the copy.
_PACK_ROWS_HINT = 64


@dataclass(frozen=True, slots=True, eq=False)  # compared by identity: an opaque buffer
class MklWeight:
    """A weight [out, in] packed by MKL: an opaque buffer, and the facts a caller reads; and
    where asked for, the same weight again in parts of its output columns packed apart, so a
    helper thread can compute a part (cpu_native.Helper). A column comes out the same bits
    from its part as from the whole."""

    buffer: torch.Tensor  # uint8
    out_features: int
    in_features: int
    parts: tuple[torch.Tensor, ...] = ()  # uint8 buffers, in column order
    first_columns: array[int] | None = None  # part i: columns [first[i], first[i + 1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    dtype = torch.float32
    device = torch.device("cpu")
    layout = "mkl_packed"


def _load_mkl() -> ctypes.CDLL | None:
    """MKL's packed-GEMM functions, from torch's CPU library where it links MKL in."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        get_size, pack, compute = (
            lib.cblas_sgemm_pack_get_size,
            lib.cblas_sgemm_pack,
            lib.cblas_sgemm_compute,
        )
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    get_size.argtypes, get_size.restype = [i] * 4, ctypes.c_size_t
    pack.argtypes, pack.restype = [i] * 6 + [f, p, i, p], None
    compute.argtypes, compute.restype = [i] * 6 + [p, i, p, i, f, p, i], None
    return lib


_MKL = _load_mkl()
# The compute function's address, for the helper thread's split matmuls (cpu/helper.c).
_MKL_COMPUTE = ctypes.cast(_MKL.cblas_sgemm_compute, ctypes.c_void_p).value if _MKL else None


def mkl_compute_address() -> int | None:
    """The address of MKL's cblas_sgemm_compute, for C that runs the packed matmuls itself
    (kernels/cpu/decoder.c); None without MKL."""
    return _MKL_COMPUTE


def _mkl_pack_buffer(w: torch.Tensor) -> torch.Tensor:
    assert _MKL is not None
    n, k = w.shape
    buffer = torch.empty(
        _MKL.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS_HINT, n, k), dtype=torch.uint8
    )
    _MKL.cblas_sgemm_pack(
        _ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS_HINT, n, k, 1.0, w.data_ptr(), k,
        buffer.data_ptr(),
    )  # fmt: skip
    return buffer


# A weight split for a helper thread: two parts, cut at a multiple of this many columns (a
# whole number of the widest vectors), and none under twice that (nothing to share).
_PART_COLUMNS = 16
# MKL computes a column the same from a part as from the whole weight at every row count
# measured but one: a single row, where it takes another path for some widths (256 x 256
# split at 128 differs in the last bits). So a one-row matmul always reads the whole, and a
# split is kept only where these row counts (MKL's micro-tile edges) come out equal.
SPLIT_MIN_ROWS = 2
_SPLIT_PROBE_ROWS = (2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65)


def _mkl_pack(weight: torch.Tensor, split: bool = False) -> MklWeight:
    w = weight.detach().contiguous()
    n, k = w.shape
    whole = MklWeight(_mkl_pack_buffer(w), n, k)
    if not split or n < 2 * _PART_COLUMNS:
        return whole
    cut = (n // 2 + _PART_COLUMNS // 2) // _PART_COLUMNS * _PART_COLUMNS
    parts = (_mkl_pack_buffer(w[:cut]), _mkl_pack_buffer(w[cut:]))
    first_columns = array("q", (0, cut, n))
    assert _MKL_COMPUTE is not None
    x = torch.randn(_SPLIT_PROBE_ROWS[-1], k, generator=torch.Generator().manual_seed(0))
    for rows in _SPLIT_PROBE_ROWS:
        split_out = torch.empty(rows, n)
        cpu_native.split_sgemm(None, _MKL_COMPUTE, x[:rows], parts, first_columns, split_out)
        if not torch.equal(split_out, _mkl_linear(x[:rows], whole, None)):
            return whole
    return MklWeight(whole.buffer, n, k, parts, first_columns)


def _mkl_linear(
    x: torch.Tensor,
    weight: MklWeight | torch.Tensor,
    bias: torch.Tensor | None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    assert _MKL is not None
    if isinstance(weight, torch.Tensor):  # a weight no one packed: packed for this call
        weight = _mkl_pack(weight)
    x = x.contiguous()
    rows, n, k = x.shape[0], weight.out_features, weight.in_features
    if x.shape[1] != k:
        raise ValueError(f"linear: input has {x.shape[1]} features, the weight takes {k}")
    if into is None:
        out = x.new_empty(rows, n)
    else:
        out = into[:rows]
        if into.dtype != torch.float32 or out.shape != (rows, n) or not out.is_contiguous():
            raise ValueError(f"linear: {tuple(into.shape)} {into.dtype} cannot take [{rows}, {n}]")
    helper = None
    if weight.parts and rows >= SPLIT_MIN_ROWS:
        helper = cpu_native.helper_of_this_thread()
    if helper is not None:
        assert weight.first_columns is not None and _MKL_COMPUTE is not None
        cpu_native.split_sgemm(helper, _MKL_COMPUTE, x, weight.parts, weight.first_columns, out)
    elif rows:
        _MKL.cblas_sgemm_compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, rows, n, k, x.data_ptr(), k, weight.buffer.data_ptr(),
            k, 0.0, out.data_ptr(), n,
        )  # fmt: skip
    return out if bias is None else out.add_(bias)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)


_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)
# The op's one overload, bound once: a call through the overload packet resolves it each time.
_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default if _HAS_ONEDNN else None


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    assert _LINEAR_POINTWISE is not None
    return _LINEAR_POINTWISE(x, weight, bias, "none", [], "")


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    linear: LinearFn
    pack: Callable[[torch.Tensor], Any] | None  # None: it reads the plain weight
    # A packed copy whose matmul a helper thread can share (MklWeight.parts); None: no such.
    pack_split: Callable[[torch.Tensor], Any] | None = None


def available() -> dict[str, Backend]:
    """The backends this torch has, by name."""
    found = {"torch": Backend("torch", F.linear, None)}
    if _HAS_ONEDNN:
        found["onednn"] = Backend("onednn", _onednn_linear, _onednn_pack)
    if _MKL is not None:
        found["mkl"] = Backend(
            "mkl", _mkl_linear, _mkl_pack, functools.partial(_mkl_pack, split=True)
        )
    return found


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), "")
    except OSError:
        return ""


def choose(env: str | None, vendor: str, backends: dict[str, Backend]) -> Backend:
    """The backend for TOKENTAPE_CPU_MATMUL=`env` (None: unset) on a CPU of `vendor`."""
    if env:
        if env not in ("mkl", "onednn", "torch"):
            raise ValueError(f"TOKENTAPE_CPU_MATMUL must be mkl, onednn or torch, got {env!r}")
        if env not in backends:
            raise ValueError(f"TOKENTAPE_CPU_MATMUL={env}: this torch has no {env}")
        return backends[env]
    if vendor == "GenuineIntel" and "mkl" in backends:
        return backends["mkl"]
    return backends.get("onednn", backends["torch"])


BACKEND = choose(os.environ.get("TOKENTAPE_CPU_MATMUL"), _cpu_vendor(), available())


def linear_fn(x: torch.Tensor, into: torch.Tensor | None = None) -> LinearFn:
    """The matmul for inputs like `x`: BACKEND's for 2-D float32 CPU tensors, else torch's.
    `into`: a contiguous float32 buffer of at least [rows, out] that MKL's matmul writes its
    result into (its first rows), where the others return a tensor of their own. A big
    result, a large vocabulary's logits, costs its page faults each time it is made fresh."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        if into is not None and BACKEND.linear is _mkl_linear:
            return functools.partial(_mkl_linear, into=into)
        return BACKEND.linear
    return F.linear


@dataclass(slots=True)
class _Copy:
    """A weight's packed copy, and which weight it was packed from, as it was then."""

    packed: Any  # what the backend's matmul reads
    source: torch.Tensor
    source_ptr: int
    source_version: int

    def is_of(self, w: torch.Tensor) -> bool:
        return (
            self.source is w
            and self.source_ptr == w.data_ptr()
            and not w.is_inference()
            and self.source_version == w._version
        )


class PackedWeight:
    """The packed copy of one weight for BACKEND, kept current: a weight changed in place or
    replaced since it was packed is packed again before the matmul reads it. Empty until
    `pack`, and where there is none to make: a backend that reads the plain weight, a weight
    not float32 on the CPU, or an inference tensor (no version counter tells it changed).
    `split`: packed so that a helper thread can share its matmuls, where the backend can."""

    __slots__ = ("_copy", "split")

    def __init__(self) -> None:
        self._copy: _Copy | None = None
        self.split = False

    @property
    def empty(self) -> bool:
        return self._copy is None

    def pack(self, w: torch.Tensor) -> None:
        packer = (self.split and BACKEND.pack_split) or BACKEND.pack
        if packer is None or w.device.type != "cpu" or w.dtype != torch.float32:
            self._copy = None
        elif w.is_inference():  # no version counter: a change would go unseen
            self._copy = None
        else:
            self._copy = _Copy(packer(w), w, w.data_ptr(), w._version)

    def drop(self) -> None:
        self._copy = None

    def current(self, w: torch.Tensor) -> Any:
        """What the matmul reads for `w` as it is now: the copy where one is kept (packed
        again if `w` changed since), else `w`."""
        copy = self._copy
        if copy is not None and not copy.is_of(w):
            self.pack(w)
            copy = self._copy
        return copy.packed if copy is not None else w

    def packed_as_is(self, w: torch.Tensor) -> Any:
        """The copy if it is `w`'s as `w` is now, else `w` (nothing packed)."""
        copy = self._copy
        return copy.packed if copy is not None and copy.is_of(w) else w
