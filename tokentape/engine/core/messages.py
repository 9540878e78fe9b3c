"""The messages between AsyncLLM (the frontend) and its engine core: msgspec structs, msgpack
on the wire (ZMQ in the background-process mode; passed as they are in the in-process mode).

Frontend to core: `AddRequest`, `AbortRequests`, `UtilityCall`. Core to frontend: `CoreReady`
once (or `CoreFailed` when the engine cannot be built), then `CoreOutputs` after every step or
command, and `CoreDead` if the engine fails. Token outputs are the core's deltas
(`EngineCoreOutput`): the frontend's output processor turns them into RequestOutputs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokentape.engine.outputs import EngineCoreOutput
from tokentape.errors import LoRAError, WorkerCallRefused
from tokentape.events.schema import SamplingParams
from tokentape.events.segment_dir import SegmentedTapeSpec
from tokentape.lora.request import LoRARequest

# -- frontend to core -------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    """A call of an engine method by name (pause_generation, update_weights, sleep, ...); the
    core answers with a UtilityResult of the same call_id."""

    call_id: int
    method: str
    args: list[Any]


CoreRequest = AddRequest | AbortRequests | UtilityCall

# -- core to frontend -------------------------------------------------------------------------


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: tuple[str, str] | None = None  # (exception type name, message)


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    is_paused: bool = False
    step: int = 0
    kv_cache_usage: float = 0.0  # the share of KV blocks in use, 0 to 1 (vLLM's metric)
    num_preemptions: int = 0  # RequestPreempted events so far
    is_sleeping: bool = False  # between EngineSlept and the wake-up that resumes


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    utility: UtilityResult | None = None


class CoreInfo(msgspec.Struct, array_like=True):
    model_id: str
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    tape_path: str | None
    pid: int


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    info: CoreInfo


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    """The engine could not be built (a bad model path, a tape that cannot be created)."""

    error_type: str
    message: str


class CoreDead(msgspec.Struct, tag="dead", array_like=True):
    """The engine failed while serving; the failure is on the tape. Nothing more will come."""

    message: str


CoreMessage = CoreReady | CoreFailed | CoreOutputs | CoreDead

# -- setup of a core process (on its stdin) ---------------------------------------------------


class CoreSetup(msgspec.Struct, array_like=True):
    input_address: str  # the core pulls requests from here
    output_address: str  # and pushes its messages here
    model: str
    tape: str | bool | None | SegmentedTapeSpec
    engine_args: dict[str, Any]
    usage_context: str  # arg_utils.UsageContext's value: the defaults the config takes


# Written on the core's stdin by a frontend that lets its core go without a shutdown call (the
# frontend was garbage-collected or its interpreter exits): the end of stdin that follows is
# then a goodbye. An end of stdin without it means the frontend's process died.
FAREWELL = b"\x00"


request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(CoreRequest)
message_decoder = msgspec.msgpack.Decoder(CoreMessage)
setup_decoder = msgspec.msgpack.Decoder(CoreSetup)

# Errors the frontend raises again by type; any other becomes a RuntimeError naming it.
_ERROR_TYPES: dict[str, type[Exception]] = {
    t.__name__: t
    for t in (
        WorkerCallRefused,  # before its bases: it crosses as itself
        LoRAError,  # before ValueError: it crosses as itself
        ValueError,
        TypeError,
        KeyError,
        RuntimeError,
        FileNotFoundError,
        FileExistsError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
        OSError,
    )
}


def error_of(exc: BaseException) -> tuple[str, str]:
    """The error's name and message for the frontend: a subclass of a type the frontend
    raises again goes as that type (a CheckpointError is a ValueError there), its own name
    kept in the message."""
    message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    name = type(exc).__name__
    base = next((t.__name__ for t in type(exc).__mro__ if t.__name__ in _ERROR_TYPES), None)
    if base is not None and base != name and name != "EngineDeadError":
        return base, f"{name}: {message}"
    return name, message


def rebuild_error(error: tuple[str, str]) -> Exception:
    """The frontend's exception for an error the core reported."""
    name, message = error
    if name == "EngineDeadError":
        from tokentape.errors import EngineDeadError

        return EngineDeadError(message)
    cls = _ERROR_TYPES.get(name)
    return cls(message) if cls is not None else RuntimeError(f"{name}: {message}")
