"""`tokentape replay verify|whatif TAPE`: check that a tape reproduces, or re-run its recorded
commands under another configuration and diff the outputs."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tokentape.engine.arg_utils import add_engine_cli_args
from tokentape.entrypoints.cli.common import (
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_OK,
    add_force_argument,
    check_output_path,
    new_tape_path,
    remove_for_overwrite,
)
from tokentape.entrypoints.cli.diff import print_diff
from tokentape.entrypoints.cli.tape_source import TAPE_OR_DIR, add_tape_source, open_tape
from tokentape.progress import progress
from tokentape.replay.render import safe_text


def add_parser(sub: Any) -> argparse.ArgumentParser:
    replay = sub.add_parser(
        "replay",
        help="replay a recorded tape (verify, whatif)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay a recorded tape. See 'tokentape replay verify --help' and\n"
        "'tokentape replay whatif --help'.",
    )
    replay_sub = replay.add_subparsers(dest="replay_command", metavar="COMMAND")
    _add_verify(replay_sub)
    _add_whatif(replay_sub)

    def missing_subcommand(args: argparse.Namespace) -> int:
        replay.print_help(sys.stderr)
        return EXIT_ERROR

    replay.set_defaults(func=missing_subcommand)
    return replay


def _add_verify(replay_sub: Any) -> None:
    ver = replay_sub.add_parser(
        "verify",
        help="check that the scheduler reproduces every recorded event",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Re-run the scheduler against the tape's recorded frames (no model needed) and\n"
            "check that every event it emits equals the recorded one.\n"
            "\n"
            "A tape recorded from vLLM (tokentape.integrations.vllm; its header says source\n"
            "vllm) cannot be re-run on tokentape's scheduler: its recorded decisions are\n"
            "folded under its discard policy instead, and every derived fact (positions,\n"
            "epochs, budgets, preemptions, finishes, what each client was given) is checked\n"
            "against the recorded frames and outputs; the output says so.\n"
            "\n"
            "exit status: 0 when every event reproduces ('ok: N events reproduced'),\n"
            "1 at the first divergence (printed with the recorded events around it),\n"
            "2 when the tape cannot be read."
        ),
    )
    add_tape_source(ver, f"the {TAPE_OR_DIR}, to verify")
    ver.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from tokentape.replay import verify

    tape = open_tape(args)
    with progress(len(tape), "verifying") as update:
        result = verify(tape, update)
    done = "reproduced" if result.statement is None else "consistent"
    if result.ok:
        line = f"ok: {result.num_events} events {done}"
        if result.ended_with_error:
            line += f" (the recorded run stopped on an engine error: {result.ended_with_error})"
        if result.recording_stopped:
            line += f" (the recording stopped there, the run went on: {result.recording_stopped})"
        print(safe_text(line))
        if result.statement is not None:
            print(safe_text(result.statement))
        return EXIT_OK
    print(
        safe_text(
            f"FAILED: {args.tape} does not "
            f"{'reproduce' if result.statement is None else 'check out'} "
            f"({result.num_events} events {done})"
        )
    )
    if result.statement is not None:
        print(safe_text(result.statement))
    if result.first_divergence is not None:
        print(safe_text(result.first_divergence.format()))
    return EXIT_DIVERGED


def _add_whatif(replay_sub: Any) -> None:

    wi = replay_sub.add_parser(
        "whatif",
        help="re-run the recorded commands under another configuration and diff the outputs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Re-issue the tape's recorded commands (adds, aborts, pauses, resumes, prefix-cache\n"
            "resets, weight updates) at the same steps to a fresh engine configured as the tape's\n"
            "header says, with the changes given; record the new run on a new tape and print\n"
            "its diff against the original. It replays with the runner that recorded the tape\n"
            "(the model the header names; the oracle for an oracle tape) unless --runner says.\n"
            "\n"
            "exit status: 0 when the client-visible outputs are identical, 1 when they differ,\n"
            "2 on an error (unreadable tape, bad configuration, a model that cannot be built)."
        ),
        epilog=(
            "examples:\n"
            "  tokentape replay whatif flag.tape --discard-policy epoch\n"
            "  tokentape replay whatif run.tape --pipeline-depth 1 --out sync.tape\n"
            "  tokentape replay whatif run.tape --runner oracle"
        ),
    )
    add_tape_source(wi, f"the recorded {TAPE_OR_DIR}")
    # The engine flags a what-if may change (arg_utils.py), the tape's when not given.
    add_engine_cli_args(
        wi, ("discard_policy", "pipeline_depth"), model=False, seed=False, default_of="the tape's"
    )
    wi.add_argument(
        "--runner",
        default=None,
        choices=["oracle", "model"],
        help="what computes the tokens: oracle (the fake model) or model (the real one "
        "the header names; tiny for an oracle tape) (default: the runner that "
        "recorded the tape)",
    )
    wi.add_argument(
        "--out",
        metavar="PATH",
        default=None,
        help="the new tape; an existing file is refused unless --force "
        "(default: TAPE's name with -whatif, numbered to be new)",
    )
    add_force_argument(wi, "--out tape")
    wi.set_defaults(func=cmd_whatif)


def cmd_whatif(args: argparse.Namespace) -> int:
    from tokentape.replay.whatif import whatif, whatif_config

    tape = open_tape(args)
    # A bad configuration fails before --force removes anything.
    whatif_config(tape, args.discard_policy, args.pipeline_depth, args.runner)
    if args.out is None:
        out = new_tape_path(os.path.normpath(args.tape).removesuffix(".tape") + "-whatif")
    else:
        out = args.out
        if check_output_path(out, args.force, "--out", [args.tape]):
            remove_for_overwrite(out)
    result = whatif(
        tape,
        discard_policy=args.discard_policy,
        pipeline_depth=args.pipeline_depth,
        runner=args.runner,
        out=out,
    )
    c = result.config
    print(
        safe_text(
            f"what-if: discard policy {c.discard_policy}, pipeline depth "
            f"{c.effective_pipeline_depth}, model {c.model}; new tape {out} "
            f"({len(result.tape)} events)"
        )
    )
    for note in result.notes:
        print(safe_text(f"note: {note}"))
    print_diff(result.diff.format())
    return EXIT_OK if result.diff.identical else EXIT_DIVERGED
