"""The engine core, as vLLM V1's `vllm/v1/engine/core*`: `EngineCore` (the loop: schedule,
execute, fold the frame, emit the deltas), `EngineCoreProc` (an EngineCore served over its
client's messages, in its own process or in the front end's event loop), their msgspec
messages and AsyncLLM's clients (ZMQ or in-process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokentape.engine.core.engine_core import EngineCore
    from tokentape.engine.core.engine_core_proc import EngineCoreProc

__all__ = ["EngineCore", "EngineCoreProc"]


def __getattr__(name: str) -> Any:
    # Imported when asked for: the clients and messages in this package stay free of torch,
    # and the engine factory (which EngineCoreProc uses) can import EngineCore's module.
    if name == "EngineCore":
        from tokentape.engine.core.engine_core import EngineCore

        return EngineCore
    if name == "EngineCoreProc":
        from tokentape.engine.core.engine_core_proc import EngineCoreProc

        return EngineCoreProc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
