"""What the `tokentape` subcommands share: the expected-failure error and exit statuses,
argument types, the one overwrite rule for output files, and the tape a running command writes.

Expected failures raise `CLIError` (or one of `expected_errors()`): `tokentape.cli.main`
prints `error: <message>` on one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sqlite3
from collections.abc import Sequence
from typing import Any

from tokentape.engine.arg_utils import int_at_least
from tokentape.errors import CLIError, EngineDeadError, ReducerError, TapeError
from tokentape.events.segment_dir import (
    DEFAULT_RETENTION_BYTES,
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_SEGMENT_SECONDS,
    SegmentedTapeSpec,
    parse_retention,
    parse_size,
)

EXIT_OK = 0
EXIT_DIVERGED = 1  # also: findings (postmortem), outputs that differ (diff, whatif)
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def expected_errors() -> tuple[type[BaseException], ...]:

    return (
        CLIError,
        TapeError,
        ReducerError,
        EngineDeadError,
        FileExistsError,
        ValueError,
        OSError,
        sqlite3.Error,
    )


def one_line(exc: BaseException) -> str:
    from tokentape.events.fold_errors import one_line as message

    return message(exc)


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


# -- default output paths: new ones, never an existing file --------------------------------------


def new_tape_path(stem: str) -> str:
    """`STEM.tape`, or `STEM-2.tape`, `STEM-3.tape`, ...: the first no file has (a second run
    within the same second, a second what-if of one tape)."""
    path, n = f"{stem}.tape", 1
    while os.path.exists(path):
        n += 1
        path = f"{stem}-{n}.tape"
    return path


def timestamped_tape_path(prefix: str) -> str:
    """A new tape in the current directory named after the UTC time: PREFIX-<stamp>.tape."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return new_tape_path(f"{prefix}-{stamp}")


def add_tape_arguments(parser: Any, prefix: str, flight_recorder: bool = False) -> None:
    """The tape a running command writes: --tape PATH or --no-tape, and --force; unnamed,
    timestamped_tape_path(prefix)'s. With `flight_recorder` (a server), also --tape-dir DIR:
    a segmented tape, with its segment and retention limits."""
    tape = parser.add_mutually_exclusive_group()
    tape.add_argument(
        "--tape",
        metavar="PATH",
        default=None,
        help="tape file to create; an existing file is refused unless --force "
        f"(default: {prefix}-<UTC timestamp>.tape in the current directory)",
    )
    tape.add_argument("--no-tape", action="store_true", help="do not write a tape file")
    add_force_argument(parser, "tape file")
    if not flight_recorder:
        return
    tape.add_argument(
        "--tape-dir",
        metavar="DIR",
        default=None,
        help="write the tape as a flight recorder: a new directory of segment files, each of "
        "which verifies and replays on its own; closed segments beyond --tape-retention are "
        "deleted, so the tape stays bounded",
    )
    parser.add_argument(
        "--segment-seconds",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_SEGMENT_SECONDS,
        help="with --tape-dir: close a segment after this long "
        f"(default: {DEFAULT_SEGMENT_SECONDS:g})",
    )
    parser.add_argument(
        "--segment-bytes",
        metavar="SIZE",
        type=_size,
        default=DEFAULT_SEGMENT_BYTES,
        help="with --tape-dir: or once it holds this many bytes of events, whichever comes "
        f"first (500KB, 64MB; default: {DEFAULT_SEGMENT_BYTES >> 20}MB)",
    )
    parser.add_argument(
        "--tape-retention",
        metavar="LIMIT",
        type=_retention,
        default=(None, DEFAULT_RETENTION_BYTES),
        help="with --tape-dir: keep the closed segments of the last LIMIT: a duration (30m, "
        "2h) or a size for the whole tape (500MB, 2GB); 0 keeps everything "
        f"(default: {DEFAULT_RETENTION_BYTES >> 30}GB)",
    )


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _retention(text: str) -> tuple[float | None, int | None]:
    try:
        return parse_retention(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def flight_recorder_spec(args: argparse.Namespace) -> SegmentedTapeSpec:
    """--tape-dir and its limits, checked (a bad limit is a CLIError)."""
    seconds, size = args.tape_retention
    try:
        return SegmentedTapeSpec(
            args.tape_dir, args.segment_seconds, args.segment_bytes, seconds, size
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None


# -- the overwrite rule: an existing output file is refused unless --force ----------------------


def add_force_argument(parser: Any, what: str = "output file") -> None:
    parser.add_argument(
        "--force", action="store_true", help=f"overwrite an existing {what} (default: refuse it)"
    )


def check_output_path(
    path: str, force: bool, option: str, inputs: Sequence[str | os.PathLike[str]] = ()
) -> bool:
    """Apply the overwrite rule to an output path before any work is done: an existing file
    is refused unless `force`, a directory always, and so is a path that is one of the
    `inputs` (it would be destroyed before it is read). Returns whether the file exists."""
    if os.path.isdir(path):
        raise CLIError(f"{path}: {option} names a directory; give a file path")
    if not os.path.lexists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise CLIError(f"{path}: cannot write it, directory {parent} does not exist")
        return False
    for source in inputs:
        if os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source):
            raise CLIError(
                f"{path}: {option} names the input {os.fspath(source)}; give another path"
            )
    if not force:
        raise CLIError(
            f"{path}: the file exists; pass --force to overwrite it, or choose "
            f"another path with {option}"
        )
    return True


def remove_for_overwrite(path: str) -> None:
    """Delete an existing output (--force) with the -wal and -shm files a tape may have."""
    from tokentape.events.sqlite_store import remove_tape_files

    remove_tape_files(path)
