"""The directory of a segmented tape: its manifest, its segment files, and the limits a
server sets on it (how long a segment runs, how much of the tape is kept).

A segmented tape is a directory holding `tokentape-tape.json` (the manifest: what the
directory is, its limits, and how the run ended) and segment files `segment-00000000.tape`,
`segment-00000001.tape`, ... Each segment file is a tape of its own that opens with an
`EngineSnapshot` (docs/tape-format.md, "Segmented tapes"). The manifest is what tells a
segmented tape's directory apart from a fleet's (a directory of tapes, one per engine).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
from typing import Any

import msgspec

from tokentape.events.validation import short_repr

MANIFEST = "tokentape-tape.json"
MANIFEST_KIND = "tokentape segmented tape"
_SEGMENT = re.compile(r"segment-(\d{8})\.tape")

# A production server's defaults: a crash window is read a segment at a time, so a minute is
# the granularity of `--since`; 64 MB bounds a segment at a burst of traffic.
DEFAULT_SEGMENT_SECONDS = 60.0
DEFAULT_SEGMENT_BYTES = 64 << 20
# Without --tape-retention a server keeps the last 1 GB of its tape.
DEFAULT_RETENTION_BYTES = 1 << 30
# What a directory's file system must have free besides the retention: room for a segment.
_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class SegmentedTapeSpec(msgspec.Struct, frozen=True):
    """A segmented tape to write: the directory, when a segment closes (after
    `segment_seconds` or `segment_bytes`, whichever comes first) and what is kept (closed
    segments older than `retention_seconds`, or beyond `retention_bytes` for the whole tape,
    are deleted oldest first; None: no limit of that kind)."""

    directory: str
    segment_seconds: float = DEFAULT_SEGMENT_SECONDS
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    retention_seconds: float | None = None
    retention_bytes: int | None = DEFAULT_RETENTION_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory or "\0" in self.directory:
            raise ValueError(f"tape_dir must be a directory path, got {short_repr(self.directory)}")
        if not self.segment_seconds > 0:
            raise ValueError(f"segment_seconds must be > 0, got {self.segment_seconds!r}")
        if self.segment_bytes < 1 << 16:
            raise ValueError(f"segment_bytes must be at least 64KB, got {self.segment_bytes!r}")
        if self.retention_seconds is not None and not self.retention_seconds > 0:
            raise ValueError(f"retention_seconds must be > 0, got {self.retention_seconds!r}")
        if self.retention_bytes is not None and self.retention_bytes < 1:
            raise ValueError(f"retention_bytes must be > 0, got {self.retention_bytes!r}")


def parse_size(text: str) -> int:
    """`500KB`, `1MB`, `2GB` (binary units, as `ls -h`), or a number of bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)?\s*", text.upper())
    if m is None:
        raise ValueError(f"{text!r} is not a size (write it as 500KB, 1MB or 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or "B"])


def parse_duration(text: str) -> float:
    """`90s`, `10m`, `2h`, `7d`, or a number of seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if m is None:
        raise ValueError(f"{text!r} is not a duration (write it as 90s, 10m, 2h or 7d)")
    return float(m.group(1)) * _SECONDS[m.group(2) or "s"]


def parse_retention(text: str) -> tuple[float | None, int | None]:
    """`--tape-retention`: a duration (30m) or a size (2GB): (seconds, bytes), one of them
    None; `0` keeps everything (None, None)."""
    if text.strip() == "0":
        return None, None
    try:
        return parse_duration(text), None
    except ValueError:
        pass
    try:
        return None, parse_size(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a retention: give a duration (30m, 2h), a size (500KB, 2GB) "
            "or 0 (keep everything)"
        ) from None


def segment_name(index: int) -> str:
    return f"segment-{index:08d}.tape"


def segment_index(name: str) -> int | None:
    m = _SEGMENT.fullmatch(name)
    return int(m.group(1)) if m else None


def segment_files(directory: str) -> list[str]:
    """The segment files in a directory, oldest first (paths)."""
    found = []
    for name in os.listdir(directory):
        index = segment_index(name)
        if index is not None:
            found.append((index, os.path.join(directory, name)))
    return [path for _, path in sorted(found)]


def is_segmented_tape(path: str | os.PathLike[str]) -> bool:
    """A directory with a segmented tape's manifest."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def read_manifest(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise ValueError(f"{directory}: {MANIFEST} is not a tokentape segmented tape's manifest")
    return manifest


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    """Replace the manifest in one step (a reader sees the old or the new one, never half)."""
    path = os.path.join(directory, MANIFEST)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def record_end(directory: str, how: str) -> None:
    """Say in the manifest how the run ended (once: the first word stays)."""
    manifest = read_manifest(directory)
    if manifest.get("ended") is None:
        manifest["ended"] = {"at": now_iso(), "how": how}
        write_manifest(directory, manifest)


def check_tape_dir(spec: SegmentedTapeSpec) -> None:
    """Refuse a directory the tape cannot be written to, naming it and why, before anything
    is built: one that holds files already, cannot be created, is not writable, or whose file
    system has no room for the retention and one segment."""
    path = spec.directory
    what = f"{path}: cannot write the tape there"
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{what}: it is not a directory")
    if os.path.isdir(path) and os.listdir(path):
        raise FileExistsError(f"{path}: the directory holds files already; choose a new one")
    parent = os.path.dirname(os.path.abspath(path))
    existing = path if os.path.isdir(path) else parent
    if not os.path.isdir(existing):
        raise FileNotFoundError(f"{what}: directory {parent} does not exist")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{what}: {existing} is not writable")
    free = shutil.disk_usage(existing).free
    need = spec.segment_bytes + (spec.retention_bytes or 0)
    if spec.retention_bytes is not None and free < need:
        raise OSError(
            f"{what}: the file system has {free >> 20} MB free, less than the retention "
            f"({spec.retention_bytes >> 20} MB) and one segment ({spec.segment_bytes >> 20} MB)"
        )
    if free < 1 << 20:
        raise OSError(f"{what}: the file system is full ({free} bytes free)")
