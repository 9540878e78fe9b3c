"""`tokentape generate`'s scripted engine calls: `--pause-at STEP[:MODE]`, `--reset-at STEP`
and `--abort-at STEP:ID`, turned into a tokentape.engine.scenario.Scenario."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tokentape.engine.core.call_args import PAUSE_MODES
from tokentape.engine.scenario import Abort, Pause, Reset, Scenario
from tokentape.entrypoints.cli.common import CLIError


def _step(text: str, option: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{option}: expected a step number, got {text!r}"
        ) from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"{option}: the step must be >= 0, got {step}")
    return step


def pause_at(text: str) -> Pause:
    step, _, mode = text.partition(":")
    mode = mode or "keep"
    if mode not in PAUSE_MODES:
        raise argparse.ArgumentTypeError(
            f"--pause-at {text}: MODE must be one of {', '.join(PAUSE_MODES)}, got {mode!r}"
        )
    return Pause(_step(step, "--pause-at"), mode)


def reset_at(text: str) -> Reset:
    return Reset(_step(text, "--reset-at"))


def abort_at(text: str) -> Abort:
    step, sep, req_id = text.partition(":")
    if not sep or not req_id:
        raise argparse.ArgumentTypeError(f"--abort-at {text}: expected STEP:ID, e.g. 6:1")
    return Abort(_step(step, "--abort-at"), req_id)


def add_script_arguments(parser: Any) -> None:
    group = parser.add_argument_group(
        "scripted engine calls",
        "Made when the engine is about to schedule step STEP; each may be repeated, and calls\n"
        "at the same step go in the order pauses, resets, aborts. A call whose step the run\n"
        "never reaches is not made (a warning on stderr says so). Steps of a recorded run:\n"
        "'tokentape inspect TAPE', or 'events' in 'tokentape debug'.",
    )
    group.add_argument(
        "--pause-at",
        type=pause_at,
        action="append",
        default=[],
        metavar="STEP[:MODE]",
        help="pause_generation(MODE, clear_cache=True), then resume_generation(), "
        "as an RL loop does around a weight update; MODE keep (default), wait or "
        "abort. With async scheduling and --discard-policy flag this records "
        "vLLM #42043",
    )
    group.add_argument(
        "--reset-at",
        type=reset_at,
        action="append",
        default=[],
        metavar="STEP",
        help="reset_prefix_cache(reset_running_requests=True): every running "
        "request is preempted, with its steps left in flight",
    )
    group.add_argument(
        "--abort-at",
        type=abort_at,
        action="append",
        default=[],
        metavar="STEP:ID",
        help="abort request ID (0, 1, ... in prompt order)",
    )


def scenario_of(args: argparse.Namespace) -> Scenario:
    try:
        return Scenario([*args.pause_at, *args.reset_at, *args.abort_at])
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None


def warn_pending(scenario: Scenario, steps: int) -> None:
    """One line on stderr for each scripted call the run ended before."""
    for call in scenario.pending:
        print(f"warning: no {call.describe()}: the run ended after {steps} steps", file=sys.stderr)
