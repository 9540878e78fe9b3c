"""`tokentape diff A B`: the first client-visible divergence between two tapes of the same
requests; `print_diff` also prints `replay whatif`'s diff."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import Any

from tokentape.entrypoints.cli.common import EXIT_DIVERGED, EXIT_OK
from tokentape.entrypoints.cli.tape_source import TAPE_OR_DIR, add_window_options
from tokentape.progress import progress
from tokentape.replay.render import Output


def add_parser(sub: Any) -> argparse.ArgumentParser:
    dif = sub.add_parser(
        "diff",
        help="compare the client-visible output of two tapes of the same requests",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Align two tapes of the same requests (sync against async, flag against epoch,\n"
            "CI against local) by request id and output position, and print the first place\n"
            "where the tokens the client received differ, with the events around it in both.\n"
            "Each tape must first pass the consistency checks of 'tokentape replay verify'.\n"
            "\n"
            "exit status: 0 when the outputs are identical, 1 when they differ, 2 when a tape\n"
            "cannot be read, is not internally consistent (it fails replay verify), or the\n"
            "tapes hold different requests (they cannot be aligned)."
        ),
        epilog="example:\n  tokentape diff ci.tape local.tape",
    )
    dif.add_argument("a", metavar="A", help=f"first {TAPE_OR_DIR}")
    dif.add_argument("b", metavar="B", help=f"second {TAPE_OR_DIR}")
    add_window_options(dif, "each segmented tape's directory")
    dif.set_defaults(func=cmd_diff)
    return dif


def print_diff(text: str) -> None:
    """A diff report, coloured on a terminal (plain text when piped)."""
    out = Output(sys.stdout)
    for line in text.splitlines():
        style = None
        if line.startswith("DIFFERENT"):
            style = "bold red"
        elif line.startswith("identical"):
            style = "bold green"
        elif line.startswith(("first divergence", "tape A around", "tape B around")):
            style = "bold"
        elif line.startswith("  >"):
            style = "yellow"
        out.line(line, style=style)


class PinnedReader:
    """A tape reader that sees only the tape's first `length` events, in every pass: a tape
    still being written is compared as it stood when the command began (read twice, A then B,
    it had grown in between, and `diff live.tape live.tape` found a divergence)."""

    def __init__(self, reader: Any, length: int) -> None:
        self._reader, self._length = reader, length
        self.path, self.header = reader.path, reader.header

    def __len__(self) -> int:
        return self._length

    def iter_events(self, start: int = 0) -> Iterator[tuple[int, Any]]:
        for seq, event in self._reader.iter_events(start):
            if seq >= self._length:
                return
            yield seq, event

    def close(self) -> None:
        self._reader.close()


def pinned_tapes(path_a: str, path_b: str, since: Any = None, until: Any = None) -> tuple[Any, Any]:
    """Both tapes (files or segmented tapes' directories, over the window `since`..`until`),
    each pinned at its length now; one tape given twice is pinned once."""
    from tokentape.replay.tape import Tape, load_tape

    a, b = load_tape(path_a, since, until), load_tape(path_b, since, until)
    len_a, len_b = len(a), len(b)
    if os.path.samefile(path_a, path_b):
        len_a = len_b = min(len_a, len_b)
    return (
        Tape(PinnedReader(a.reader, len_a), a.snapshot_interval),
        Tape(PinnedReader(b.reader, len_b), b.snapshot_interval),
    )


def cmd_diff(args: argparse.Namespace) -> int:
    from tokentape.replay.diff import diff

    a, b = pinned_tapes(args.a, args.b, args.since, args.until)
    with progress(2 * (len(a) + len(b)), "checking and reading the tapes") as update:
        result = diff(a, b, update)
    print_diff(result.format())
    return EXIT_OK if result.identical else EXIT_DIVERGED
