"""The exceptions that cross layers, in one module at the bottom that imports nothing of
tokentape: a tape that cannot be read or folded, a checkpoint that cannot be loaded, an
engine that failed, a command's expected failure. Each layer raises and catches them without
importing the layer that defines the others' (their old homes re-export them)."""

from __future__ import annotations


class TapeError(Exception):
    """A tape that cannot be read: names the file and the position where reading failed."""

    def __init__(self, path: str | None, message: str, position: int | None = None) -> None:
        self.path = path
        self.message = message
        self.position = position
        where = f" at event {position}" if position is not None else ""
        super().__init__(f"{path or '<memory tape>'}: {message}{where}")


class TapeFormatError(TapeError):
    """The tape was written by a newer format version than this package reads."""


class ReducerError(RuntimeError):
    """An event that cannot follow the state it is applied to: the tape is inconsistent."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and the problem
    (and the tensor or key, where there is one)."""


class EngineDeadError(RuntimeError):
    """The engine failed earlier (the failure is on the tape) and cannot serve any more."""


class CLIError(Exception):
    """A command's expected failure: printed as `error: <message>`, exit status 2."""


class WorkerCallRefused(AttributeError, ValueError):
    """collective_rpc refused before it ran (no such worker method, bad arguments): nothing
    was called or recorded. An AttributeError, as vLLM's, and a ValueError (a bad argument)."""


class LoRAError(ValueError):
    """A LoRA adapter that cannot serve: its folder is missing or damaged, its rank is above
    max_lora_rank, it was trained for another base model, or the engine has no room or no
    LoRA. Raised before anything is recorded; the engine keeps serving the others."""
