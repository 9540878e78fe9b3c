"""vLLM's sleep mode for the real model's runner (runners.base.SleepsMemory): what each sleep
level releases, and how a wake-up brings it back.

- Level 1 moves every weight to a host copy (pinned on CUDA; on the CPU the weight's own
  storage is handed over to it, nothing copied) and frees the runner's tensors: the
  parameters are left empty, the CPU's packed copies of the weights and the memory kept
  for the next weight transfer (staged_weights.py) are dropped, and the KV cache tensors
  are freed. Waking the weights puts the host copy back: the same bits.
- Level 2 frees the weights outright (and the KV cache). Waking them rebuilds them from the
  model's source, the seed of a built-in model or its checkpoint folder read again: vLLM
  leaves that memory uninitialised for the caller to load; here the weights are defined, and
  their hash goes on the tape. An RL loop then loads its own with `update_weights`.
- Level 0 releases nothing (vLLM's: it only pauses scheduling).

The model's buffers (the RoPE tables) stay where they are, as in vLLM. A woken KV cache is
zeroed; the engine reset the prefix cache before the sleep, so no request reuses old blocks.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tokentape.engine.model.decoder import CausalLM
from tokentape.kernels.scratch import ThreadScratch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class SleepingRunner(Protocol):
    """What sleep mode uses of model_runner.TorchModelRunner."""

    model: CausalLM
    model_id: str
    seed: int
    device: torch.device
    dtype: torch.dtype
    kv_caches: KVCaches
    scratch: ThreadScratch
    _weights_id: str | None

    @property
    def weights_id(self) -> str: ...
    @property
    def num_steps_outstanding(self) -> int: ...
    def new_kv_caches(self) -> KVCaches: ...
    def drop_stage_memory(self) -> None: ...


class RunnerMemory:
    """The sleep state of one TorchModelRunner: which tags sleep, and the weights' host copy.
    The runner is passed to each call, not kept: no cycle keeps a dropped runner's memory."""

    def __init__(self) -> None:
        self.level = 0
        self.asleep: set[str] = set()  # of "weights", "kv_cache"
        self.host_copy: dict[str, torch.Tensor] = {}  # level 1: the weights, by name

    def check_sleep(self, runner: SleepingRunner, level: int) -> None:
        if level == 2 and not _has_source(runner.model_id):
            raise ValueError(
                f"sleep(level=2) drops the weights, and model {runner.model_id!r} is "
                "neither a built-in model nor a checkpoint folder to rebuild them from: "
                "sleep at level 1 (a host copy of the weights) instead"
            )

    def sleep(self, runner: SleepingRunner, level: int) -> None:
        if runner.num_steps_outstanding:  # the engine drains first: this cannot happen
            raise RuntimeError("sleep: steps are still in flight in the runner")
        if level == 0 or self.asleep:
            return
        if level == 1:  # every host copy is made before anything is freed
            params = runner.model.named_parameters()
            self.host_copy = {name: _to_host(p.detach()) for name, p in params}
        release(runner)
        self.level, self.asleep = level, {"weights", "kv_cache"}

    def wake_up(self, runner: SleepingRunner, tags: Sequence[str]) -> str | None:
        waking = [t for t in ("weights", "kv_cache") if t in tags and t in self.asleep]
        weights_id = None
        if "weights" in waking:
            # Everything is read (and, after level 2, rebuilt) before any parameter changes.
            fresh = self.host_copy if self.level == 1 else _rebuilt(runner)
            params = dict(runner.model.named_parameters())
            device, dtype = runner.device, runner.dtype
            restored = {n: fresh[n].to(device=device, dtype=dtype) for n in params}
            for name, p in params.items():
                p.data = restored[name]
            self.host_copy = {}
            if device.type == "cpu":
                runner.model.prepack()
            if self.level == 2:
                runner._weights_id = None  # other weights than before: hashed again
                weights_id = runner.weights_id
            self.asleep.discard("weights")
        if "kv_cache" in waking:
            runner.kv_caches = runner.new_kv_caches()
            self.asleep.discard("kv_cache")
        if waking and runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)  # the worker's stream reads them next
        return weights_id


def release(runner: SleepingRunner) -> None:
    """Free the weights (the CPU's packed copies too) and the KV cache: a sleep, or a closed
    runner, whose memory must not wait for the collector to find the engine's cycles."""
    for p in runner.model.parameters():
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    runner.model.release_cpu_memory()  # the CPU's second copy of the weights, its scratch
    runner.drop_stage_memory()  # and the one kept for the next weight transfer
    runner.scratch.clear()
    runner.kv_caches = []
    _release(runner.device)


def _has_source(model_id: str) -> bool:
    from tokentape.engine.model.model_config import BUILTIN_CONFIGS

    return model_id in BUILTIN_CONFIGS or os.path.isdir(model_id)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy: pinned memory on CUDA (fast to copy back); on the CPU the tensor itself,
    whose storage the parameter gives up."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def _rebuilt(runner: SleepingRunner) -> dict[str, torch.Tensor]:
    """The weights as the runner was built with them (runners/build.py)."""
    from tokentape.engine.model.loader import builtin_model, load_checkpoint
    from tokentape.engine.model.model_config import BUILTIN_CONFIGS

    if runner.model_id in BUILTIN_CONFIGS:
        _, model = builtin_model(runner.model_id, runner.seed)
    else:
        _, model = load_checkpoint(runner.model_id)
    return {name: p.detach() for name, p in model.named_parameters()}


def _release(device: torch.device) -> None:
    """Give the freed memory back: CUDA's caching allocator keeps it otherwise, and on the
    CPU glibc's heaps keep what was freed below their tops (a model's build leaves GBs there:
    a qwen3-0.6b engine closed left 2.7 GB resident, 0.3 GB once trimmed)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    elif _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where the C library is glibc."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()
