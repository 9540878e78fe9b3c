"""`tokentape inspect TAPE`: the state folded from a tape (no scheduler, no model), at its end
or at a step: the header, the engine-level state, one row per request, or one request in
full; rich tables on a terminal, plain text when piped, or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tokentape.entrypoints.cli.common import EXIT_OK, CLIError, non_negative_int, one_line
from tokentape.entrypoints.cli.tape_source import TAPE_OR_DIR, add_tape_source, open_tape
from tokentape.progress import progress
from tokentape.replay.render import REQUEST_COLUMNS, plural, request_row, state_view
from tokentape.replay.summaries import engine_summary, header_summary, request_detail


def add_parser(sub: Any) -> argparse.ArgumentParser:
    insp = sub.add_parser(
        "inspect",
        help="show the state derived from a tape",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Fold a tape into state (no scheduler, no model) and print it: the header,\n"
            "the engine-level state and one row per request. Tables are drawn with rich on\n"
            "a terminal and printed as plain text when stdout is piped. A step the tape does\n"
            "not schedule is an error (exit 2) that names the steps it has."
        ),
        epilog=(
            "examples:\n"
            "  tokentape inspect run.tape\n"
            "  tokentape inspect run.tape --step 10\n"
            "  tokentape inspect run.tape --request 0 --json"
        ),
    )
    add_tape_source(insp, f"the {TAPE_OR_DIR}, to inspect")
    insp.add_argument(
        "--step",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="show the state at step N (after it was scheduled, before step N+1) "
        "instead of at the end of the tape",
    )
    insp.add_argument(
        "--request",
        metavar="ID",
        default=None,
        help="show one request's full derived state, output token ids included",
    )
    insp.add_argument("--json", action="store_true", help="print JSON instead of tables")
    insp.set_defaults(func=cmd_inspect)
    return insp


def _locate_fold_failure(tape: Any, exc: BaseException) -> str:
    """Fold again, event by event, to name the event the reducer refused."""
    from tokentape.events.fold_errors import FOLD_ERRORS, event_refused
    from tokentape.events.reducer import evolve

    state = tape.initial_state()
    for seq, event in tape.events():
        try:
            evolve(state, event)
        except FOLD_ERRORS as inner:  # now with its position
            return f"{tape.path}: the tape is inconsistent: {event_refused(seq, event, inner)}"
    return f"{tape.path}: the tape is inconsistent: {one_line(exc)}"


def _fold(tape: Any, step: int | None) -> Any:
    from tokentape.events.fold_errors import FOLD_ERRORS

    try:
        with progress(len(tape), "folding the tape") as update:
            if step is None:
                return tape.fold(progress=update)
            try:
                return tape.at(step, progress=update)
            except IndexError as exc:
                raise CLIError(f"{tape.path}: {exc}") from None
    except FOLD_ERRORS as exc:
        # The events cannot follow each other (a damaged or hand-edited tape).
        raise CLIError(_locate_fold_failure(tape, exc)) from None


def cmd_inspect(args: argparse.Namespace) -> int:
    tape = open_tape(args)
    num_events = len(tape)
    state = _fold(tape, args.step)
    where = "at the end of the tape" if args.step is None else f"at step {args.step}"

    if args.request is not None:
        req = state.requests.get(args.request)
        if req is None:
            known = list(state.requests)
            listed = ", ".join(map(repr, known[:10])) + (", ..." if len(known) > 10 else "")
            raise CLIError(
                f"{args.tape}: no request {args.request!r} {where} "
                f"({plural(len(known), 'request')}{': ' + listed if known else ''})"
            )
        detail = request_detail(state, req)
        if args.json:
            print(json.dumps({"tape": tape.path, "step": args.step, "request": detail}))
            return EXIT_OK
        state_view(sys.stdout).section(f"request {req.req_id!r} {where}", detail)
        return EXIT_OK

    if args.json:
        import msgspec

        record = {
            "tape": tape.path,
            "num_events": num_events,
            "step": args.step,
            "header": msgspec.to_builtins(tape.header),
            "engine": {
                "step": state.step,
                "paused": state.paused,
                "waiting": list(state.waiting),
                "running": list(state.running),
                "in_flight_steps": [s.step for s in state.in_flight_steps],
                "num_prefix_cache_resets": state.num_prefix_cache_resets,
                "weights_id": state.weights_id,
                "loras": {i: a.lora_name for i, a in state.loras.items()},
                "num_events": state.num_events,
                "error": state.error,
            },
            "requests": [
                dict(zip(REQUEST_COLUMNS, request_row(state, r))) for r in state.requests.values()
            ],
        }
        print(json.dumps(record))
        return EXIT_OK

    view = state_view(sys.stdout)
    view.section("tape", header_summary(tape, num_events))
    view.section(f"engine state {where}", engine_summary(state))
    view.table(
        f"requests ({len(state.requests)})",
        REQUEST_COLUMNS,
        [request_row(state, r) for r in state.requests.values()],
    )
    return EXIT_OK
