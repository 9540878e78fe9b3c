"""(e) Seek: the state anywhere in a 1,000,000-event tape, through snapshots vs. a fold.

The tape is an SQLite file recorded once by a real engine run (oracle model, async depth 2,
at most MAX_NUM_SEQS running, batches of requests with 64 to 512 output tokens until the tape
holds at least NUM_EVENTS events) and cached under the cache directory (`--cache-dir`,
default `$XDG_CACHE_HOME/tokentape` or `~/.cache/tokentape`), so later runs skip the
recording (a few minutes). Timed, on the same file, in one run:

- candidate: `SnapshotIndex.state_at(seq)` for NUM_SEEKS random positions, after one
  indexing pass (a snapshot every `--interval` events); the index build is reported too;
  each position is sought `--repeats` times (in rounds) and its best time kept;
- baseline: `Tape.fold(until_seq=seq)`, a fold from the start, for NUM_BASELINE of the same
  positions (each reads half the tape on average);
- informational: `Tape.at(step)` for random steps, through the same index.

Every baseline position is checked: the snapshot seek and the fold give equal states.
Target: a seek anywhere takes under 100 ms (the slowest of the NUM_SEEKS).

    python benchmarks/bench_seek.py [--interval 2048] [--repeats 3] [--cache-dir DIR]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import _common as c

from tokentape import LLM, SamplingParams
from tokentape.events.sqlite_store import SQLiteTapeReader
from tokentape.replay.snapshots import DEFAULT_INTERVAL
from tokentape.replay.tape import Tape

NUM_EVENTS = 1_000_000
MAX_NUM_SEQS = 16
BATCH = 512
NUM_SEEKS = 200
NUM_BASELINE = 6
TARGET_MS = 100.0
TAPE_NAME = "bench-seek-1M-v1.tape"


def record_tape(path: str) -> float:
    """Record batches of requests until the tape holds NUM_EVENTS events; returns seconds."""
    rng = random.Random(7)
    partial = path + ".partial"
    c.remove_db(partial)
    t0 = time.perf_counter()
    with LLM(model="oracle", tape=partial, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=1024) as llm:
        n = 0
        while len(llm.llm_engine.engine_core.tape) < NUM_EVENTS:  # type: ignore[arg-type]
            prompts = [
                [rng.randrange(3, 259) for _ in range(rng.randint(16, 128))] for _ in range(BATCH)
            ]
            params = [
                SamplingParams(max_tokens=rng.randint(64, 512), ignore_eos=True, seed=n + i)
                for i in range(BATCH)
            ]
            n += BATCH
            llm.generate(prompts, params)
    os.replace(partial, path)  # only a complete tape is cached
    return time.perf_counter() - t0


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--interval",
        type=int,
        default=DEFAULT_INTERVAL,
        help=f"snapshot interval in events (default {DEFAULT_INTERVAL})",
    )
    p.add_argument("--cache-dir", default=None, help="where the recorded tape is kept")
    p.add_argument("--seeks", type=int, default=NUM_SEEKS, help="random seeks timed")
    p.add_argument("--baseline", type=int, default=NUM_BASELINE, help="folds from the start timed")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds over the same random positions, best time per position kept (default 3)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()

    path = os.path.join(c.cache_dir(args.cache_dir), TAPE_NAME)
    record_s = None
    if not os.path.exists(path):
        print(f"recording {path} (once; a few minutes)...", flush=True)
        record_s = record_tape(path)
    tape = Tape(SQLiteTapeReader(path), snapshot_interval=args.interval)
    n = len(tape)

    rss0 = rss_mib()
    with c.gc_collected():
        t0 = time.perf_counter()
        index = tape.snapshots.build()
        build_s = time.perf_counter() - t0
    rss1 = rss_mib()
    final = tape.state_at(n)
    num_steps = final.step

    rng = random.Random(1)
    positions = [rng.randrange(n + 1) for _ in range(args.seeks)]
    steps = [rng.randrange(num_steps) for _ in range(args.seeks)]
    seek_ms = [float("inf")] * len(positions)
    at_ms = [float("inf")] * len(steps)
    for _ in range(max(1, args.repeats)):
        for i, seq in enumerate(positions):
            with c.gc_collected():
                t0 = time.perf_counter()
                index.state_at(seq)
                seek_ms[i] = min(seek_ms[i], (time.perf_counter() - t0) * 1e3)
        for i, step in enumerate(steps):
            with c.gc_collected():
                t0 = time.perf_counter()
                tape.at(step)
                at_ms[i] = min(at_ms[i], (time.perf_counter() - t0) * 1e3)
    # The baseline, alternating with a seek to the same position, and checked equal.
    fold_ms, paired_seek_ms = [], []
    for seq in positions[: args.baseline]:
        with c.gc_collected():
            t0 = time.perf_counter()
            folded = tape.fold(until_seq=seq)
            fold_ms.append((time.perf_counter() - t0) * 1e3)
        with c.gc_collected():
            t0 = time.perf_counter()
            sought = index.state_at(seq)
            paired_seek_ms.append((time.perf_counter() - t0) * 1e3)
        assert sought == folded, f"the seek to {seq} differs from the fold"

    mean_seek, max_seek = statistics.fmean(seek_ms), max(seek_ms)
    p95 = statistics.quantiles(seek_ms, n=20)[-1]
    mean_fold = statistics.fmean(fold_ms)
    ratio = mean_fold / statistics.fmean(paired_seek_ms)
    ok = max_seek < TARGET_MS
    table = [
        [
            f"`SnapshotIndex.state_at(seq)`, {args.seeks} random positions",
            f"{mean_seek:.1f}",
            f"{statistics.median(seek_ms):.1f}",
            f"{p95:.1f}",
            f"{max_seek:.1f}",
            f"max < {TARGET_MS:.0f} ms: {c.verdict(ok)}",
        ],
        [
            f"`Tape.at(step)`, {args.seeks} random steps (info)",
            f"{statistics.fmean(at_ms):.1f}",
            f"{statistics.median(at_ms):.1f}",
            f"{statistics.quantiles(at_ms, n=20)[-1]:.1f}",
            f"{max(at_ms):.1f}",
            "",
        ],
        [
            f"`Tape.fold(until_seq)` from the start (baseline), {len(fold_ms)} of the positions",
            f"{mean_fold:,.0f}",
            f"{statistics.median(fold_ms):,.0f}",
            "",
            f"{max(fold_ms):,.0f}",
            f"fold / seek on the same positions: {ratio:,.0f}x",
        ],
    ]
    md = (
        f"### (e) Seek through snapshots (interval {args.interval} events; best of {args.repeats} "
        "per position)\n\n"
        f"Tape: {n:,} events, {len(final.requests):,} requests, {num_steps:,} steps"
        + (f", recorded in {record_s:.0f} s" if record_s is not None else " (cached)")
        + f". Index: one pass in {build_s:.1f} s, {len(index.positions)} snapshots, "
        f"RSS {rss0:,.0f} -> {rss1:,.0f} MiB.\n\n"
        + c.md_table(["seek", "mean (ms)", "median (ms)", "p95 (ms)", "max (ms)", "target"], table)
    )
    summary = [
        {
            "name": "seek anywhere in 1M events (max of random seeks)",
            "value": f"{max_seek:.1f} ms (mean {mean_seek:.1f} ms; "
            f"fold from start {mean_fold:,.0f} ms, {ratio:,.0f}x)",
            "target": f"< {TARGET_MS:.0f} ms",
            "pass": ok,
        }
    ]
    c.emit(
        {
            "bench": "seek",
            "events": n,
            "interval": args.interval,
            "build_s": build_s,
            "seek_ms": {"mean": mean_seek, "p95": p95, "max": max_seek},
            "fold_ms": {"mean": mean_fold},
            "ratio": ratio,
            "rss_mib": [rss0, rss1],
            "summary": summary,
        },
        md,
        args.json,
    )


if __name__ == "__main__":
    main()
