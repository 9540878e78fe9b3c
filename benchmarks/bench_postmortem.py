"""(f) Postmortem speed: `tokentape.postmortem.postmortem` over a tape of 1,000,000 events,
against a plain read + decode of the same tape.

The tape is recorded once by a real engine (oracle model, async depth 2, 2 speculative
tokens, a KV cache small enough for KV-pressure preemptions, a pause(keep, clear_cache) /
resume and a prefix-cache reset every few hundred steps) until it holds --events events. It
is cached under ~/.cache/tokentape (or --tape PATH, reused when it exists; a temporary file
for another --events) and never committed. Timed, in alternation, on the same file:

- baseline, read + decode: `load_tape(path).events()` iterated to the end (SQLite reads and
  msgspec decoding, nothing else);
- informational: `fold` (read + decode + the reducer);
- postmortem: every checker, the oracle's reference streams included, with the rich progress
  bar on stderr when stderr is a terminal (as `tokentape postmortem` shows it).

Target: the postmortem of 1,000,000 events in under 30 s.

    python benchmarks/bench_postmortem.py [--events 1000000] [--repeats 2] [--tape PATH]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import _common as c

from tokentape import LLM, SamplingParams
from tokentape.postmortem import postmortem
from tokentape.progress import progress
from tokentape.replay import load_tape

TARGET_S = 30.0
TARGET_EVENTS = 1_000_000
TAPE_NAME = "bench-postmortem-1M-v1.tape"  # cached; bump the suffix when the recipe changes


def record_tape(path: str, num_events: int) -> None:
    rng = random.Random(7)
    with LLM(
        model="oracle",
        tape=path,
        max_num_seqs=8,
        num_kv_blocks=64,
        block_size=16,
        num_speculative_tokens=2,
    ) as llm:
        engine = llm.llm_engine
        next_id = 0
        steps = 0
        while engine.engine_core.state.num_events < num_events:  # every event went through evolve
            while engine.get_num_unfinished_requests() < 12:
                prompt = [rng.randrange(3, 259) for _ in range(rng.randint(8, 96))]
                engine.add_request(
                    str(next_id),
                    prompt,
                    SamplingParams(max_tokens=rng.randint(16, 160), seed=next_id),
                )
                next_id += 1
            engine.step()
            steps += 1
            if steps % 500 == 0:
                engine.pause_generation(mode="keep", clear_cache=True)
                engine.resume_generation()
            elif steps % 500 == 250:
                engine.reset_prefix_cache(reset_running_requests=True)
        # Finish what is running, so that every request on the tape is complete.
        while engine.has_unfinished_requests():
            engine.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--events", type=int, default=TARGET_EVENTS, help="events on the tape (default 1,000,000)"
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="timed repeats per variant, best kept (default 2)"
    )
    p.add_argument(
        "--tape",
        metavar="PATH",
        help="record the tape here, or reuse it if it exists "
        "(default: a cached tape under ~/.cache/tokentape for the default --events)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()
    tmp = c.TempDir()
    try:
        path = args.tape or (
            os.path.join(c.cache_dir(), TAPE_NAME)
            if args.events == TARGET_EVENTS
            else tmp.new("postmortem")
        )
        record_s = 0.0
        if not os.path.exists(path):
            t0 = time.perf_counter()
            partial = path + ".partial"  # an interrupted recording is never taken for the tape
            c.remove_db(partial)
            record_tape(partial, args.events)
            os.replace(partial, path)
            record_s = time.perf_counter() - t0
        tape = load_tape(path)
        n = len(tape)
        report = None

        def read_decode() -> float:
            with c.gc_collected():
                t0 = time.perf_counter()
                for _ in load_tape(path).events():
                    pass
                return time.perf_counter() - t0

        def fold() -> float:
            with c.gc_collected():
                t0 = time.perf_counter()
                load_tape(path).fold()
                return time.perf_counter() - t0

        def run_postmortem() -> float:
            nonlocal report
            with c.gc_collected():
                t0 = time.perf_counter()
                loaded = load_tape(path)
                with progress(len(loaded), "postmortem", sys.stderr, minimum=0) as update:
                    report = postmortem(loaded, progress=update)
                return time.perf_counter() - t0

        best = c.best_of(
            {"read + decode": read_decode, "fold": fold, "postmortem": run_postmortem},
            args.repeats,
            warmup=0,
        )
        assert report is not None
        pm = best["postmortem"]
        ok = pm < TARGET_S * n / TARGET_EVENTS
        rows = [
            [name, f"{secs:.2f}", c.fmt_rate(n / secs), f"{secs / best['read + decode']:.2f}x"]
            for name, secs in best.items()
        ]
        md = "\n".join(
            [
                f"### (f) postmortem of a {n:,}-event tape"
                + (f" (recorded in {record_s:.0f} s)" if record_s else ""),
                "",
                c.md_table(
                    ["variant", "seconds (best)", "events/s", "time vs read + decode"], rows
                ),
                "",
                f"Findings on the tape: {len(report.findings)} "
                f"({report.summary.counts or 'none'}); tokens {report.summary.tokens}.",
                f"Target: postmortem of {TARGET_EVENTS:,} events < {TARGET_S:.0f} s "
                f"(scaled to this tape: {TARGET_S * n / TARGET_EVENTS:.1f} s): "
                f"**{c.verdict(ok)}** ({pm:.1f} s).",
            ]
        )
        summary = [
            {
                "name": f"postmortem of {n:,} events",
                "value": f"{pm:.1f} s ({pm / best['read + decode']:.1f}x read + decode)",
                "target": f"< {TARGET_S * n / TARGET_EVENTS:.0f} s",
                "pass": ok,
            }
        ]
        c.emit(
            {
                "bench": "postmortem",
                "events": n,
                "seconds": best,
                "target_s": TARGET_S,
                "ok": ok,
                "findings": len(report.findings),
                "machine": c.machine_info(),
                "summary": summary,
            },
            md,
            args.json,
        )
    finally:
        tmp.cleanup()


if __name__ == "__main__":
    main()
