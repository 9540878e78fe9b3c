"""`tokentape postmortem TAPE`: run the checkers over a tape and print (or write) the report.
`tokentape postmortem DIR`: a segmented tape's directory is one tape (its segments, or those
of the window --since..--until); any other directory is a fleet (one tape per engine: *.tape
files and segmented tapes' subdirectories), analysed in parallel, with a row per engine
(tokentape/postmortem/fleet.py).

Exit status: 0 when no finding has error severity, 1 when one has, 2 when the tape cannot be
opened at all (not a tape, a newer format version) or cannot be read to its end (a damaged
event, a truncated file): the CLI's one-line error on stderr, after the report of the part
that could be read. So CI tells an unreadable tape (2) from a run with findings (1). For a
directory, the same over its tapes: 2 when any is unreadable, else 1 when any has an error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

import msgspec

from tokentape.entrypoints.cli.common import (
    CLIError,
    add_force_argument,
    check_output_path,
    positive_int,
)
from tokentape.entrypoints.cli.tape_source import add_window_options, open_tape
from tokentape.events.segment_dir import is_segmented_tape
from tokentape.events.store import TapeError
from tokentape.postmortem.report_text import print_report
from tokentape.progress import progress
from tokentape.replay.render import safe_text
from tokentape.replay.tape import Tape

EXIT_OK = 0
EXIT_FINDINGS = 1


def add_parser(sub: Any) -> None:
    """Register the subcommand on the CLI's subparsers."""
    pm = sub.add_parser(
        "postmortem",
        help="name what went wrong in a tape (findings, HTML report)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run the postmortem checkers over a tape in one pass: token conservation, stale\n"
            "frames applied, fresh frames dropped (the first token after resume: vLLM #42043),\n"
            "tokens duplicated or shifted against a reference (a reference tape, or the\n"
            "oracle's stream for an oracle tape), negative or leftover counts, KV blocks leaked\n"
            "or freed twice, stuck requests, prefix-cache resets with blocks in use, and client\n"
            "outputs that differ from what the reducer derives. Then verify's consistency\n"
            "checks (as 'tokentape replay verify'), and where a tape that stops mid-run ends.\n"
            "A damaged tape is analysed up to where it breaks. A segmented tape's directory\n"
            "(with its tokentape-tape.json) is one tape: its segments, or with --since and\n"
            "--until those of a time window.\n"
            "\n"
            "Given any other directory (a fleet: one tape per engine, *.tape files and\n"
            "segmented tapes' subdirectories), it analyses every tape in parallel (worker\n"
            "processes, or Ray tasks with --ray) and reports a row per engine (named by its\n"
            "file or subdirectory): how and where its tape ends (complete, truncated by\n"
            "a killed engine, interrupted by a Ctrl-C, engine_error, damaged, unreadable) and\n"
            'its findings; --json gives {"tapes": [...], "summary": {"tapes": N, ...,\n'
            '"engines": {...}}}.\n'
            "\n"
            "exit status: 0 when no finding is an error, 1 when one is, 2 when the tape\n"
            "cannot be opened (not a tape, or a newer format version) or cannot be read to\n"
            "its end (the report then covers the part before the damage, and one line on\n"
            "stderr says where reading stopped). For a directory: 2 when any tape is\n"
            "unreadable, else 1 when any has an error finding, else 0."
        ),
        epilog=(
            "examples:\n"
            "  tokentape postmortem run.tape\n"
            "  tokentape postmortem run.tape --html report.html\n"
            "  tokentape postmortem run.tape --json --reference good.tape\n"
            "  tokentape postmortem tapes/ --html fleet.html     # a tape per engine\n"
            "  tokentape postmortem tapes/ --jobs 8 --json\n"
            "  tokentape postmortem tapes/ --ray                 # Ray tasks (RAY_ADDRESS or local)"
        ),
    )
    pm.add_argument(
        "tape",
        metavar="TAPE|DIR",
        help="tape file, or a segmented tape's directory, to analyse; or a directory of tapes",
    )
    add_window_options(pm)
    pm.add_argument(
        "--html",
        metavar="REPORT",
        default=None,
        help="also write a self-contained HTML report (an existing file is refused "
        "unless --force) (summary, findings, timeline; "
        "for a directory: a row per engine and each engine's findings)",
    )
    add_force_argument(pm, "--html report")
    pm.add_argument(
        "--json", action="store_true", help='print {"findings": [...], "summary": {...}} as JSON'
    )
    pm.add_argument(
        "--reference",
        metavar="TAPE",
        default=None,
        help="compare every request's tokens with this tape's (default: the oracle's "
        "expected stream when the tape was made with the oracle)",
    )
    pm.add_argument(
        "--jobs",
        metavar="N",
        type=positive_int,
        default=None,
        help="a directory's tapes are analysed by N worker processes (default: one per "
        "CPU; 1: in this process); with --ray, the CPUs of the local Ray instance",
    )
    pm.add_argument(
        "--ray",
        action="store_true",
        help="analyse a directory's tapes as Ray tasks: on the Ray instance this "
        "process has, the cluster at RAY_ADDRESS, or a local one (needs the ray extra)",
    )
    pm.set_defaults(func=cmd_postmortem)


def cmd_postmortem(args: argparse.Namespace) -> int:
    from tokentape.postmortem.analysis import postmortem

    if args.html is not None:  # refused before any analysis, unless --force
        check_output_path(
            args.html, args.force, "--html", [p for p in (args.tape, args.reference) if p]
        )
    if os.path.isdir(args.tape) and not is_segmented_tape(args.tape):
        return cmd_fleet(args)
    if args.jobs is not None or args.ray:
        raise CLIError("--jobs and --ray apply to a directory of tapes, not to one tape")
    tape = open_tape(args)
    total = _length_or_none(tape)
    with progress(total, "postmortem", minimum=0) as update:
        report = postmortem(tape, reference=args.reference, progress=update)
    if args.html:
        from tokentape.postmortem.report_html import write_report

        with progress(total, "report", minimum=0) as update:
            write_report(report, tape, args.html, progress=update)
    if args.json:
        print(json.dumps(msgspec.to_builtins(report)))
    else:
        print_report(report, sys.stdout)
        if args.html:
            print(safe_text(f"report: {args.html}"))
    damaged = next((f for f in report.findings if f.kind == "tape_damaged"), None)
    if damaged is not None:
        raise CLIError(f"{report.summary.tape}: {damaged.message}")
    return EXIT_OK if report.ok else EXIT_FINDINGS


def cmd_fleet(args: argparse.Namespace) -> int:
    """The postmortem of every tape of a directory; exit 2 when one is unreadable, else 1
    when one has an error finding."""
    from tokentape.postmortem.fleet import UNREADABLE_ENDS, find_tapes, fleet_postmortem
    from tokentape.postmortem.fleet_report import print_fleet_report, write_fleet_report
    from tokentape.replay.tape import load_tape

    if args.since is not None or args.until is not None:
        raise CLIError(
            f"{args.tape}: --since and --until apply to a segmented tape's directory, "
            "not to a directory of tapes"
        )
    if args.ray and importlib.util.find_spec("ray") is None:
        raise CLIError("--ray needs Ray: pip install 'tokentape[ray]'")
    if args.reference is not None:
        load_tape(args.reference)  # an unreadable reference fails here, not in every worker
    with progress(len(find_tapes(args.tape)), "postmortem (tapes)", minimum=0) as update:
        report = fleet_postmortem(
            args.tape, jobs=args.jobs, use_ray=args.ray, reference=args.reference, progress=update
        )
    if args.html:
        write_fleet_report(report, args.html)
    if args.json:
        print(json.dumps(msgspec.to_builtins(report)))
    else:
        print_fleet_report(report, sys.stdout)
        if args.html:
            print(safe_text(f"report: {args.html}"))
    unreadable = [
        (name, row) for name, row in report.summary.engines.items() if row.ended in UNREADABLE_ENDS
    ]
    if unreadable:
        _, row = unreadable[0]
        more = (
            f" (and {len(unreadable) - 1} more unreadable tape(s))" if len(unreadable) > 1 else ""
        )
        raise CLIError(f"{row.tape}: {row.where}{more}")
    return EXIT_OK if report.ok else EXIT_FINDINGS


def _length_or_none(tape: Tape) -> int | None:
    try:
        return len(tape)
    except TapeError:
        return None  # a damaged tape: the pass itself reports where it breaks
