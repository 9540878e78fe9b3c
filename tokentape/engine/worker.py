"""The worker, as vLLM's `collective_rpc` sees it: what an RL framework's code reaches inside
the engine (`self.model_runner.model`, `load_weights`), with the framework's own class mixed
in (`worker_extension_cls`), as vLLM mixes it into its GPU/CPU worker.

tokentape runs one worker, beside its engine core: `collective_rpc` returns a list of one
result, as vLLM's does with one worker. The call runs on the model runner's thread, after the
steps already handed to it and before any later one (EngineCore.collective_rpc), so the
framework's code never changes the weights under a running step.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from tokentape.engine.runners.base import ModelRunner
from tokentape.errors import WorkerCallRefused


class Worker:
    """vLLM's worker, reduced to what collective_rpc callers use: the model runner (its
    `model` is the torch module, with vLLM's `load_weights`), the device, and the rank of a
    single-worker engine."""

    rank = 0
    local_rank = 0
    world_size = 1

    def __init__(self, model_runner: ModelRunner) -> None:
        self.model_runner = model_runner
        self.device = getattr(model_runner, "device", "cpu")

    def get_model(self) -> Any:
        """The model (vLLM's Worker.get_model); the oracle runs none."""
        model = getattr(self.model_runner, "model", None)
        if model is None:
            raise AttributeError(f"model {self.model_runner.model_id!r} has no torch model")
        return model

    def check_health(self) -> None:
        """vLLM's: nothing to check in a worker that lives in the engine's process."""


def worker_class(extension: str | None) -> type[Worker]:
    """The worker class, with `extension` ("module.Class") mixed in. Refused, naming the
    class, when it cannot be imported or defines a name the worker has (vLLM's rule: an
    extension adds methods, it does not replace the worker's)."""
    if extension is None:
        return Worker
    module_name, _, class_name = extension.rpartition(".")
    try:
        ext = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"worker_extension_cls {extension!r} cannot be imported: {exc}") from None
    if not isinstance(ext, type):
        raise ValueError(f"worker_extension_cls {extension!r} is not a class")
    clashes = sorted(
        name for name in vars(ext) if not name.startswith("__") and hasattr(Worker, name)
    )
    if clashes:
        raise ValueError(
            f"worker_extension_cls {extension!r} defines {', '.join(clashes)}, which the "
            "worker has already"
        )
    return type(f"Worker[{ext.__qualname__}]", (Worker, ext), {})


def resolve_method(
    worker: Worker, method: str | Callable[..., Any]
) -> tuple[str, Callable[..., Any]]:
    """The call collective_rpc makes, and its name for the tape: a method of the worker by
    name, or a function called with the worker first (vLLM's two forms). Refused (before
    anything is recorded) when there is no such method."""
    if callable(method):
        name = getattr(method, "__qualname__", None) or type(method).__name__
        return name, lambda *args, **kwargs: method(worker, *args, **kwargs)
    if not isinstance(method, str):
        raise WorkerCallRefused(
            f"collective_rpc: method must be a name or a callable, got {method!r}"
        )
    bound = getattr(worker, method, None) if not method.startswith("_") else None
    if bound is None or not callable(bound):
        raise WorkerCallRefused(
            f"collective_rpc: the worker has no method {method!r} "
            "(worker_extension_cls adds methods)"
        )
    return method, bound


def _encodable(value: Any) -> Any:
    """What stands for a value msgpack has no form for, in an argument digest: a tensor by
    its dtype, shape and the SHA-256 of its bytes; anything else by its type and repr."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous().cpu()
        data = t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b""
        return ["tensor", str(t.dtype), list(t.shape), hashlib.sha256(data).hexdigest()]
    return ["object", type(value).__qualname__, repr(value)]


_digest_encoder = msgspec.msgpack.Encoder(enc_hook=_encodable, order="deterministic")


def args_digest(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The SHA-256 of a call's arguments, as the tape holds them (not the arguments)."""
    return (
        "sha256:" + hashlib.sha256(_digest_encoder.encode([list(args), dict(kwargs)])).hexdigest()
    )
