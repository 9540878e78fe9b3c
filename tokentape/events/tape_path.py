"""Where a tape may be created: the check every tape writer's caller runs before it builds
anything (a model, vLLM), so a bad path fails in milliseconds, naming the path and why."""

from __future__ import annotations

import os

from tokentape.events.segment_dir import SegmentedTapeSpec, check_tape_dir
from tokentape.events.validation import short_repr, shown

# A path means an SQLite tape file, a SegmentedTapeSpec a directory of segments (a flight
# recorder), None an in-memory tape, False no tape at all.
TapeSpec = str | os.PathLike[str] | None | bool | SegmentedTapeSpec


def check_tape_path(tape: TapeSpec) -> None:
    """Refuse a tape path that cannot be created, naming it and why. (SQLiteTape checks again
    when it creates the file.)"""
    if tape is None or tape is False:
        return
    if isinstance(tape, SegmentedTapeSpec):
        check_tape_dir(tape)
        return
    if tape is True:
        raise ValueError("tape=True is ambiguous: pass a file path, None (memory) or False (off)")
    if not isinstance(tape, (str, os.PathLike)):
        raise TypeError(
            f"tape must be a file path, None (memory) or False (off), got {shown(tape)}"
        )
    path = os.fspath(tape)
    if not isinstance(path, str):
        raise TypeError(f"tape must be a str path, got {shown(path)}")
    if not path or "\0" in path:
        raise ValueError(f"tape must be a file path, got {short_repr(path)}")
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"tape path {short_repr(path)} cannot be encoded for the file system: {exc.reason}"
        ) from None
    what = f"{path}: cannot create the tape"
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what}: it is a directory; pass a file path inside it")
    if os.path.lexists(path):
        raise FileExistsError(f"{path}: a tape already exists here; choose a new path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise FileNotFoundError(f"{what}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"{what}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{what}: directory {parent} is not writable")


def with_tape_dir(tape: TapeSpec, tape_dir: str | os.PathLike[str] | None) -> TapeSpec:
    """`tape`, or with `tape_dir` (LLM's and AsyncLLM's argument) a segmented tape in that
    directory, with the flight recorder's default limits (SegmentedTapeSpec for others)."""
    if tape_dir is None:
        return tape
    if tape is not None:
        raise ValueError("give tape or tape_dir, not both")
    if not isinstance(tape_dir, (str, os.PathLike)):
        raise TypeError(f"tape_dir must be a directory path, got {shown(tape_dir)}")
    return SegmentedTapeSpec(os.fspath(tape_dir))
