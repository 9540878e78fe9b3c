"""The recording session open in this process, if any: set by session.py's install, read by
every RecordingScheduler as it is built. A module of its own so that the scheduler and the
session (which imports the scheduler when it installs) do not import each other."""

from __future__ import annotations

from typing import Any

# The open RecordingSession (session.py), typed loosely: its type lives in a module that
# imports the scheduler.
_current: Any = None


def current() -> Any:
    """The session recording this process's schedulers, if one is open (else None)."""
    return _current


def set_current(session: Any) -> None:
    global _current
    if session is not None and _current is not None:
        raise RuntimeError("a recording session is already open in this process")
    _current = session
