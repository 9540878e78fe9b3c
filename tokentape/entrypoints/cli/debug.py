"""`tokentape debug TAPE`: the pdb-style debugger over a tape (tokentape.replay.debugger),
reading commands from a terminal or a script on stdin."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tokentape.entrypoints.cli.common import EXIT_OK, CLIError, positive_int
from tokentape.entrypoints.cli.tape_source import TAPE_OR_DIR, add_tape_source, open_tape


def add_parser(sub: Any) -> argparse.ArgumentParser:
    dbg = sub.add_parser(
        "debug",
        help="step through a tape, forwards and backwards (pdb-style)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "An interactive debugger over a recorded tape: move (step, back, goto, next,\n"
            "continue, reverse-continue), set breakpoints (on an event kind, a request or a\n"
            "condition over the derived state), and look (print, requests, events, where,\n"
            "diff, watch). Commands are read from stdin, so a session can be scripted.\n"
            "Type 'help' inside for every command.\n"
            "\n"
            "exit status: 0, or 2 when a command failed (its error is printed as 'error: ...')\n"
            "or the tape cannot be opened."
        ),
        epilog=(
            "examples:\n"
            "  tokentape debug run.tape\n"
            "  printf 'break discard > 0\\ncontinue\\nprint req 0\\n' | tokentape debug run.tape"
        ),
    )
    add_tape_source(dbg, f"the {TAPE_OR_DIR}, to debug")
    dbg.add_argument(
        "--snapshot-interval",
        type=positive_int,
        default=None,
        metavar="K",
        help="keep a state snapshot every K events (default: 2048)",
    )
    dbg.set_defaults(func=cmd_debug)
    return dbg


def cmd_debug(args: argparse.Namespace) -> int:
    from tokentape.replay.debugger import run_debugger

    errors = run_debugger(open_tape(args, args.snapshot_interval), sys.stdin, sys.stdout)
    if errors:  # shown in the session already; one line on stderr for scripts, and exit 2
        failed = (
            "1 debugger command failed"
            if len(errors) == 1
            else f"{len(errors)} debugger commands failed"
        )
        raise CLIError(f"{failed}; the first: {errors[0]}")
    return EXIT_OK
