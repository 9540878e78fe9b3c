"""(c) Engine step overhead, tape on (SQLite file) against tape off (NullTape).

Workload: N requests (1, 64, 256), prompts of 128 tokens, max_tokens 256 with ignore_eos, oracle
runner, enough KV blocks and token budget that nothing is preempted and every prefill happens
in the first step. Timed: WINDOW_CALLS consecutive `engine.step()` calls in which every request
decodes one token (see _common.time_decode_steps), reported as µs per step. Async scheduling
with pipeline_depth=2 (vLLM's default) and synchronous scheduling. An informational third
variant, the in-memory tape (`tape=None`: every event encoded with msgspec and kept in a list,
no SQLite), splits the tape's cost into encoding and the SQLite write.

Target: tape-on <= 1.10x tape-off at N = 256.

    python benchmarks/bench_step_overhead.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import _common as c

SIZES = (1, 64, 256)
MODES = (("async, depth 2", True), ("sync", False))
TARGET = 1.10


def main() -> None:
    args = c.parse_args(__doc__.splitlines()[0], default_repeats=5)
    tmp = c.TempDir()
    rows, results = [], []
    try:
        for mode_name, async_sched in MODES:
            for n in SIZES:
                best = c.best_of(
                    {
                        "on": lambda: c.time_decode_steps(n, async_sched, tmp.new()),
                        "off": lambda: c.time_decode_steps(n, async_sched, False),
                        "memory": lambda: c.time_decode_steps(n, async_sched, None),
                    },
                    repeats=args.repeats,
                )
                ratio = best["on"] / best["off"]
                results.append({"mode": mode_name, "n": n, "on_s": best["on"], "off_s": best["off"],
                                "memory_s": best["memory"], "ratio": ratio})
                target = f"<= {TARGET:.2f}x: {c.verdict(ratio <= TARGET)}" if n == 256 else "-"
                rows.append([mode_name, n, c.fmt_us(best["on"]), c.fmt_us(best["off"]),
                             c.fmt_us(best["on"] - best["off"]), f"{ratio:.3f}x", target,
                             c.fmt_us(best["memory"]), f"{best['memory'] / best['off']:.3f}x"])
    finally:
        tmp.cleanup()
    headers = ["scheduling", "running requests", "tape on (µs/step)", "tape off (µs/step)",
               "tape cost (µs/step)", "on / off", "target",
               "memory tape (µs/step, info)", "memory / off"]
    md = (f"### (c) Step overhead: tape on vs tape off (best of {args.repeats}, "
          f"{c.WINDOW_CALLS} decode steps each)\n\n" + c.md_table(headers, rows))
    summary = []
    for mode_name, _ in MODES:
        r = next(r for r in results if r["mode"] == mode_name and r["n"] == 256)
        summary.append({
            "name": f"step overhead, tape on / off (N=256, {mode_name})",
            "value": f"{r['ratio']:.3f}x ({r['on_s'] * 1e6:,.0f} vs "
                     f"{r['off_s'] * 1e6:,.0f} µs/step)",
            "target": f"<= {TARGET:.2f}x",
            "pass": r["ratio"] <= TARGET,
        })
    c.emit({"bench": "step_overhead", "repeats": args.repeats, "results": results,
            "summary": summary}, md, args.json)


if __name__ == "__main__":
    main()
