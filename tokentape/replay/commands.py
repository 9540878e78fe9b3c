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
    dbg.add_argument("tape", metavar="TAPE", help="tape file to debug")
    from tokentape.cli import _positive_int

    dbg.add_argument("--snapshot-interval", type=_positive_int, default=None, metavar="K",
                     help="keep a state snapshot every K events (default: 2048)")
    dbg.set_defaults(func=cmd_debug)
    _add_diff_and_export(sub)
    _add_whatif(replay_sub)


def _open(path: str, interval: int | None = None) -> Any:
    from tokentape.events.sqlite_store import SQLiteTapeReader
    from tokentape.replay.snapshots import DEFAULT_INTERVAL
    from tokentape.replay.tape import Tape

    return Tape(SQLiteTapeReader(path), interval or DEFAULT_INTERVAL)


def cmd_debug(args: argparse.Namespace) -> int:
    from tokentape.cli import CLIError
    from tokentape.replay.debugger import run_debugger

    errors = run_debugger(_open(args.tape, args.snapshot_interval), sys.stdin, sys.stdout)
    if errors:  # shown in the session already; one line on stderr for scripts, and exit 2
        raise CLIError(f"{len(errors)} debugger command(s) failed; the first: {errors[0]}")
    return 0


def _add_diff_and_export(sub: Any) -> None:
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
    dif.add_argument("a", metavar="A", help="first tape")
    dif.add_argument("b", metavar="B", help="second tape")
    dif.set_defaults(func=cmd_diff)

    exp = sub.add_parser(
        "export",
        help="write a tape as Perfetto trace JSON, JSON lines, CSV, or a single-file copy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "perfetto: Chrome trace-event JSON for ui.perfetto.dev: one track per request with\n"
            "  slices for its phases (waiting, prefill, decode, preempted, paused) and instants\n"
            "  for preemptions, discarded frames and its finish; an engine track with the\n"
            "  prefix-cache resets, pauses and resumes. 1 us on the clock = one tape event.\n"
            "jsonl: one event per line ({\"seq\", \"kind\", fields}), for jq.\n"
            "csv: one row per engine step.\n"
            "sqlite: a copy of the tape as one self-contained file (needs -o), taken as one\n"
            "  consistent snapshot, so it works while the tape is being written: the copy ends\n"
            "  at a step boundary and is itself a tape (it verifies, stays append-only)."
        ),
        epilog=(
            "examples:\n"
            "  tokentape export run.tape --format perfetto -o run.trace.json\n"
            "  tokentape export run.tape --format jsonl | jq 'select(.kind == \"RequestPreempted\")'\n"
            "  tokentape export live.tape --format sqlite -o snapshot.tape"
        ),
    )
    exp.add_argument("tape", metavar="TAPE", help="tape file to export")
    exp.add_argument("--format", required=True, choices=["perfetto", "jsonl", "csv", "sqlite"],
                     help="output format")
    exp.add_argument("--output", "-o", metavar="FILE", default=None,
                     help="write to FILE (never overwritten) instead of stdout (sqlite: required)")
    exp.set_defaults(func=cmd_export)


def _add_whatif(replay_sub: Any) -> None:
    from tokentape.cli import _positive_int
    from tokentape.events.discard import DISCARD_POLICIES

    wi = replay_sub.add_parser(
        "whatif",
        help="re-run the recorded commands under another configuration and diff the outputs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Re-issue the tape's recorded commands (adds, aborts, pauses, resumes, prefix-cache\n"
            "resets, weight updates) at the same steps to a fresh engine configured as the tape's\n"
            "header says, with the changes given; record the new run on a new tape and print\n"
            "its diff against the original.\n"
            "\n"
            "exit status: 0 when the client-visible outputs are identical, 1 when they differ,\n"
            "2 on an error (unreadable tape, bad configuration, unknown runner)."
        ),
        epilog=(
            "examples:\n"
            "  tokentape replay whatif flag.tape --discard-policy epoch\n"
            "  tokentape replay whatif run.tape --pipeline-depth 1 --out sync.tape"
        ),
    )
    wi.add_argument("tape", metavar="TAPE", help="the recorded tape")
    wi.add_argument("--discard-policy", choices=list(DISCARD_POLICIES), default=None,
                    help="discard policy for the new run (default: the tape's)")
    wi.add_argument("--pipeline-depth", type=_positive_int, default=None, metavar="N",
                    help="steps in flight for the new run, 1 = synchronous (default: the tape's)")
    wi.add_argument("--runner", default=None, choices=["oracle", "model"],
                    help="what computes the tokens: oracle (the fake model) or model (the real one "
                    "the header names; tiny for an oracle tape) (default: the runner that "
                    "recorded the tape)")
    wi.add_argument("--out", metavar="PATH", default=None,
                    help="the new tape (default: TAPE's name with -whatif, never overwritten)")
    wi.set_defaults(func=cmd_whatif)


def _print_diff(text: str) -> None:
    """A diff report, coloured on a terminal (plain text when piped)."""
    from tokentape.replay.render import Output

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


def cmd_diff(args: argparse.Namespace) -> int:
    from tokentape.replay.diff import diff
    from tokentape.replay.render import progress

    a, b = _open(args.a), _open(args.b)
    with progress(2 * (len(a) + len(b)), "checking and reading the tapes") as update:
        result = diff(a, b, update)
    _print_diff(result.format())
    return 0 if result.identical else 1


def cmd_export(args: argparse.Namespace) -> int:
    import os

    from tokentape.cli import CLIError
    from tokentape.replay.export import export, export_sqlite
    from tokentape.replay.render import progress

    if args.output is not None and os.path.exists(args.output):
        raise CLIError(f"{args.output}: the file exists; choose a new path with --output")
    if args.format == "sqlite":
        if args.output is None:
            raise CLIError("--format sqlite writes a file: give its path with --output")
        n = export_sqlite(args.tape, args.output)
        print(f"wrote {args.output} ({n} events)", file=sys.stderr)
        return 0
    tape = _open(args.tape)
    with progress(len(tape), f"exporting {args.format}") as update:
        if args.output is None:
            export(tape, args.format, sys.stdout, update)
        else:
            try:
                with open(args.output, "x", encoding="utf-8", newline="") as f:
                    export(tape, args.format, f, update)
            except BaseException:
                os.remove(args.output)  # no partial export left behind to block the rerun
                raise
            print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _default_whatif_path(tape: str) -> str:
    import os

    stem = tape.removesuffix(".tape")
    path, n = f"{stem}-whatif.tape", 1
    while os.path.exists(path):
        n += 1
        path = f"{stem}-whatif-{n}.tape"
    return path


def cmd_whatif(args: argparse.Namespace) -> int:
    from tokentape.replay.render import safe_text
    from tokentape.replay.whatif import whatif

    out = args.out if args.out is not None else _default_whatif_path(args.tape)
    result = whatif(_open(args.tape), discard_policy=args.discard_policy,
                    pipeline_depth=args.pipeline_depth, runner=args.runner, out=out)
    c = result.config
    print(safe_text(f"what-if: discard policy {c.discard_policy}, pipeline depth "
                    f"{c.effective_pipeline_depth}, model {c.model}; new tape {out} "
                    f"({len(result.tape)} events)"))
    for note in result.notes:
        print(safe_text(f"note: {note}"))
    _print_diff(result.diff.format())
    return 0 if result.diff.identical else 1
