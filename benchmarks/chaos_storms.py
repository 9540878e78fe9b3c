"""The chaos storms at scale: seeded storms (tokentape/chaos/storms.py) of adds, pauses in
every mode, resumes, prefix-cache resets with and without running requests, aborts and KV
pressure, each checked against the oracle's stream and by the postmortem (which runs verify's
consistency checks too).

- `--policy epoch` (default): seed s runs at pipeline depth 1 + s % 4 with (s // 4) % 4
  speculative tokens, so 1,000 seeds cover the 16 combinations evenly. Every request must get
  exactly the oracle's stream and the postmortem must find nothing (the target: 0 false
  findings of any kind over 1,000 seeds). Exit status 1 otherwise.
- `--grid`: every (policy, depth 1-4, speculative 0-3) combination for each seed. Under
  `counter` and `flag` a stream may break; every broken stream must then have an error
  finding naming the request and a bug class. Exit status 1 when one has not.

Runs with a finding (or an unexplained broken stream) are listed with their seed, so
`run_storm(StormSpec(seed=..., ...))` reproduces them; `--keep DIR` also writes their tapes.

    python benchmarks/chaos_storms.py --seeds 1000
    python benchmarks/chaos_storms.py --seeds 20 --grid
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace

from tokentape.chaos import StormResult, StormSpec, run_storm, storm_grid
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape


def epoch_specs(seeds: range, base: StormSpec) -> Iterator[StormSpec]:
    for seed in seeds:
        yield replace(
            base, seed=seed, pipeline_depth=1 + seed % 4, num_speculative_tokens=(seed // 4) % 4
        )


def keep(result: StormResult, directory: str) -> str:
    """Write a storm's in-memory tape out as an SQLite tape file."""
    s = result.spec
    path = os.path.join(
        directory,
        f"storm-{s.discard_policy}-d{s.pipeline_depth}-k{s.num_speculative_tokens}"
        f"-seed{s.seed}.tape",
    )
    if os.path.exists(path):
        os.remove(path)
    tape = load_tape(result.tape)
    out = SQLiteTape(path, tape.header)
    for _, event in tape.events():
        out.append(event)
    out.close()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=1000, help="seeds to run (default: 1000)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument(
        "--grid",
        action="store_true",
        help="every policy x depth x speculative combination for each seed",
    )
    parser.add_argument(
        "--num-commands",
        type=int,
        default=StormSpec(seed=0).num_commands,
        help="commands per storm (default: %(default)s)",
    )
    parser.add_argument(
        "--keep", metavar="DIR", default=None, help="write the tapes of failing runs here"
    )
    parser.add_argument(
        "--json", metavar="PATH", default=None, help="also write the figures as JSON"
    )
    args = parser.parse_args(argv)

    base = StormSpec(seed=0, num_commands=args.num_commands)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    specs = storm_grid(seeds, base=base) if args.grid else epoch_specs(seeds, base)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)

    totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    classes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    start = time.perf_counter()
    for n, spec in enumerate(specs, 1):
        result = run_storm(spec)
        report = postmortem(result.tape)
        policy = spec.discard_policy
        t = totals[policy]
        t["runs"] += 1
        t["events"] += result.num_events
        t["steps"] += result.num_steps
        t["requests"] += len(result.expected)
        t["preemptions"] += result.num_preemptions
        t["resets"] += result.num_resets
        t["findings"] += len(report.findings)
        t["runs with findings"] += bool(report.findings)
        for f in report.findings:
            kinds[policy][f.kind] += 1
            if f.bug_class:
                classes[policy][f.bug_class] += 1
        wrong = result.oracle_violations()
        t["broken streams"] += len(wrong)
        named: dict[str, set[str | None]] = collections.defaultdict(set)
        for f in report.findings:
            if f.severity == "error":
                for r in f.request_ids:
                    named[r].add(f.bug_class)
        unexplained = [r for r in wrong if not named[r] - {None}]
        t["unexplained broken streams"] += len(unexplained)
        failed = (policy == "epoch" and (wrong or report.findings)) or unexplained
        if failed:
            where = f" (tape {keep(result, args.keep)})" if args.keep else ""
            failures.append(
                f"{policy} depth {spec.pipeline_depth} k {spec.num_speculative_tokens} seed "
                f"{spec.seed}: {len(wrong)} broken streams ({len(unexplained)} unexplained), "
                f"findings {sorted({f.kind for f in report.findings})}{where}"
            )
        if n % 100 == 0:
            print(f"  {n} runs, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    wall = time.perf_counter() - start

    print(
        f"chaos storms: {sum(t['runs'] for t in totals.values())} runs, "
        f"{args.num_commands} commands each, seeds {seeds.start}..{seeds.stop - 1}"
        f"{' (full grid)' if args.grid else ''}, {wall:.1f} s wall"
    )
    columns = (
        "runs",
        "events",
        "steps",
        "requests",
        "preemptions",
        "resets",
        "findings",
        "runs with findings",
        "broken streams",
        "unexplained broken streams",
    )
    print("| policy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for policy, t in totals.items():
        print(f"| {policy} | " + " | ".join(f"{t[c]:,}" for c in columns) + " |")
    for policy in totals:
        if kinds[policy]:
            print(f"{policy} findings by kind: {dict(kinds[policy].most_common())}")
        if classes[policy]:
            print(f"{policy} findings by bug class: {dict(classes[policy].most_common())}")
    for line in failures:
        print(f"FAILED: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "wall_s": wall,
                    "totals": totals,
                    "kinds": kinds,
                    "classes": classes,
                    "failures": failures,
                },
                f,
                indent=2,
            )
    print("result: " + ("PASS" if not failures else f"FAIL ({len(failures)} runs)"))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
