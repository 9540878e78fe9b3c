"""Where the real model runs: the device an engine asks for, checked against this machine, and
a tape header's CPU thread count clamped to the CPUs the process may use."""

from __future__ import annotations

import os

import torch

CPU_FALLBACK_NOTE = "the tape was recorded on {device}, which this machine does not have"


def cpus_available() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def clamped_cpu_threads(requested: int | None) -> int | None:
    """A CPU thread count read from a tape header, clamped to the CPUs this process may use
    (a crafted header asking for 5,000 made a what-if 3x slower). An engine built by its
    user keeps what it was asked for: tests share steps over more lanes than CPUs."""
    return min(requested, cpus_available()) if requested else requested


def device_problem(name: str) -> str | None:
    """Why `name` cannot run the model here, or None when it can ('auto' always can)."""
    if name in ("auto", "cpu"):
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        return f"device {name!r} is not a device torch knows ({exc})"
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"device {name!r} is not supported: use 'auto', 'cpu' or 'cuda[:N]'"
    if not torch.cuda.is_available():
        return f"device {name!r} is not available: this machine has no CUDA device torch can use"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"device {name!r} is not available: this machine has {count} CUDA device(s)"
    return None


def resolve_device(name: str) -> str:
    """The device to build the model on: 'auto' is CUDA when there is one, else the CPU; a
    device this machine lacks is a ValueError naming it."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    problem = device_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name
