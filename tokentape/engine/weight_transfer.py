"""vLLM's weight transfer engine (`WeightTransferConfig`, `init_weight_transfer_engine`, then
`start_weight_update`, `update_weights(update_info)` per bucket, `finish_weight_update`) with
the transport a CPU has: shared memory on one machine, the backend "shm". vLLM's "nccl"
(broadcast between GPUs) and "ipc" (CUDA IPC handles) need GPUs, and are refused.

The trainer's side, `ShmWeightTransferEngine.trainer_send_weights(iterator, trainer_args)`,
packs the (name, tensor) pairs into buckets of contiguous bytes in a shared-memory block,
every tensor at an offset aligned to 64 bytes. It sends one update_info per bucket,
{"shm_name", "names", "dtype_names", "shapes", "offsets"}, through a callable of the
trainer's or POST /update_weights {"update_info": ...}, and waits for the answer: the engine
has copied the bucket out by then, so the next bucket is written into the same block (fresh
shared memory costs a page fault a page: on a VM, writing it ran at a sixth to an eighth of
the speed of writing it again). The block is unlinked and closed once the last bucket is
answered, or the first refused, or the send failed: none is left behind. As vLLM's, it opens
and finishes nothing: the trainer calls start_weight_update before and finish_weight_update
after.

The engine's side, `ShmWeightTransferEngine.receive_weights(update_info, load)`, checks the
update_info (a bad one is a ValueError naming the field, before anything is recorded),
attaches the block by name, builds tensors that view it (no copy) and hands them to `load`:
the engine core's chunk path, which checks them against the model, copies them into the
transfer's stage and records WeightChunkReceived with their SHA-256s. Then it closes the block
(the trainer unlinks it). One mechanism: the transport only changes how a chunk's tensors
arrive; the pause, the transfer and the tape are the engine core's.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import sys
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

if TYPE_CHECKING:
    import torch

BACKEND = "shm"
GPU_BACKENDS = ("nccl", "ipc")  # vLLM's: refused here
# A bucket's size when the trainer gives none: 512 MiB (qwen3-0.6b in float32 is 6 buckets).
DEFAULT_BUCKET_SIZE_BYTES = 512 * 1024 * 1024
ALIGNMENT = 64  # bytes: every tensor of a bucket starts at a multiple of it (a cache line)
SHM_PREFIX = "tokentape_wt_"  # the trainer's blocks: /dev/shm/tokentape_wt_<pid>_<random>
UPDATE_INFO_FIELDS = ("shm_name", "names", "dtype_names", "shapes", "offsets")
# The dtypes an update_info may name, by vLLM's dtype names (torch's, without "torch.").
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
)
T = TypeVar("T")


class WeightTransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's WeightTransferConfig: the transport of `update_weights(update_info)`. tokentape
    has one, "shm" (shared memory, one machine); vLLM's "nccl" and "ipc" need GPUs."""

    backend: str = BACKEND

    def __post_init__(self) -> None:
        if self.backend in GPU_BACKENDS:
            raise ValueError(
                f"weight_transfer_config: backend {self.backend!r} needs GPUs; this engine "
                f"moves weights through shared memory on one machine: backend {BACKEND!r}"
            )
        if self.backend != BACKEND:
            raise ValueError(
                f"weight_transfer_config: unknown backend {self.backend!r}; the backend is "
                f"{BACKEND!r} (shared memory)"
            )


def weight_transfer_config(value: object) -> WeightTransferConfig | None:
    """EngineConfig's field as given: None, a WeightTransferConfig, or its mapping (JSON, the
    tape header, a config sent to the engine core process)."""
    if value is None or isinstance(value, WeightTransferConfig):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            "weight_transfer_config must be a WeightTransferConfig or a mapping such as "
            f'{{"backend": "shm"}}, got {type(value).__name__}'
        )
    try:
        return msgspec.convert(dict(value), WeightTransferConfig)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if not message.startswith("weight_transfer_config"):
            message = f"weight_transfer_config: {message}"
        raise ValueError(message) from None


def parse_weight_transfer_config(text: str) -> WeightTransferConfig:
    """--weight-transfer-config's JSON, as vLLM's: '{"backend": "shm"}'."""
    try:
        return msgspec.json.decode(text, type=WeightTransferConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(
            f'expected JSON such as \'{{"backend": "shm"}}\', got {text!r}: {exc}'
        ) from None


# -- the update_info ------------------------------------------------------------------------------


def is_update_info(weights: object) -> bool:
    """Whether update_weights's argument is a bucket's update_info rather than a state_dict:
    a mapping with "shm_name" (no model has a tensor of that name)."""
    return isinstance(weights, Mapping) and "shm_name" in weights


@dataclass(frozen=True, slots=True)
class UpdateInfo:
    """An update_info, checked: the block's name and, per tensor, its name, dtype name,
    shape, byte offset and byte size."""

    shm_name: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: list[int]

    def as_dict(self) -> dict[str, Any]:
        """As it travels (msgpack, JSON): plain lists."""
        return {
            "shm_name": self.shm_name,
            "names": self.names,
            "dtype_names": self.dtype_names,
            "shapes": self.shapes,
            "offsets": self.offsets,
        }


def _bad(field: str, why: str) -> ValueError:
    return ValueError(f"update_info.{field}: {why}; nothing was recorded")


def _int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(field, f"expected an integer >= 0, got {type(value).__name__} {value!r:.60}")
    return value


def _list(field: str, value: object, count: int | None) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise _bad(field, f"expected a list, got {type(value).__name__}")
    if count is not None and len(value) != count:
        raise _bad(field, f"holds {len(value)} entries, names holds {count}")
    return list(value)


def check_update_info(update_info: object) -> UpdateInfo:
    """The update_info checked field by field, without the block (its bounds are checked once
    it is attached): a ValueError naming the first bad field."""
    if not isinstance(update_info, Mapping):
        raise ValueError(f"update_info must be a mapping, got {type(update_info).__name__}")
    unknown = sorted(str(k) for k in update_info if k not in UPDATE_INFO_FIELDS)
    if unknown:
        raise _bad(unknown[0], f"unknown field; the fields are {', '.join(UPDATE_INFO_FIELDS)}")
    for field in UPDATE_INFO_FIELDS:
        if field not in update_info:
            raise _bad(field, "missing")
    shm_name = update_info["shm_name"]
    if not isinstance(shm_name, str) or not 0 < len(shm_name) <= 200:
        raise _bad("shm_name", f"expected the block's name, got {shm_name!r:.60}")
    if "/" in shm_name or "\0" in shm_name:
        raise _bad("shm_name", f"a block's name holds no '/' or NUL, got {shm_name!r:.60}")
    names = _list("names", update_info["names"], None)
    if not names:
        raise _bad("names", "the bucket holds no tensors")
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise _bad(f"names[{i}]", f"expected a tensor's name, got {name!r:.60}")
        if name in seen:
            raise _bad(f"names[{i}]", f"{name!r} is named twice")
        seen.add(name)
    count = len(names)
    dtype_names = _list("dtype_names", update_info["dtype_names"], count)
    for i, dtype in enumerate(dtype_names):
        if dtype not in DTYPE_NAMES:
            raise _bad(
                f"dtype_names[{i}]",
                f"unknown dtype {dtype!r:.40} (tensor {names[i]!r}); the dtypes are "
                f"{', '.join(DTYPE_NAMES)}",
            )
    shapes = []
    for i, shape in enumerate(_list("shapes", update_info["shapes"], count)):
        field = f"shapes[{i}]"
        shapes.append([_int(field, d) for d in _list(field, shape, None)])
    offsets = [
        _int(f"offsets[{i}]", off)
        for i, off in enumerate(_list("offsets", update_info["offsets"], count))
    ]
    sizes = _dtype_sizes()
    nbytes = []
    for i, (dtype, shape, off) in enumerate(zip(dtype_names, shapes, offsets)):
        size = sizes[dtype]
        if off % size:
            raise _bad(
                f"offsets[{i}]",
                f"tensor {names[i]!r} ({dtype}) at byte {off}, not a multiple of its "
                f"element size {size}",
            )
        numel = 1
        for d in shape:
            numel *= d
        nbytes.append(numel * size)
    return UpdateInfo(shm_name, names, list(dtype_names), shapes, offsets, nbytes)


def _dtype_sizes() -> dict[str, int]:
    import torch

    return {name: getattr(torch, name).itemsize for name in DTYPE_NAMES}


# -- shared memory --------------------------------------------------------------------------------


class AttachedBlock:
    """A shared-memory block another process made, attached by name: `buf`, `size`,
    `close()` (a BufferError while a view of `buf` lives, as SharedMemory's). Unlike
    SharedMemory before Python 3.13, it does not register the block with this process's
    resource tracker, which would unlink it (and warn) when this process exits, or fail
    when the process that made it unlinks it: the block is its maker's to unlink."""

    def __init__(self, name: str) -> None:
        self._shm: SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        if sys.version_info >= (3, 13) or os.name == "nt":  # no tracking to avoid there
            kwargs: dict[str, Any] = {"track": False} if sys.version_info >= (3, 13) else {}
            self._shm = SharedMemory(name=name, **kwargs)
            self.buf, self.size = _buf(self._shm), self._shm.size
            return
        import _posixshmem  # SharedMemory's own way in, without the tracker

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            if not self.size:
                raise _bad("shm_name", f"the block {name!r} is empty")
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            return
        self.buf.release()  # BufferError while a view lives: the mapping stays
        if self._mmap is not None:
            self._mmap.close()


def _buf(shm: SharedMemory) -> memoryview:
    buf = shm.buf
    assert buf is not None  # None only once closed
    return buf


def _close(shm: SharedMemory | AttachedBlock, lingering: list[Any] | None = None) -> None:
    """Close a block. One still viewed (a tensor kept alive somewhere) cannot be unmapped
    yet: it is kept in `lingering`, to be closed later (its memory goes with the last view)."""
    try:
        shm.close()
    except BufferError:
        if lingering is not None:
            lingering.append(shm)


class ShmWeightTransferEngine:
    """The "shm" backend: the engine's side (`init_transfer_engine`, `receive_weights`) and,
    as a static method, the trainer's (`trainer_send_weights`)."""

    def __init__(self, config: WeightTransferConfig) -> None:
        self.config = config
        self.initialized = False
        self._lingering: list[AttachedBlock] = []  # closed once nothing views them

    # -- the engine's side ------------------------------------------------------------------

    def init_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        """vLLM's init_weight_transfer_engine, once before the training loop: for "shm", the
        init_info names nothing but, optionally, the backend; the engine checks that it can
        make and attach a shared-memory block."""
        if not isinstance(init_info, Mapping):
            raise ValueError(f"init_info must be a mapping, got {type(init_info).__name__}")
        unknown = sorted(str(k) for k in init_info if k != "backend")
        if unknown:
            raise ValueError(
                f"init_info.{unknown[0]}: unknown field; the shm backend takes only 'backend'"
            )
        backend = init_info.get("backend", self.config.backend)
        if backend != self.config.backend:
            raise ValueError(
                f"init_info.backend: {backend!r:.40}, but the engine's weight_transfer_config "
                f"says {self.config.backend!r}"
            )
        name = f"{SHM_PREFIX}probe_{os.getpid()}_{secrets.token_hex(4)}"
        try:
            made = SharedMemory(name=name, create=True, size=ALIGNMENT)
        except OSError as exc:
            raise RuntimeError(
                f"init_weight_transfer_engine: this engine cannot make shared memory: {exc}"
            ) from None
        try:
            _buf(made)[0] = 42
            seen = AttachedBlock(name)
            ok = seen.buf[0] == 42
            seen.close()
        except OSError as exc:
            raise RuntimeError(
                f"init_weight_transfer_engine: this engine cannot attach shared memory: {exc}"
            ) from None
        finally:
            made.close()
            made.unlink()
        if not ok:
            raise RuntimeError("init_weight_transfer_engine: a shared-memory block read back wrong")
        self.initialized = True

    def receive_weights(
        self, update_info: object, load: Callable[[dict[str, torch.Tensor]], T]
    ) -> T:
        """One bucket: its update_info checked (ValueError naming the field), its block
        attached by name and checked to hold every tensor, the tensors built as views of it
        (no copy) and handed to `load` (the engine core's chunk path, which copies them);
        then the block is closed. Returns what `load` returns."""
        import torch

        for shm in self._lingering[:]:  # views of an earlier bucket are gone by now
            self._lingering.remove(shm)
            _close(shm, self._lingering)
        info = check_update_info(update_info)
        try:
            shm = AttachedBlock(info.shm_name)
        except FileNotFoundError:
            raise _bad(
                "shm_name",
                f"no shared-memory block {info.shm_name!r} on this machine (unlinked already, "
                "or the trainer runs on another machine)",
            ) from None
        except OSError as exc:
            raise _bad("shm_name", f"cannot attach {info.shm_name!r}: {exc.strerror}") from None
        try:
            size = shm.size
            for i, (off, n) in enumerate(zip(info.offsets, info.nbytes)):
                if off + n > size:
                    raise _bad(
                        f"offsets[{i}]",
                        f"tensor {info.names[i]!r} ({n} bytes at byte {off}) ends past the "
                        f"block's {size} bytes",
                    )
            views: dict[str, torch.Tensor] = {}
            for name, dtype_name, shape, off, n in zip(
                info.names, info.dtype_names, info.shapes, info.offsets, info.nbytes
            ):
                dtype = getattr(torch, dtype_name)
                if n:  # no local keeps a view: the views dict holds them all
                    views[name] = torch.frombuffer(
                        shm.buf, dtype=dtype, count=n // dtype.itemsize, offset=off
                    ).view(shape)
                else:
                    views[name] = torch.empty(shape, dtype=dtype)
            try:
                return load(views)
            except BaseException as exc:
                # The failure's traceback holds the views (the loader's locals): cleared, so
                # the block can be closed now (it would otherwise linger until they go).
                views.clear()
                traceback.clear_frames(exc.__traceback__)
                raise
            finally:
                views.clear()
                del views
        finally:
            _close(shm, self._lingering)

    # -- the trainer's side -----------------------------------------------------------------

    @staticmethod
    def trainer_send_weights(
        iterator: Iterable[tuple[str, torch.Tensor]], trainer_args: ShmTrainerSendWeightsArgs
    ) -> None:
        """Send (name, tensor) pairs (a model's `named_parameters()`, a state_dict's items) in
        buckets of at most `trainer_args.bucket_size_bytes` (a larger tensor goes alone),
        each written into the shared-memory block (one, made for the first bucket, made
        again larger for a larger one), its update_info sent and answered. The block is
        unlinked at the end. A refused bucket raises (the block is gone; the engine recorded
        nothing of that bucket, and the transfer stays open). Call start_weight_update
        before, and finish_weight_update after, as vLLM's trainer does."""
        if not isinstance(trainer_args, ShmTrainerSendWeightsArgs):
            raise TypeError(
                "trainer_args must be a ShmTrainerSendWeightsArgs, got "
                f"{type(trainer_args).__name__}"
            )
        block: SharedMemory | None = None
        try:
            for bucket in _buckets(iterator, trainer_args.bucket_size_bytes):
                _, last, off = bucket[-1]
                need = max(off + last.numel() * last.element_size(), 1)
                if block is None or block.size < need:
                    if block is not None:
                        _drop(block)
                        block = None
                    block = SharedMemory(
                        name=f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(8)}",
                        create=True,
                        size=need,
                    )
                _send_bucket(block, bucket, trainer_args)
        finally:
            if block is not None:
                _drop(block)


@dataclass(frozen=True)
class ShmTrainerSendWeightsArgs:
    """How `trainer_send_weights` sends each bucket's update_info (vLLM's
    IPCTrainerSendWeightsArgs, for shared memory). `send_mode`: "http" (POST
    {url}/update_weights {"update_info": ...}, with `api_key` as the server's bearer token
    when it has one) or a callable taking the update_info that returns once the engine has
    taken the bucket (e.g. one that calls AsyncLLM.update_weights and waits, or a Ray actor's
    `ray.get(llm.update_weights.remote(info))`). `bucket_size_bytes`: a bucket's most bytes."""

    send_mode: str | Callable[[dict[str, Any]], Any]
    url: str | None = None
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    api_key: str | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not callable(self.send_mode):
            if self.send_mode != "http":
                raise ValueError(
                    f"send_mode must be 'http' or a callable taking the update_info, got "
                    f"{self.send_mode!r:.40} (for Ray: a callable that calls the actor's "
                    "update_weights and waits)"
                )
            if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
                raise ValueError(f"send_mode 'http' needs the server's url, got {self.url!r:.60}")
        size = self.bucket_size_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < ALIGNMENT:
            raise ValueError(f"bucket_size_bytes must be an integer >= {ALIGNMENT}, got {size!r}")
        if isinstance(self.timeout_s, bool) or not (
            isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0
        ):
            raise ValueError(f"timeout_s must be a number > 0, got {self.timeout_s!r}")


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


_Bucket = list[tuple[str, Any, int]]  # (name, tensor, byte offset)


def _buckets(iterator: Iterable[tuple[str, Any]], size: int) -> Iterable[_Bucket]:
    """The pairs in buckets of at most `size` bytes (a larger tensor alone), in order."""
    import torch

    bucket: _Bucket = []
    end = 0
    seen: set[str] = set()
    for pair in iterator:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"trainer_send_weights takes (name, tensor) pairs, got {pair!r:.60}")
        name, tensor = pair
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"trainer_send_weights takes (name, tensor) pairs, got ({name!r:.60}, "
                f"{type(tensor).__name__})"
            )
        if name in seen:
            raise ValueError(f"trainer_send_weights: tensor {name!r} is sent twice")
        if str(tensor.dtype).removeprefix("torch.") not in DTYPE_NAMES:
            raise ValueError(f"trainer_send_weights: tensor {name!r} has dtype {tensor.dtype}")
        seen.add(name)
        start = _aligned(end)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and start + nbytes > size:
            yield bucket
            bucket, start = [], 0
        bucket.append((name, tensor, start))
        end = start + nbytes
    if bucket:
        yield bucket


def _send_bucket(block: SharedMemory, bucket: _Bucket, args: ShmTrainerSendWeightsArgs) -> None:
    """Copy a bucket into the block, send its update_info and wait for the answer (the engine
    has copied the tensors out by then: the next bucket may overwrite them)."""
    for _, tensor, start in bucket:
        _write(block, start, tensor)
    info = {
        "shm_name": block.name,
        "names": [n for n, _, _ in bucket],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t, _ in bucket],
        "shapes": [list(t.shape) for _, t, _ in bucket],
        "offsets": [start for _, _, start in bucket],
    }
    if callable(args.send_mode):
        args.send_mode(info)
    else:
        _post(info, args)


def _drop(block: SharedMemory) -> None:
    """Unlink the trainer's block (the name goes now; the memory with the last mapping) and
    close it."""
    with contextlib.suppress(FileNotFoundError):
        block.unlink()
    _close(block)


def _write(shm: SharedMemory, start: int, tensor: Any) -> None:
    """A tensor's bytes into the block at `start` (from any device, any layout)."""
    import torch

    n = tensor.numel() * tensor.element_size()
    if not n:
        return
    src = tensor.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.contiguous().reshape(-1).view(torch.uint8)
    # A temporary view of the block, gone when this returns (torch's copy uses its threads).
    torch.frombuffer(shm.buf, dtype=torch.uint8, count=n, offset=start).copy_(src)


def _post(info: dict[str, Any], args: ShmTrainerSendWeightsArgs) -> None:
    """POST {url}/update_weights {"update_info": info}; a refusal raises with its message."""
    assert args.url is not None  # checked by the args
    headers = {"Content-Type": "application/json"}
    if args.api_key is not None:
        headers["Authorization"] = f"Bearer {args.api_key}"
    request = urllib.request.Request(
        args.url.rstrip("/") + "/update_weights",
        data=json.dumps({"update_info": info}).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body[:500]
        raise RuntimeError(f"/update_weights refused the bucket ({exc.code}): {message}") from None
