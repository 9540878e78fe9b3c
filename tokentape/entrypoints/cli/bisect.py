"""`tokentape bisect A B`: the first event at which two tapes differ, by binary search."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tokentape.entrypoints.cli.common import EXIT_DIVERGED, EXIT_OK
from tokentape.replay.render import Output, describe_event


def add_parser(sub: Any) -> argparse.ArgumentParser:
    bis = sub.add_parser(
        "bisect",
        help="find the first event at which two tapes differ, in O(log n) seeks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Binary-search two tapes for the first position where their events differ, reading\n"
            "one event of each tape per probe (about log2 n of them), and print that position,\n"
            "the step and both events. The headers are compared apart (creation time and\n"
            "package version aside) and their differences listed. Where 'tokentape diff'\n"
            "compares what the clients received, bisect compares the tapes themselves.\n"
            "\n"
            "The search assumes tapes equal at a position are equal before it. Tapes can\n"
            "diverge and agree again, so the prefix before the answer is confirmed in one pass\n"
            "that SQLite runs over both files (bytes compared, nothing decoded); an earlier\n"
            "difference it finds is the answer ('re-converged'). --no-confirm skips that pass.\n"
            "\n"
            "exit status: 0 when the events are identical, 1 when they differ, 2 when a tape\n"
            "cannot be read."
        ),
        epilog="example:\n  tokentape bisect ci.tape local.tape",
    )
    bis.add_argument("a", metavar="A", help="first tape")
    bis.add_argument("b", metavar="B", help="second tape")
    bis.add_argument(
        "--no-confirm",
        action="store_true",
        help="trust the binary search: O(log n) reads, no pass over the prefix",
    )
    bis.add_argument("--json", action="store_true", help="print JSON instead of text")
    bis.set_defaults(func=cmd_bisect)
    return bis


def _event(label: str, event: Any) -> str:
    return f"  {label}: " + ("(the tape has ended)" if event is None else describe_event(event))


def cmd_bisect(args: argparse.Namespace) -> int:
    from tokentape.replay.bisect import bisect

    result = bisect(args.a, args.b, confirm=not args.no_confirm)
    status = EXIT_OK if result.identical else EXIT_DIVERGED
    if args.json:
        print(json.dumps(result.to_json()))
        return status
    out = Output(sys.stdout)
    how = (
        f"{result.seeks} probes"
        + ("" if result.confirmed else ", prefix not confirmed")
        + (
            ", the tapes re-converged after it: found by the confirming pass"
            if result.reconverged
            else ""
        )
    )
    if result.identical:
        out.line(f"identical: {result.len_a} events in both tapes ({how})", style="bold green")
    else:
        step_a = result.event_a.step if result.event_a is not None else "-"
        step_b = result.event_b.step if result.event_b is not None else "-"
        out.line(
            f"DIFFERENT at event {result.index} (step {step_a} in A, {step_b} in B; {how})",
            style="bold red",
        )
        out.line(_event(f"A {args.a}", result.event_a))
        out.line(_event(f"B {args.b}", result.event_b))
        out.line(f"  identical before it; A has {result.len_a} events, B {result.len_b}")
    for line in result.header_differences:
        out.line(f"header differs: {line}", style="yellow")
    out.flush()
    return status
