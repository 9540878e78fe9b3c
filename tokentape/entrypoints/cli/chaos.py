"""`tokentape chaos --seeds N --out DIR`: a campaign of seeded storms against tokentape's
engine with the oracle, or (`--engine vllm`) against vLLM's own scheduler."""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
        help="run seeded storms against tokentape's engine or vLLM's scheduler; keep the tape "
        "of every run with a finding",
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
            "--engine vllm drives vLLM's own Scheduler / AsyncScheduler instead, recorded, with\n"
            "the oracle's tokens standing in for the model, in vLLM's Python\n"
            "($TOKENTAPE_VLLM_PYTHON, else .venv-vllm beside the source tree; --vllm-release X:\n"
            "the overlay benchmarks/setup_vllm_venv.sh made of release X). The seed draws async\n"
            "scheduling, 0-3 n-gram drafts with rejections, KV pressure, chunked prefill over\n"
            "up to 14 requests, and commands between steps: reset_prefix_cache with and without\n"
            "running requests, pauses in every mode with and without clear_cache, aborts, and\n"
            "sleeps (levels 0-2) with wake-ups by tags, through the release's own\n"
            "EngineCore.sleep / wake_up. The recorder checks every event live; the tape then\n"
            "goes through the postmortem, the streams against the oracle's. A run whose\n"
            "requests are never scheduled again stops after 100 idle engine steps: a finding,\n"
            "with its tape. A run with a finding keeps its spec (the JSON\n"
            "tokentape.integrations.vllm.scheduler_driver reads), tape and report, and is\n"
            "shrunk (unless --no-shrink) to the smallest storm that still gives its first\n"
            "finding: DIR/vllm-REL-seedS.min.{spec.json,tape,postmortem.txt}.\n"
            "\n"
            "--vllm-releases A,B,... runs the same seeds on each release (DIR/RELEASE) and\n"
            "prints the release matrix: for every bug class found (a finding's kind where it\n"
            "names none), the seeds that showed it on each release, the first release that has\n"
            "it and the first after it that does not (DIR/matrix.json).\n"
            "\n"
            "exit status: 0 when no run has a finding, 1 when one has (expected under the\n"
            "historical policies flag and counter, and on vLLM releases with known bugs), 2 on\n"
            "bad arguments, a DIR that is not empty (without --force), or a vLLM that is missing\n"
            "or cannot run the release asked for."
        ),
        epilog=(
            "examples:\n"
            "  tokentape chaos --seeds 1000 --out chaos/ --jobs 2\n"
            "  tokentape chaos --seeds 20 --out flag/ --discard-policy flag   # findings expected\n"
            "  tokentape chaos --engine vllm --vllm-release 0.20.0 --seeds 60 --out v020/\n"
            "  tokentape chaos --engine vllm --vllm-releases 0.20.0,0.24.0,0.32.0 --seeds 60 "
            "--out matrix/\n"
            "  tokentape why v020/vllm-0.20.0-seed0.min.tape r6 19   # the step that broke"
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
        "--engine",
        choices=("tokentape", "vllm"),
        default="tokentape",
        help="what the storms drive: tokentape's engine (default) or vLLM's scheduler",
    )
    cha.add_argument(
        "--vllm-release",
        metavar="X",
        default=None,
        help="--engine vllm: the vLLM release to run (an overlay beside vLLM's venv; default "
        "the venv's own)",
    )
    cha.add_argument(
        "--vllm-releases",
        metavar="A,B,...",
        default=None,
        help="--engine vllm: run the same seeds on each release (overlays, or the venv's own "
        "version), each into DIR/RELEASE, and print the release matrix: for every class "
        "found, the seeds that showed it on each release, the first release that has it and "
        "the first after it that does not (DIR/matrix.json)",
    )
    cha.add_argument(
        "--no-shrink",
        action="store_true",
        help="--engine vllm: keep runs with findings as they are, unshrunk",
    )
    cha.add_argument(
        "--discard-policy",
        choices=sorted(DISCARD_POLICIES),
        default=None,
        help="tokentape engine: the reducer's discard policy (default epoch; flag and counter "
        "are vLLM's historical ones and break streams)",
    )
    cha.add_argument(
        "--num-commands",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokentape engine: storm commands per seed (default 2000)",
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
            if name.startswith(("chaos-", "vllm-")) or name == "chaos.json":
                from tokentape.events.sqlite_store import remove_tape_files

                remove_tape_files(os.path.join(path, name))


def cmd_chaos(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return _cmd_chaos_vllm(args)
    if args.vllm_release is not None or args.vllm_releases is not None or args.no_shrink:
        raise CLIError("--vllm-release, --vllm-releases and --no-shrink go with --engine vllm")
    from tokentape.chaos.campaign import ChaosOptions, SeedOutcome, run_campaign

    options = ChaosOptions(
        args.discard_policy or "epoch",
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


def _cmd_chaos_vllm(args: argparse.Namespace) -> int:
    from tokentape.chaos.release_matrix import ReleaseMatrix
    from tokentape.integrations.vllm.driver_process import VLLMNotFound, check_release, find_vllm

    if args.discard_policy is not None or args.num_commands is not None:
        raise CLIError(
            "--discard-policy and --num-commands go with --engine tokentape (vLLM's release "
            "decides its discard, the seed its storm)"
        )
    if args.vllm_release is not None and args.vllm_releases is not None:
        raise CLIError("--vllm-release runs one release, --vllm-releases several: give one")
    asked = [args.vllm_release]
    if args.vllm_releases is not None:
        asked = [r.strip() for r in args.vllm_releases.split(",") if r.strip()]
        if not asked or len(set(asked)) != len(asked):
            raise CLIError(f"--vllm-releases {args.vllm_releases!r}: name each release once")
    try:
        found = find_vllm()
        releases = [check_release(found, r) for r in asked]  # all of them before any seed
    except VLLMNotFound as exc:
        raise CLIError(str(exc)) from None
    _check_out_dir(args.out, args.force)
    out = Output(sys.stderr if args.json else sys.stdout)
    if args.vllm_releases is None:
        summary = _vllm_campaign(args, found, releases[0], args.out, out)
        record = summary.to_json()
        _write_json(os.path.join(args.out, "chaos.json"), record)
        if args.json:
            print(json.dumps(record))
        else:
            _print_vllm_summary(summary, record, args, args.out, out)
        return EXIT_OK if summary.runs_with_findings == 0 else EXIT_DIVERGED
    summaries = []
    for release in releases:  # each in DIR/RELEASE, as one release's campaign writes it
        folder = os.path.join(args.out, release)
        if os.path.isdir(folder) and args.force:
            shutil.rmtree(folder)
        summary = _vllm_campaign(args, found, release, folder, out)
        record = summary.to_json()
        _write_json(os.path.join(folder, "chaos.json"), record)
        if not args.json:
            _print_vllm_summary(summary, record, args, folder, out)
        summaries.append(summary)
    matrix = ReleaseMatrix.of(summaries)
    record = {
        **matrix.to_json(),
        "campaigns": [{k: v for k, v in s.to_json().items() if k != "found"} for s in summaries],
    }
    _write_json(os.path.join(args.out, "matrix.json"), record)
    any_finding = any(s.runs_with_findings for s in summaries)
    if args.json:
        print(json.dumps(record))
    else:
        first, last = matrix.seeds.start, matrix.seeds.stop - 1
        out.line(
            f"release matrix: seeds {first}-{last} on {len(releases)} releases "
            f"(the seeds that showed each class; DIR/matrix.json)",
            style="bold",
        )
        for line in matrix.table() if matrix.rows else ["  no finding on any release"]:
            out.line(line)
    return EXIT_DIVERGED if any_finding else EXIT_OK


def _write_json(path: str, record: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def _vllm_campaign(
    args: argparse.Namespace, found: Any, release: str, out_dir: str, out: Output
) -> Any:
    """One release's seeds (a VLLMCampaignSummary), each finding printed as it comes."""
    from tokentape.chaos.vllm_storms import SetupFailed, VLLMSeedOutcome, run_vllm_campaign
    from tokentape.integrations.vllm.driver_process import VLLMNotFound

    seeds = range(args.first_seed, args.first_seed + args.seeds)
    with progress(args.seeds, f"chaos: {args.seeds} seeds against vLLM {release}") as update:
        done = 0

        def seen(o: VLLMSeedOutcome) -> None:
            nonlocal done
            done += 1
            update(done)
            if not o.has_finding:
                return
            shape = (
                f"{'async' if o.asynchronous else 'sync'}, k {o.num_speculative_tokens}, "
                f"{o.num_blocks} KV blocks, {o.num_requests} requests, {o.num_commands} commands"
            )
            out.line(f"seed {o.seed} ({shape}): {o.primary} -> {o.tape}", style="yellow")
            if o.shrunk is not None:
                m = o.shrunk
                out.line(
                    f"  shrunk to {m.requests} request(s), {m.commands} command(s), {m.steps} "
                    f"steps ({m.runs} runs, {m.seconds:.1f} s): {m.spec}"
                )
                if m.why:
                    out.line(f"  tokentape why {m.tape} {m.why[0]} {m.why[1]}")

        try:
            return run_vllm_campaign(
                seeds,
                found,
                None if release == found.version else release,
                out_dir,
                args.jobs,
                not args.no_shrink,
                seen,
            )
        except (VLLMNotFound, SetupFailed) as exc:
            raise CLIError(str(exc)) from None


def _print_vllm_summary(
    summary: Any, record: dict[str, Any], args: argparse.Namespace, out_dir: str, out: Output
) -> None:
    ok = summary.runs_with_findings == 0
    out.line(
        f"chaos: {summary.num_seeds} seeds against vLLM {summary.release}'s scheduler "
        f"({args.jobs} job(s)) in {summary.wall_s:.1f} s: {summary.steps:,} engine steps, "
        f"{record['driver_steps_per_s']:,.0f} per second of driving "
        f"({summary.steps_per_s:,.0f} per second overall, vLLM's start-up, the checks and "
        "the shrinks included)",
        style="bold",
    )
    out.line(
        f"  {summary.runs_with_findings} run(s) with findings, {summary.broken_streams} "
        "streams not the oracle's",
        style="bold green" if ok else "bold red",
    )
    if summary.primaries:
        out.line(
            "  first findings: "
            + ", ".join(f"{k} x{n}" for k, n in summary.primaries.most_common())
        )
    if summary.bug_classes:
        out.line(
            "  bug classes: " + ", ".join(f"{k} x{n}" for k, n in summary.bug_classes.most_common())
        )
    if not ok:
        out.line(f"  specs, tapes and postmortem reports in {out_dir}")
