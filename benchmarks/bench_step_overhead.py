"""(c) Engine step overhead, tape on (SQLite file) against tape off (NullTape).

Workload: N requests (1, 64, 256), prompts of 128 tokens, max_tokens 256 with ignore_eos, oracle
runner, enough KV blocks and token budget that nothing is preempted and every prefill happens
in the first step. Timed: WINDOW_CALLS consecutive `engine.step()` calls in which every request
decodes one token (see _common.measure_decode_steps), reported as µs per step. Async
scheduling with pipeline_depth=2 (vLLM's default) and synchronous scheduling. An
informational third variant, the in-memory tape (`tape=None`: every event encoded with
msgspec and kept in a list, no SQLite), splits the tape's cost into encoding and the SQLite
write.

Beside each wall time, the CPU time of every process over the same window: the engine's
(`time.process_time`, every thread) and, with the SQLite tape, its writer process's (which
commits on another core, off the engine's path). Best of N by wall time; the CPU figures are
those of the same repeat.

Target: tape-on <= 1.10x tape-off at N = 256 (wall time).

    python benchmarks/bench_step_overhead.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import _common as c

SIZES = (1, 64, 256)
MODES = (("async, depth 2", True), ("sync", False))
TARGET = 1.10


def _wall(t: c.StepTimes) -> float:
    return t.wall_s


def main() -> None:
    args = c.parse_args(__doc__.splitlines()[0], default_repeats=5)
    tmp = c.TempDir()
    rows, results = [], []
    try:
        for mode_name, async_sched in MODES:
            for n in SIZES:
                best = c.best_of(
                    {
                        "on": lambda n=n, a=async_sched: c.measure_decode_steps(n, a, tmp.new()),
                        "off": lambda n=n, a=async_sched: c.measure_decode_steps(n, a, False),
                        "memory": lambda n=n, a=async_sched: c.measure_decode_steps(n, a, None),
                    },
                    repeats=args.repeats,
                    key=_wall,
                )
                on, off, mem = best["on"], best["off"], best["memory"]
                ratio = on.wall_s / off.wall_s
                results.append(
                    {
                        "mode": mode_name,
                        "n": n,
                        "on_s": on.wall_s,
                        "off_s": off.wall_s,
                        "memory_s": mem.wall_s,
                        "ratio": ratio,
                        "on_engine_cpu_s": on.engine_cpu_s,
                        "on_writer_cpu_s": on.writer_cpu_s,
                        "off_engine_cpu_s": off.engine_cpu_s,
                        "memory_engine_cpu_s": mem.engine_cpu_s,
                        "ratio_with_writer_cpu": on.wall_plus_writer_s / off.wall_s,
                    }
                )
                target = f"<= {TARGET:.2f}x: {c.verdict(ratio <= TARGET)}" if n == 256 else "-"
                rows.append(
                    [
                        mode_name,
                        n,
                        c.fmt_us(on.wall_s),
                        c.fmt_us(on.engine_cpu_s),
                        c.fmt_us(on.writer_cpu_s),
                        c.fmt_us(off.wall_s),
                        c.fmt_us(off.engine_cpu_s),
                        c.fmt_us(on.wall_s - off.wall_s),
                        f"{ratio:.3f}x",
                        target,
                        f"{on.wall_plus_writer_s / off.wall_s:.3f}x",
                        c.fmt_us(mem.wall_s),
                        f"{mem.wall_s / off.wall_s:.3f}x",
                    ]
                )
    finally:
        tmp.cleanup()
    headers = [
        "scheduling",
        "running requests",
        "tape on: wall (µs/step)",
        "tape on: engine CPU",
        "tape on: writer CPU",
        "tape off: wall",
        "tape off: engine CPU",
        "tape cost (wall)",
        "on / off (wall)",
        "target",
        "(on wall + writer CPU) / off",
        "memory tape: wall (info)",
        "memory / off",
    ]
    md = (
        f"### (c) Step overhead: tape on vs tape off (best of {args.repeats} by wall time, "
        f"{c.WINDOW_CALLS} decode steps each; CPU columns in µs per step, same repeat)\n\n"
        + c.md_table(headers, rows)
    )
    summary = []
    for mode_name, _ in MODES:
        r = next(r for r in results if r["mode"] == mode_name and r["n"] == 256)
        summary.append(
            {
                "name": f"step overhead, tape on / off (N=256, {mode_name})",
                "value": f"{r['ratio']:.3f}x ({r['on_s'] * 1e6:,.0f} vs "
                f"{r['off_s'] * 1e6:,.0f} µs/step; writer CPU "
                f"{r['on_writer_cpu_s'] * 1e6:,.0f} µs/step)",
                "target": f"<= {TARGET:.2f}x",
                "pass": r["ratio"] <= TARGET,
            }
        )
    c.emit(
        {"bench": "step_overhead", "repeats": args.repeats, "results": results, "summary": summary},
        md,
        args.json,
    )


if __name__ == "__main__":
    main()
