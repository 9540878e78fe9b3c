"""The tape a reading command opens: a tape file, or a segmented tape's directory (its segments
read as one tape), and for a directory the time window `--since` / `--until` to read of it.

    add_tape_source(parser, "tape file to inspect")   # TAPE|DIR, --since WHEN, --until WHEN
    tape = open_tape(args)                             # tokentape.replay.tape.load_tape's Tape
"""

from __future__ import annotations

import argparse
import datetime
from typing import TYPE_CHECKING, Any

from tokentape.events.segment_dir import parse_duration

if TYPE_CHECKING:
    from tokentape.replay.tape import Tape

TAPE_OR_DIR = "tape file, or a segmented tape's directory"
_FORMS = (
    "give a duration before the tape's end (90s, 10m, 2h, 7d) or an ISO date-time "
    "(2025-01-31T14:00, local time unless it has an offset such as +00:00)"
)


def parse_time_point(text: str) -> float | datetime.timedelta:
    """`--since` / `--until`: a duration (90s, 10m, 2h, 7d) is that long before the tape's end
    (a timedelta); an ISO-8601 date-time (naive: local time) is seconds since the epoch."""
    try:
        return datetime.timedelta(seconds=parse_duration(text))
    except ValueError:
        pass
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except (ValueError, OverflowError, OSError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a time: {_FORMS}") from None


def add_window_options(parser: Any, which: str = "a segmented tape's directory") -> None:
    """--since WHEN and --until WHEN, applying to `which`."""
    window = (
        f"read only the segments of {which} that overlap the window; WHEN is a duration "
        "before the tape's end (10m, 2h) or an ISO date-time"
    )
    parser.add_argument(
        "--since",
        metavar="WHEN",
        type=parse_time_point,
        default=None,
        help=f"start of the time window: {window} (default: the first segment)",
    )
    parser.add_argument(
        "--until",
        metavar="WHEN",
        type=parse_time_point,
        default=None,
        help=f"end of the time window: {window} (default: the tape's end)",
    )


def add_tape_source(parser: Any, help: str) -> None:
    """The positional `tape` (TAPE|DIR) and the window options --since and --until."""
    parser.add_argument("tape", metavar="TAPE|DIR", help=help)
    add_window_options(parser)


def open_tape(args: argparse.Namespace, snapshot_interval: int | None = None) -> Tape:
    """The tape `args.tape` names, read over the window `args.since`..`args.until`
    (tokentape.replay.tape.Tape). A window on a tape file, or a directory that is not a
    segmented tape, raises TapeError."""
    from tokentape.replay.tape import load_tape

    tape = load_tape(args.tape, args.since, args.until)
    if snapshot_interval is not None:
        tape.snapshot_interval = snapshot_interval  # before the index is built, lazily
    return tape
