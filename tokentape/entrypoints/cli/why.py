"""`tokentape why TAPE REQUEST POSITION`: the chain of events behind one output token."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tokentape.entrypoints.cli.common import EXIT_OK, CLIError, non_negative_int
from tokentape.entrypoints.cli.tape_source import TAPE_OR_DIR, add_tape_source, open_tape
from tokentape.replay.render import Output, safe_text

_STYLES = {
    "produced": "green",
    "delivered": "green",
    "dropped": "bold red",
    "ignored": "yellow",
    "preempted": "yellow",
    "finished": "bold",
}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    why = sub.add_parser(
        "why",
        help="explain one output token of a request: who scheduled, produced, dropped, "
        "delivered it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "For output position POSITION (from 0) of request REQUEST, print the chain of\n"
            "events behind it: the step that scheduled it and the position it computed it for,\n"
            "the frame that produced it and its epoch, every discard decision that touched the\n"
            "position (frames dropped by the discard policy, stale frames, the preemptions in\n"
            "between), and the OutputsEmitted that delivered it; for a token that never came,\n"
            "why not. Only the request's own events are read, found by seeks; the first call on\n"
            "a finished tape builds a request index once (cached under\n"
            "$XDG_CACHE_HOME/tokentape/why, never beside the tape).\n"
            "\n"
            "exit status: 0 with an answer (delivered or not), 2 when the tape cannot be read,\n"
            "has no such request, or the position is past the request's max_tokens."
        ),
        epilog=(
            "examples:\n"
            "  tokentape why flag.tape 0 4          # the shifted token of vLLM #42043\n"
            "  tokentape why run.tape req-7 0 --json"
        ),
    )
    add_tape_source(why, f"the {TAPE_OR_DIR}")
    why.add_argument("request", metavar="REQUEST", help="request id")
    why.add_argument(
        "position",
        metavar="POSITION",
        type=non_negative_int,
        help="output position, counted from 0",
    )
    why.add_argument("--json", action="store_true", help="print JSON instead of text")
    why.set_defaults(func=cmd_why)
    return why


def cmd_why(args: argparse.Namespace) -> int:
    from tokentape.events.fold_errors import FOLD_ERRORS
    from tokentape.replay.why import WhyError, why

    tape = open_tape(args)
    try:
        result = why(tape, args.request, args.position)
    except WhyError as exc:
        raise CLIError(str(exc)) from None
    except FOLD_ERRORS as exc:  # the request's events cannot follow each other
        raise CLIError(
            f"{args.tape}: the tape is inconsistent for request {args.request!r}: {exc}"
        ) from None
    if args.json:
        print(json.dumps(result.to_json()))
        return EXIT_OK
    out = Output(sys.stdout)
    verdict, _, rest = result.format().partition("\n")
    out.line(safe_text(verdict), style="bold")
    for line in rest.splitlines():
        role = line.split()[3] if line.startswith("  @") and len(line.split()) > 3 else ""
        out.line(safe_text(line), style=_STYLES.get(role))
    out.flush()
    return EXIT_OK
