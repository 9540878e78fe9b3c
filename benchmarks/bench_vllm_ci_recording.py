"""What recording costs vLLM's own CI: vLLM's tests/v1/core/test_scheduler.py and
test_async_scheduler.py run by vLLM's pytest with `-p tokentape --tokentape-record-vllm DIR`
against the same files without it, in interleaved rounds in the same window (the order
alternates each round). Target: recording costs at most 5% of the session's time.

Each round is a fresh pytest process (vLLM's import and collection included, as a CI job pays
them), one at a time; the figures are wall time and the CPU time of the pytest process and
anything it starts (getrusage of the children: the recorder starts no process, it records in
memory and writes only the tapes of failing tests). The recorded sessions run as a vLLM
developer would run them: tapes kept for failing tests only. Needs the venv that
benchmarks/setup_vllm_venv.sh makes (vLLM's tests and their config-only model cache).

    python benchmarks/bench_vllm_ci_recording.py [--rounds 3] [--vllm-python PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines.locate import find_vllm  # noqa: E402
from baselines.vllm_releases import pytest_plugin_flag, release_env, vllm_tests_dir  # noqa: E402

TARGET = 0.05
TESTS = ["tests/v1/core/test_scheduler.py", "tests/v1/core/test_async_scheduler.py"]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def session(
    python: str, tree: Path, env: dict[str, str], extra: list[str]
) -> tuple[float, float, str]:
    """One pytest session: (wall seconds, CPU seconds, its last line)."""
    cpu, start = children_cpu(), time.perf_counter()
    proc = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *extra],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.perf_counter() - start
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    return wall, children_cpu() - cpu, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    found, where = find_vllm(args.vllm_python)
    if found is None:
        print(where, file=sys.stderr)
        return 2
    venv = Path(found.python).parents[1]
    tree = vllm_tests_dir(venv, found.version)
    env = {**os.environ, **release_env(venv, None)}
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "recorded": []}
    lasts: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="tokentape-ci-tapes-") as tapes:
        plugin = ["-p", pytest_plugin_flag(found.python), "--tokentape-record-vllm", tapes]
        variants: dict[str, list[str]] = {"plain": [], "recorded": plugin}
        for r in range(args.rounds):
            order = ["plain", "recorded"] if r % 2 == 0 else ["recorded", "plain"]
            for name in order:
                wall, cpu, lasts[name] = session(found.python, tree, env, variants[name])
                times[name].append((wall, cpu))
                print(
                    f"round {r + 1} {name:8} wall {wall:7.1f} s  cpu {cpu:7.1f} s  ({lasts[name]})"
                )
    report = {"vllm": found.version, "rounds": args.rounds, "outcomes": lasts}
    print(f"\nvLLM {found.version}, {' + '.join(TESTS)}, {args.rounds} rounds (median; best)")
    for i, what in enumerate(("wall", "cpu")):
        med = {k: statistics.median(t[i] for t in v) for k, v in times.items()}
        best = {k: min(t[i] for t in v) for k, v in times.items()}
        cost, cost_best = med["recorded"] / med["plain"] - 1, best["recorded"] / best["plain"] - 1
        report[what] = {"median": med, "best": best, "cost_median": cost, "cost_best": cost_best}
        print(
            f"{what:4}: plain {med['plain']:.1f} s ({best['plain']:.1f}), recorded "
            f"{med['recorded']:.1f} s ({best['recorded']:.1f}): recording costs {cost:+.1%} "
            f"({cost_best:+.1%}); target <= {TARGET:.0%}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
