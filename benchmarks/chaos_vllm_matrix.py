"""The release matrix of docs/postmortem.md: the same chaos seeds against vLLM's own scheduler
on every release from 0.20.0 to 0.34.0, each finding shrunk, and for every bug class the first
release that has it and the first after it that does not.

It makes the overlays it lacks first (benchmarks/baselines/vllm_releases.py: `pip download`
of each release's wheel, through the venv's pip and so the indexes the user's pip names),
then runs each release as `tokentape chaos --engine vllm --vllm-releases ...` does, and
prints two Markdown tables: the matrix (seeds that showed each class, per release), and per
release the runs with findings, their first findings, the size the shrinks reached and what
they took, and the driver's stepping rate. About 10 minutes on a 2-core machine (vLLM's
import, 10-20 s a release, and the shrinks of the buggy releases are most of it).

    python benchmarks/chaos_vllm_matrix.py                       # 0.20.0-0.34.0, seeds 0-59
    python benchmarks/chaos_vllm_matrix.py --releases 0.20.0,0.24.0 --seeds 20 --json m.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from baselines.vllm_releases import make_overlay  # noqa: E402

from tokentape.chaos.release_matrix import ReleaseMatrix  # noqa: E402
from tokentape.chaos.vllm_storms import VLLMCampaignSummary, run_vllm_campaign  # noqa: E402
from tokentape.integrations.vllm.driver_process import (  # noqa: E402
    VLLMNotFound,
    check_release,
    find_vllm,
)

RELEASES = [f"0.{minor}.0" for minor in range(20, 35)]


def release_row(s: VLLMCampaignSummary) -> str:
    firsts = ", ".join(f"`{k}` {n}" for k, n in s.primaries.most_common()) or ""
    classes = ", ".join(f"{c}: {seed}" for c, seed in sorted(s.first_seed_of.items()))
    shrunk = [o.shrunk for o in s.found if o.shrunk is not None]
    if shrunk:
        sizes = Counter(m.requests for m in shrunk)
        size = f"{sizes.get(1, 0)} of {len(shrunk)} to 1 request, at most {max(sizes)}"
        times = [m.seconds for m in shrunk]
        took = f"{statistics.mean(times):.1f} s / {max(times):.1f} s"
    else:
        size = took = ""
    rate = s.steps / s.driver_s if s.driver_s else 0.0
    return (
        f"| {s.release} | {s.runs_with_findings} | {firsts} | {classes} | {size} | {took} "
        f"| {rate:,.0f} | {s.wall_s:.0f} s |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--releases", default=",".join(RELEASES), help="A,B,... (default 0.20-0.34)")
    p.add_argument("--seeds", type=int, default=60)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--out", help="keep the campaigns here (default: a temporary directory)")
    p.add_argument("--no-shrink", action="store_true")
    p.add_argument("--json", metavar="PATH", help="also write the matrix and rows as JSON")
    args = p.parse_args()
    try:
        found = find_vllm()
    except VLLMNotFound as exc:
        print(exc, file=sys.stderr)
        return 2
    venv_release = found.version.split("+")[0]
    releases = [r.strip() for r in args.releases.split(",") if r.strip()]
    for release in releases:
        if release != venv_release:
            make_overlay(found.venv, release)
    try:
        names = [check_release(found, r) for r in releases]
    except VLLMNotFound as exc:
        print(exc, file=sys.stderr)
        return 2
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    with tempfile.TemporaryDirectory(prefix="chaos-vllm-matrix-") as tmp:
        out = Path(args.out or tmp)
        summaries = []
        start = time.perf_counter()
        for name in names:
            summary = run_vllm_campaign(
                seeds,
                found,
                None if name == found.version else name,
                str(out / name),
                shrink=not args.no_shrink,
            )
            print(f"{summary.release}: {summary.runs_with_findings} of {summary.num_seeds} "
                  f"seeds with findings, {summary.wall_s:.0f} s", file=sys.stderr)  # fmt: skip
            summaries.append(summary)
        wall = time.perf_counter() - start
    matrix = ReleaseMatrix.of(summaries)
    print(f"seeds {seeds.start}-{seeds.stop - 1} on {len(names)} releases, {wall / 60:.1f} min\n")
    print("| class | " + " | ".join(matrix.releases) + " | first with | first without |")
    print("|---|" + "---:|" * len(matrix.releases) + "---|---|")
    for row in matrix.rows:
        cells = " | ".join(str(row.seeds[r]) if row.seeds[r] else "." for r in matrix.releases)
        print(f"| {row.finding_class} | {cells} | {row.first_with} | {row.first_without or '-'} |")
    print()
    print(
        "| release | runs with findings | first findings | first seed of each class | shrunk "
        "| shrink time, mean / max | driver steps/s | wall |"
    )
    print("|---|---:|---|---|---|---|---:|---:|")
    by_release = {s.release: s for s in summaries}
    for name in matrix.releases:
        print(release_row(by_release[name]))
    if args.json:
        record: dict[str, Any] = {
            **matrix.to_json(),
            "wall_s": wall,
            "campaigns": [
                {k: v for k, v in s.to_json().items() if k != "found"} for s in summaries
            ],
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
