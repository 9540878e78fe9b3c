"""The replay subcommands of the `tokentape` CLI: debug, diff, replay whatif, export.

`tokentape.cli.build_parser` calls `add_commands`; each command's work is in its own module.
Expected failures raise `tokentape.cli.CLIError` (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_commands(sub: Any, replay_sub: Any) -> None:
    """Register `debug`, `diff` and `export` under `sub`, and `whatif` under `replay_sub`."""
    dbg = sub.add_parser(
        "debug",
        help="step through a tape, forwards and backwards (pdb-style)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "An interactive debugger over a recorded tape: move (step, back, goto, next,\n"
            "continue, reverse-continue), set breakpoints (on an event kind, a request or a\n"
            "condition over the derived state), and look (print, requests, events, where,\n"
            "diff, watch). Commands are read from stdin, so a session can be scripted.\n"
            "Type 'help' inside for every command."
        ),
        epilog=(
            "examples:\n"
            "  tokentape debug run.tape\n"
            "  printf 'break discard > 0\\ncontinue\\nprint req 0\\n' | tokentape debug run.tape"
        ),
    )
    dbg.add_argument("tape", metavar="TAPE", help="tape file to debug")
    dbg.add_argument("--snapshot-interval", type=int, default=None, metavar="K",
                     help="keep a state snapshot every K events (default: 4096)")
    dbg.set_defaults(func=cmd_debug)


def _open(path: str, interval: int | None = None) -> Any:
    from tokentape.events.sqlite_store import SQLiteTapeReader
    from tokentape.replay.snapshots import DEFAULT_INTERVAL
    from tokentape.replay.tape import Tape

    if interval is not None and interval < 1:
        from tokentape.cli import CLIError

        raise CLIError(f"--snapshot-interval must be >= 1, got {interval}")
    return Tape(SQLiteTapeReader(path), interval or DEFAULT_INTERVAL)


def cmd_debug(args: argparse.Namespace) -> int:
    from tokentape.replay.debugger import run_debugger

    run_debugger(_open(args.tape, args.snapshot_interval), sys.stdin, sys.stdout)
    return 0
