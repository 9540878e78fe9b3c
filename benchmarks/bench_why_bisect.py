"""`tokentape why` and `tokentape bisect` on a 1,000,000-event tape.

The tape is bench_seek.py's (an oracle run, async depth 2, 16 running requests, batches of
512 requests with 64-512 output tokens; recorded once, a couple of minutes, and cached).

- why: `why(path, request, position)` (wall-clock and CPU time: the machine may be shared)
  for random requests at a random position and at their
  last position (the whole request is read), each in a fresh `Tape` as the CLI does; the
  request index is built once (timed: `cold`) and then read from the cache directory.
  Target: under 100 ms.
- bisect: the tape against itself (identical: the confirming pass reads everything) and
  against a copy whose event at a random position is edited (the copy is made with SQLite
  directly: the triggers that keep a tape append-only are dropped in the copy only).

    python benchmarks/bench_why_bisect.py [--cache-dir DIR] [--requests 30]
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import _common as c  # noqa: E402
import bench_seek  # noqa: E402

from tokentape.events import schema as ev  # noqa: E402
from tokentape.replay import load_tape  # noqa: E402
from tokentape.replay.bisect import bisect  # noqa: E402
from tokentape.replay.why import why  # noqa: E402

TARGET_MS = 100.0


def edited_copy(path: str, dst: str, seq: int) -> None:
    conn = sqlite3.connect(path)
    conn.execute("VACUUM INTO ?", (dst,))
    conn.close()
    out = sqlite3.connect(dst)
    out.execute("DROP TRIGGER events_no_update")
    out.execute(
        "UPDATE events SET data = ? WHERE seq = ?",
        (ev.encode(ev.EngineError(0, "Edited", "benchmark")), seq),
    )
    out.commit()
    out.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--requests", type=int, default=30)
    args = p.parse_args()
    path = os.path.join(c.cache_dir(args.cache_dir), bench_seek.TAPE_NAME)
    if not os.path.exists(path):
        print(f"recording {path} (once)...", flush=True)
        bench_seek.record_tape(path)
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()  # a cold request index
    tape = load_tape(path)
    final = tape.fold()
    n = final.num_events
    rng = random.Random(3)
    ids = rng.sample(list(final.requests), args.requests)

    t0 = time.perf_counter()
    why(path, ids[0], 0)
    cold_ms = (time.perf_counter() - t0) * 1e3
    rows = []
    for label, pick in (
        ("random position", lambda r: rng.randrange(len(r.output_token_ids))),
        ("last position", lambda r: len(r.output_token_ids) - 1),
    ):
        times, cpu, read = [], [], []
        for rid in ids:
            pos = pick(final.requests[rid])
            t0, c0 = time.perf_counter(), time.process_time()
            res = why(path, rid, pos)
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
            read.append(res.events_read)
            assert res.token == final.requests[rid].output_token_ids[pos]
        rows.append(
            [
                f"`why`, {label}, {len(ids)} requests",
                f"{statistics.median(times):.1f}",
                f"{max(times):.1f}",
                f"{statistics.median(cpu):.1f} / {max(cpu):.1f}",
                f"{statistics.median(read):.0f}",
                c.verdict(max(times) < TARGET_MS),
            ]
        )
    print(
        f"tape: {n:,} events, {len(final.requests):,} requests; first call (builds the "
        f"request index): {cold_ms:.0f} ms"
    )
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(
        c.md_table(
            [
                "query",
                "median (ms)",
                "max (ms)",
                "CPU median / max (ms)",
                "events decoded (median)",
                f"< {TARGET_MS:.0f} ms",
            ],
            rows,
        )
    )

    with tempfile.TemporaryDirectory() as d:
        brows = []
        t0 = time.perf_counter()
        r = bisect(path, path, confirm=False)
        brows.append(
            ["identical, --no-confirm", r.seeks, f"{(time.perf_counter() - t0) * 1e3:.1f}", r.index]
        )
        t0 = time.perf_counter()
        r = bisect(path, path)
        brows.append(
            ["identical, confirmed", r.seeks, f"{(time.perf_counter() - t0) * 1e3:.1f}", r.index]
        )
        for where in (n // 10, n // 2, n - 5):
            copy = os.path.join(d, f"edit{where}.tape")
            edited_copy(path, copy, where)
            for confirm in (False, True):
                t0 = time.perf_counter()
                r = bisect(path, copy, confirm=confirm)
                ms = (time.perf_counter() - t0) * 1e3
                brows.append(
                    [
                        f"edited at {where:,}, {'confirmed' if confirm else '--no-confirm'}"
                        + (" (re-converged)" if r.reconverged else ""),
                        r.seeks,
                        f"{ms:.1f}",
                        r.index,
                    ]
                )
            os.remove(copy)
        print(c.md_table(["bisect 1M vs", "probes", "ms", "index"], brows))


if __name__ == "__main__":
    main()
