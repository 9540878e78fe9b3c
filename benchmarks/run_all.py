"""Run every benchmark, each in its own interpreter, and print one markdown report.

    python benchmarks/run_all.py                 # all benchmarks + the step profile
    python benchmarks/run_all.py --quick         # 2 repeats each (a smoke run, noisier)
    python benchmarks/run_all.py --no-profile --output results.md
    python benchmarks/run_all.py --wait-idle 120  # on a shared machine: wait for quiet first
    python benchmarks/run_all.py --generate      # + bench_generate.py (tiny, 256 prompts, ~5 min)
    python benchmarks/run_all.py --vllm-python .venv-vllm/bin/python   # where vLLM is

vLLM (the baseline of bench_vs_vllm.py and bench_generate.py) is found as those scripts find
it (benchmarks/baselines/locate.py); without it their vLLM figures read "not measured".

The report starts with the machine, the code measured (git commit) and the load average
around the run (the benchmarks are single-threaded; other work on the machine makes the
numbers noisier and the best-of-N repeats only partly hide it; the report gives, per
benchmark, how many cores the whole machine was busy on), then each benchmark's table,
then a summary of the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _common as c

HERE = os.path.dirname(os.path.abspath(__file__))
USES_VLLM = {"bench_vs_vllm.py", "bench_generate.py"}
BENCHMARKS = [
    "bench_tape_append.py",
    "bench_fold.py",
    "bench_step_overhead.py",
    "bench_vs_vllm.py",
    "bench_seek.py",
    "bench_postmortem.py",
]


def source_digest() -> str:
    """A short digest of tokentape/**/*.py, to name the exact code measured."""
    import hashlib

    root = os.path.join(HERE, "..", "tokentape")
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:12]


def git_describe() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "../tokentape"],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if dirty:
            commit += f" plus uncommitted changes in tokentape/ (source digest {source_digest()})"
        return commit
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def wait_until_idle(max_wait: float, threshold: float = 0.3) -> float:
    """Wait (at most max_wait s) until other processes use < threshold cores; return the last."""
    deadline = time.time() + max_wait
    while True:
        t0 = c.cpu_ticks()
        time.sleep(1.0)
        busy = c.busy_cores(t0, c.cpu_ticks()) or 0.0
        if busy < threshold or time.time() >= deadline:
            return busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats per benchmark")
    ap.add_argument("--no-profile", action="store_true", help="skip profile_step.py")
    ap.add_argument("--output", metavar="PATH", help="also write the report to PATH")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="S",
        help="before each benchmark, wait up to S seconds for the machine to go idle",
    )
    ap.add_argument(
        "--generate",
        action="store_true",
        help="also run bench_generate.py (tokentape vs vLLM's CPU engine and "
        "transformers; minutes)",
    )
    ap.add_argument("--vllm-python", metavar="PATH", help="the Python that has vllm")
    args = ap.parse_args()
    scripts = (
        BENCHMARKS
        + (["bench_generate.py"] if args.generate else [])
        + ([] if args.no_profile else ["profile_step.py"])
    )
    sections, summary, timings = [], [], []
    code = git_describe()  # before the run, in case the code changes while it runs
    load_before = os.getloadavg()
    t_start = time.time()
    with tempfile.TemporaryDirectory() as td:
        for script in scripts:
            out = os.path.join(td, script + ".json")
            cmd = [sys.executable, os.path.join(HERE, script), "--json", out]
            if args.quick and script != "profile_step.py":
                cmd += ["--repeats", "2"]
            if args.vllm_python and script in USES_VLLM:
                cmd += ["--vllm-python", args.vllm_python]
            if args.wait_idle:
                wait_until_idle(args.wait_idle)
            print(f"running {script} ...", file=sys.stderr, flush=True)
            ticks0 = c.cpu_ticks()
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            elapsed = time.perf_counter() - t0
            busy = c.busy_cores(ticks0, c.cpu_ticks())
            ncpu = os.cpu_count()
            busy_txt = "" if busy is None else f", machine busy {busy:.2f} of {ncpu} cores"
            timings.append(f"`{script}` {elapsed:.0f} s{busy_txt}")
            if proc.returncode != 0:
                sections.append(
                    f"### {script}: FAILED (exit {proc.returncode})\n\n```\n"
                    f"{proc.stderr[-3000:]}\n```"
                )
                summary.append([script, "error", "-", "ERROR"])
            if not os.path.exists(out):
                continue  # what it measured before failing, if anything, is in its JSON
            with open(out) as f:
                res = json.load(f)
            sections.append(res["markdown"])
            for s in res.get("summary", []):
                ok = s["pass"]
                result = (
                    "-"
                    if ok is None and s["target"] == "-"
                    else ("NOT MEASURED" if ok is None else c.verdict(ok))
                )
                summary.append([s["name"], s["value"], s["target"], result])
    load_after = os.getloadavg()
    info = c.machine_info()
    head = [
        "## tokentape benchmarks",
        "",
        f"- machine: {info['cpu']}; {info['os']}",
        f"- software: {info['python']}, SQLite {info['sqlite']}, msgspec {info['msgspec']}, "
        f"tokentape {info['tokentape']} at git {code}",
        f"- run: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t_start))}, "
        f"{'quick (2 repeats)' if args.quick else 'default repeats'}; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after",
        "- per benchmark (wall time; CPU use of the whole machine while it ran, the benchmark "
        "itself being about 1 core): " + "; ".join(timings),
    ]
    targets = c.md_table(["benchmark", "measured", "target", "result"], summary)
    report = (
        "\n".join(head) + "\n\n### Targets\n\n" + targets + "\n\n" + "\n\n".join(sections) + "\n"
    )
    print(report)
    if args.output:
        with open(args.output, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
