"""`tokentape export TAPE --format F`: a tape as Perfetto trace JSON, JSON lines, CSV, or a
single-file SQLite copy."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tokentape.entrypoints.cli.common import (
    EXIT_OK,
    CLIError,
    add_force_argument,
    check_output_path,
    remove_for_overwrite,
)
from tokentape.entrypoints.cli.tape_source import TAPE_OR_DIR, add_tape_source, open_tape
from tokentape.progress import progress


def add_parser(sub: Any) -> argparse.ArgumentParser:
    exp = sub.add_parser(
        "export",
        help="write a tape as Perfetto trace JSON, JSON lines, CSV, or a single-file copy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "perfetto: Chrome trace-event JSON for ui.perfetto.dev: one track per request with\n"
            "  slices for its phases (waiting, prefill, decode, preempted, paused) and instants\n"
            "  for preemptions, discarded frames and its finish; an engine track with the\n"
            "  prefix-cache resets, pauses and resumes. 1 us on the clock = one tape event.\n"
            'jsonl: one event per line ({"seq", "kind", fields}), for jq.\n'
            "csv: one row per engine step.\n"
            "sqlite: a copy of the tape as one self-contained file (needs -o), taken as one\n"
            "  consistent snapshot, so it works while the tape is being written: the copy ends\n"
            "  at a step boundary and is itself a tape (it verifies, stays append-only)."
        ),
        epilog=(
            "examples:\n"
            "  tokentape export run.tape --format perfetto -o run.trace.json\n"
            "  tokentape export run.tape --format jsonl "
            "| jq 'select(.kind == \"RequestPreempted\")'\n"
            "  tokentape export live.tape --format sqlite -o snapshot.tape"
        ),
    )
    add_tape_source(exp, f"the {TAPE_OR_DIR}, to export")
    exp.add_argument(
        "--format",
        required=True,
        choices=["perfetto", "jsonl", "csv", "sqlite"],
        help="output format",
    )
    exp.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        default=None,
        help="write to FILE instead of stdout (sqlite: required); an existing FILE "
        "is refused unless --force",
    )
    add_force_argument(exp)
    exp.set_defaults(func=cmd_export)
    return exp


def cmd_export(args: argparse.Namespace) -> int:
    from tokentape.replay.export import export, export_sqlite

    if args.format == "sqlite" and args.output is None:
        raise CLIError("--format sqlite writes a file: give its path with --output")
    tape = open_tape(args)  # a file that is not a tape is refused before any output
    if args.output is not None and check_output_path(
        args.output, args.force, "--output", [args.tape]
    ):
        remove_for_overwrite(args.output)
    if args.format == "sqlite":
        n = export_sqlite(tape, args.output)
        print(f"wrote {args.output} ({n} events)", file=sys.stderr)
        return EXIT_OK
    with progress(len(tape), f"exporting {args.format}") as update:
        if args.output is None:
            export(tape, args.format, sys.stdout, update)
        else:
            f = open(args.output, "x", encoding="utf-8", newline="")
            try:
                with f:
                    export(tape, args.format, f, update)
            except BaseException:
                os.remove(args.output)  # no partial export left behind to block the rerun
                raise
            print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK
