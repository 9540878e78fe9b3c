"""Profile of the N=256, tape-on, async (depth 2) decode step: where an engine step goes.

Same workload and timed window as bench_step_overhead (256 requests, prompts of 128 tokens,
max_tokens 256, ignore_eos, oracle runner, SQLite tape file). Two profilers over the window:

- pyinstrument (sampling every 0.5 ms over 4 windows) gives each function's share of the
  window, cumulative (with its callees) and own;
- cProfile (deterministic) gives the exact number of calls.

The table joins them: µs per step = share x the unprofiled µs/step, and µs per call = that /
cProfile's calls per step, so the costs are estimates of unprofiled ones. Built-ins other
than the ones doing real work (SQLite execute, msgspec encode/decode, hashing) are folded
into their caller's own time: with a sampling profiler their samples are mostly the caller's
bytecode. Without pyinstrument (`pip install pyinstrument`) it falls back to cProfile's own
times, which over-weight small, frequently called functions.

    python benchmarks/profile_step.py [--top 25] [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
from collections import defaultdict

import _common as c

N = 256
SAMPLE_INTERVAL = 0.0005
PYI_RUNS = 4


def short(path: str | None, line: int | None) -> str:
    if not path or path.startswith("<") or path == "~":
        return "built-in"
    path = path.split("/tokentape/", 1)[1] if "/tokentape/" in path else path.rsplit("/", 1)[-1]
    return f"{path}:{line}"


def cprofile_table(stats: pstats.Stats) -> dict[tuple[str, int], tuple[str, int, float, float]]:
    """(file, first line) -> (name, calls, own s, cumulative s)."""
    out = {}
    items = stats.stats.items()  # type: ignore[attr-defined]
    for (filename, line, func), (_cc, nc, tt, ct, _callers) in items:
        out[(filename, line)] = (func, nc, tt, ct)
    return out


# C functions that do real work and keep their own samples; any other built-in (len, min,
# list.append, ...) is a leaf where pyinstrument's sampler happens to fire, so the time it
# shows there is mostly its caller's bytecode, and it is folded into the caller's own time.
_REAL_WORK_BUILTINS = ("execute", "encode", "decode", "digest", "blake2b", "commit", "fetch")


def is_cheap_builtin(frame) -> bool:
    path = frame.file_path or ""
    if not (path.startswith("<") or frame.line_no in (None, 0)):
        return False
    return not any(w in frame.function for w in _REAL_WORK_BUILTINS)


def pyinstrument_table(root) -> tuple[float, dict[tuple[str, int], list]]:
    """(file, first line) -> [name, cumulative s, own s] from a pyinstrument frame tree."""
    agg: dict[tuple[str, int], list] = defaultdict(lambda: ["", 0.0, 0.0])

    def walk(frame, ancestors: frozenset, parent: list | None) -> None:
        if frame.is_synthetic:
            return
        key = (frame.file_path or frame.function, frame.line_no or 0)
        if parent is not None and is_cheap_builtin(frame):
            parent[2] += frame.time  # sampling artefact: the caller's own time
            return
        entry = agg[key]
        name = f"{frame.class_name}.{frame.function}" if frame.class_name else frame.function
        entry[0] = name
        if key not in ancestors:  # count recursion once
            entry[1] += frame.time
        entry[2] += frame.total_self_time
        for child in frame.children:
            walk(child, ancestors | {key}, entry)

    walk(root, frozenset(), None)
    return root.time, agg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    steps = c.WINDOW_CALLS
    tmp = c.TempDir()
    try:
        plain = min(c.time_decode_steps(N, True, tmp.new()) for _ in range(4))
        prof = cProfile.Profile()
        cprof_step = c.time_decode_steps(N, True, tmp.new(), hooks=(prof.enable, prof.disable))
        calls = cprofile_table(pstats.Stats(prof))
        try:
            from pyinstrument import Profiler
        except ImportError:
            Profiler = None  # noqa: N806
        tree = ""
        if Profiler is not None:
            p = Profiler(interval=SAMPLE_INTERVAL)
            pyi_step = min(
                c.time_decode_steps(N, True, tmp.new(), hooks=(p.start, p.stop))
                for _ in range(PYI_RUNS)
            )  # the sessions are combined
            total, agg = pyinstrument_table(p.last_session.root_frame())
            tree = p.output_text(unicode=False, color=False, show_all=False).strip()
            source = (
                f"pyinstrument, {PYI_RUNS} windows sampled every "
                f"{SAMPLE_INTERVAL * 1e3:g} ms "
                f"({c.fmt_us(pyi_step)} µs/step while sampling)"
            )
        else:
            stats = pstats.Stats(prof)
            total = stats.total_tt  # type: ignore[attr-defined]
            agg = {k: [v[0], v[3], v[2]] for k, v in calls.items()}
            source = "cProfile (pyinstrument not installed)"
    finally:
        tmp.cleanup()

    def rows(order: int) -> list[list[str]]:
        ranked = sorted(agg.items(), key=lambda kv: kv[1][order], reverse=True)
        out = []
        for (path, line), (name, cum, own) in ranked[: args.top]:
            nc = calls.get((path, line), (None, 0))[1]
            share = cum / total
            # Scaled to the unprofiled step time: share of the window x unprofiled µs/step.
            per_call = f"{share * plain * steps / nc * 1e6:,.2f}" if nc else "-"
            out.append(
                [
                    f"`{name}` ({short(path, line)})",
                    f"{nc / steps:,.1f}" if nc else "-",
                    f"{100 * share:.1f}%",
                    f"{100 * own / total:.1f}%",
                    f"{share * plain * 1e6:,.1f}",
                    per_call,
                ]
            )
        return out

    headers = [
        "function",
        "calls/step",
        "cumulative %",
        "own %",
        "µs/step (cum)",
        "µs per call (cum)",
    ]
    md = (
        f"### Profile: N={N}, tape on (SQLite), async depth 2, {steps} decode steps\n\n"
        f"Unprofiled: {c.fmt_us(plain)} µs/step (best of 4); under cProfile "
        f"{c.fmt_us(cprof_step)} µs/step (used for call counts only). Shares from {source}; "
        "µs figures are those shares of the unprofiled step time; per call = that / calls "
        "(cProfile's count).\n\n"
        "By cumulative time:\n\n"
        + c.md_table(headers, rows(1))
        + "\n\nBy own time:\n\n"
        + c.md_table(headers, rows(2))
    )
    if tree:
        md += "\n\npyinstrument call tree:\n\n```\n" + tree + "\n```"
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "profile", "plain_s": plain, "markdown": md}, f, indent=2)


if __name__ == "__main__":
    main()
