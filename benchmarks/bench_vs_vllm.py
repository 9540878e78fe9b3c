"""(d) Per-decode-step cost against vLLM's published scheduler figures (external reference).

Workload of vLLM's scheduler tests: N requests (1, 64, 256), prompts of 128 tokens,
max_tokens 256, one token per step, every request in decode. tokentape is measured here with
the tape ON (an SQLite file), the oracle runner, in the same way as bench_step_overhead
(µs per `engine.step()`, best of N). vLLM cannot be installed on this machine, so its side is
NOT measured here: the VLLM_REFERENCE_US figures below are hard-coded external reference
numbers (vLLM 0.33, as published, for a machine of this kind). Synchronous scheduling is
compared with vLLM's `Scheduler`, async scheduling (pipeline_depth=2) with `AsyncScheduler`.

Note that a tokentape step also includes what vLLM's scheduler figures leave out: the
(oracle) runner computing the tokens, the reducer, the output objects and the tape write.

Target: tokentape <= 0.5x vLLM at N = 256 with the tape on (about 1 ms per step).

    python benchmarks/bench_vs_vllm.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import _common as c

# EXTERNAL REFERENCE NUMBERS, not measured by this script: vLLM 0.33 published figures, µs per
# decode step (schedule + update from output) at N running requests, on a machine of this kind.
VLLM_REFERENCE_US = {
    "Scheduler": {1: 27.0, 64: 530.0, 256: 2040.0},
    "AsyncScheduler": {1: 29.0, 64: 610.0, 256: 2340.0},
}
VLLM_REFERENCE_SOURCE = "vLLM 0.33 published scheduler figures (external; not measured here)"
SIZES = (1, 64, 256)
MODES = (("sync", False, "Scheduler"), ("async, depth 2", True, "AsyncScheduler"))
TARGET = 0.5


def main() -> None:
    args = c.parse_args(__doc__.splitlines()[0], default_repeats=5)
    tmp = c.TempDir()
    rows, results = [], []
    try:
        for mode_name, async_sched, vllm_name in MODES:
            for n in SIZES:
                variants = {"tape on": lambda: c.time_decode_steps(n, async_sched, tmp.new())}
                best = c.best_of(variants, repeats=args.repeats)["tape on"]
                ref_us = VLLM_REFERENCE_US[vllm_name][n]
                ratio = best * 1e6 / ref_us
                results.append({"mode": mode_name, "vllm": vllm_name, "n": n, "tokentape_s": best,
                                "vllm_ref_us": ref_us, "ratio": ratio})
                target = f"<= {TARGET:.2f}x: {c.verdict(ratio <= TARGET)}" if n == 256 else "-"
                rows.append([f"{mode_name} vs `{vllm_name}`", n, c.fmt_us(best), f"{ref_us:,.0f}",
                             f"{ratio:.3f}x", target])
    finally:
        tmp.cleanup()
    headers = ["tokentape (tape on) vs vLLM", "running requests", "tokentape (µs/step)",
               "vLLM reference (µs/step, external)", "tokentape / vLLM", "target"]
    md = (f"### (d) Per-step cost vs vLLM (tokentape best of {args.repeats}; vLLM: "
          f"{VLLM_REFERENCE_SOURCE})\n\n" + c.md_table(headers, rows))
    summary = []
    for mode_name, _, vllm_name in MODES:
        r = next(r for r in results if r["mode"] == mode_name and r["n"] == 256)
        summary.append({
            "name": f"vs vLLM `{vllm_name}` (N=256, tape on)",
            "value": f"{r['ratio']:.3f}x ({r['tokentape_s'] * 1e6:,.0f} µs vs "
                     f"{r['vllm_ref_us']:,.0f} µs)",
            "target": f"<= {TARGET:.2f}x",
            "pass": r["ratio"] <= TARGET,
        })
    c.emit({"bench": "vs_vllm", "repeats": args.repeats, "reference": VLLM_REFERENCE_US,
            "results": results, "summary": summary}, md, args.json)


if __name__ == "__main__":
    main()
