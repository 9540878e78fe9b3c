"""`tokentape chaos --seeds N --out DIR`: a campaign of seeded storms against the oracle."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tokentape.entrypoints.cli.common import (
    EXIT_DIVERGED,
    EXIT_OK,
    CLIError,
    add_force_argument,
    non_negative_int,
    positive_int,
)
from tokentape.progress import progress
from tokentape.replay.render import Output


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from tokentape.events.discard import DISCARD_POLICIES

    cha = sub.add_parser(
        "chaos",
        help="run seeded storms against the oracle; keep the tape of every run with a finding",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run one storm per seed with the oracle model: the seed draws the pipeline depth\n"
            "(1-4), speculative tokens (0-3), preemption pressure (a KV cache of 12-32 blocks,\n"
            "2-8 running requests, a token budget of 8-32) and a storm of adds, aborts (one, or\n"
            "all), prefix-cache resets, pauses in every mode, resumes, sleeps at every level and\n"
            "wake-ups of every tag. Each run is checked: every request's stream against the\n"
            "oracle's, and the tape by the postmortem. A run with a finding (a broken stream, a\n"
            "postmortem finding, a hang or an engine failure) keeps its tape and postmortem\n"
            "report (text and JSON) in DIR; DIR/chaos.json sums up.\n"
            "The same seed always replays the same run.\n"
            "\n"
            "exit status: 0 when no run has a finding, 1 when one has (expected under the\n"
            "historical policies flag and counter), 2 on bad arguments or a DIR that is not empty\n"
            "(without --force)."
        ),
        epilog=(
            "examples:\n"
            "  tokentape chaos --seeds 1000 --out chaos/ --jobs 2\n"
            "  tokentape chaos --seeds 20 --out flag/ --discard-policy flag   # findings expected"
        ),
    )
    cha.add_argument("--seeds", type=positive_int, required=True, metavar="N", help="seeds to run")
    cha.add_argument(
        "--first-seed",
        type=non_negative_int,
        default=0,
        metavar="S",
        help="the first seed (default 0): seeds S..S+N-1",
    )
    cha.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="directory for the tapes and reports of runs with a finding (created)",
    )
    cha.add_argument(
        "--discard-policy",
        choices=sorted(DISCARD_POLICIES),
        default="epoch",
        help="the reducer's discard policy (default epoch; flag and counter are "
        "vLLM's historical ones and break streams)",
    )
    cha.add_argument(
        "--num-commands",
        type=positive_int,
        default=None,
        metavar="N",
        help="storm commands per seed (default 2000)",
    )
    cha.add_argument(
        "--jobs", type=positive_int, default=1, metavar="J", help="worker processes (default 1)"
    )
    cha.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_force_argument(cha, "DIR that is not empty")
    cha.set_defaults(func=cmd_chaos)
    return cha


def _check_out_dir(path: str, force: bool) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise CLIError(f"{path}: --out names a file; give a directory")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise CLIError(
            f"{path}: the directory is not empty; pass --force to write into it, "
            "or choose another with --out"
        )
    if os.path.isdir(path) and force:
        for name in os.listdir(path):  # what an earlier campaign kept would read as this one's
            if name.startswith("chaos-") or name == "chaos.json":
                from tokentape.events.sqlite_store import remove_tape_files

                remove_tape_files(os.path.join(path, name))


def cmd_chaos(args: argparse.Namespace) -> int:
    from tokentape.chaos.campaign import ChaosOptions, SeedOutcome, run_campaign

    options = ChaosOptions(
        args.discard_policy,
        **({"num_commands": args.num_commands} if args.num_commands is not None else {}),
    )
    _check_out_dir(args.out, args.force)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    out = Output(sys.stderr if args.json else sys.stdout)
    with progress(args.seeds, f"chaos: {args.seeds} seeds") as update:
        done = 0

        def seen(o: SeedOutcome) -> None:
            nonlocal done
            done += 1
            update(done)
            if o.has_finding:
                what = o.error or (
                    f"{o.broken_streams} broken streams, findings "
                    + ", ".join(f"{k} x{n}" for k, n in sorted(o.finding_kinds.items()))
                )
                out.line(
                    f"seed {o.seed} (depth {o.pipeline_depth}, k {o.num_speculative_tokens}, "
                    f"{o.num_kv_blocks} KV blocks): {what} -> {o.tape}",
                    style="yellow",
                )

        summary = run_campaign(seeds, options, args.out, args.jobs, seen)
    record = summary.to_json()
    with open(os.path.join(args.out, "chaos.json"), "w") as f:
        json.dump(record, f, indent=1)
    if args.json:
        print(json.dumps(record))
    else:
        ok = summary.runs_with_findings == 0
        out.line(
            f"chaos: {summary.num_seeds} seeds (policy {options.discard_policy}, "
            f"{options.num_commands} commands each, {args.jobs} job(s)) in "
            f"{summary.wall_s:.1f} s: {summary.seeds_per_hour:,.0f} seeds/hour "
            f"({summary.seeds_per_cpu_hour:,.0f} per CPU-hour of one core)",
            style="bold",
        )
        out.line(
            f"  {summary.events:,} events, {summary.preemptions:,} preemptions, "
            f"{summary.resets:,} prefix-cache resets"
        )
        out.line(
            f"  {summary.runs_with_findings} run(s) with findings, {summary.broken_streams} "
            f"broken streams, {summary.errors} hangs or failures",
            style="bold green" if ok else "bold red",
        )
        if summary.bug_classes:
            out.line(
                "  bug classes: "
                + ", ".join(f"{k} x{n}" for k, n in summary.bug_classes.most_common())
            )
        if not ok:
            out.line(f"  tapes and postmortem reports in {args.out}")
    return EXIT_OK if summary.runs_with_findings == 0 else EXIT_DIVERGED
