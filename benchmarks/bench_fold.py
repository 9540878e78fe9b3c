"""(b) Fold rate: `tokentape.replay.fold` (read + decode + reducer) against decoding alone.

The tape is an SQLite file recorded by a real engine run (oracle model, default async
scheduling, depth 2): NUM_REQUESTS requests of mixed prompt lengths and max_tokens, at most
MAX_NUM_SEQS running at a time and a KV cache small enough that some are preempted, which
gives a tape of ~100k+ events. Timed, on the same file:

- fold: `tokentape.replay.fold(path)`: open the tape, stream every event, decode and evolve;
- baseline, decode alone: open an `SQLiteTapeReader` and iterate `iter_events()` without
  evolving (the same SQLite reads and msgspec decoding, no reducer);
- informational: `schema.decode` over the encoded rows already in memory (no SQLite at all),
  and `evolve` over the events already decoded (the reducer alone).

Target: fold >= 0.5x the events/s of decoding alone.

    python benchmarks/bench_fold.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import random
import sqlite3
import time
from collections import Counter

import _common as c

from tokentape import LLM, SamplingParams
from tokentape.events import schema as ev
from tokentape.events.reducer import evolve
from tokentape.events.sqlite_store import SQLiteTapeReader
from tokentape.replay import fold, load_tape

NUM_REQUESTS = 2048
MAX_NUM_SEQS = 16
NUM_KV_BLOCKS = 512  # 16 requests can need up to 1024 blocks: some KV-pressure preemptions
TARGET = 0.5


def record_tape(path: str) -> None:
    rng = random.Random(42)
    prompts = [
        [rng.randrange(3, 259) for _ in range(rng.randint(16, 512))] for _ in range(NUM_REQUESTS)
    ]
    params = [SamplingParams(max_tokens=rng.randint(32, 512), seed=i) for i in range(NUM_REQUESTS)]
    with LLM(
        model="oracle", tape=path, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=NUM_KV_BLOCKS
    ) as llm:
        llm.generate(prompts, params)


def main() -> None:
    args = c.parse_args(__doc__.splitlines()[0], default_repeats=5)
    tmp = c.TempDir()
    try:
        path = tmp.new("fold")
        t0 = time.perf_counter()
        record_tape(path)
        record_s = time.perf_counter() - t0
        with sqlite3.connect(path) as conn:
            rows = [d for (d,) in conn.execute("SELECT data FROM events ORDER BY seq")]
        conn.close()
        n = len(rows)
        decoded = [ev.decode(d) for d in rows]
        kinds = Counter(ev.kind_of(e) for e in decoded)
        tape = load_tape(path)
        initial = tape.initial_state
        tape.reader.close()
        final = fold(path)
        assert final.num_events == n and all(r.is_finished for r in final.requests.values())

        def do_fold() -> float:
            with c.gc_collected():
                t0 = time.perf_counter()
                state = fold(path)
                elapsed = time.perf_counter() - t0
            assert state.num_events == n
            return elapsed

        def iterate_reader() -> float:
            with c.gc_collected():
                t0 = time.perf_counter()
                reader = SQLiteTapeReader(path)
                count = 0
                for _ in reader.iter_events():
                    count += 1
                reader.close()
                elapsed = time.perf_counter() - t0
            assert count == n
            return elapsed

        def decode_only() -> float:
            decode = ev.decode
            with c.gc_collected():
                t0 = time.perf_counter()
                for d in rows:
                    decode(d)
                return time.perf_counter() - t0

        def evolve_only() -> float:
            state = initial()
            with c.gc_collected():
                t0 = time.perf_counter()
                for e in decoded:
                    evolve(state, e)
                return time.perf_counter() - t0

        best = c.best_of(
            {
                "fold": do_fold,
                "reader": iterate_reader,
                "decode": decode_only,
                "evolve": evolve_only,
            },
            repeats=args.repeats,
        )
    finally:
        tmp.cleanup()
    rate = {k: n / v for k, v in best.items()}
    ratio = rate["fold"] / rate["reader"]
    ratio_mem = rate["fold"] / rate["decode"]
    table = [
        [
            "`replay.fold(path)`: read + decode + evolve",
            c.fmt_rate(rate["fold"]),
            f"{best['fold'] * 1e3:,.0f}",
            f"{ratio:.3f}x",
            f">= {TARGET}x: {c.verdict(ratio >= TARGET)}",
        ],
        [
            "`SQLiteTapeReader.iter_events()`: read + decode (baseline)",
            c.fmt_rate(rate["reader"]),
            f"{best['reader'] * 1e3:,.0f}",
            "1.000x",
            "",
        ],
        [
            "`schema.decode` of in-memory rows (info)",
            c.fmt_rate(rate["decode"]),
            f"{best['decode'] * 1e3:,.0f}",
            f"{rate['decode'] / rate['reader']:.3f}x",
            f"fold / this = {ratio_mem:.3f}x",
        ],
        [
            "`evolve` of decoded events, reducer alone (info)",
            c.fmt_rate(rate["evolve"]),
            f"{best['evolve'] * 1e3:,.0f}",
            f"{rate['evolve'] / rate['reader']:.3f}x",
            "",
        ],
    ]
    md = (
        f"### (b) Fold rate (best of {args.repeats})\n\n"
        f"Tape: {n:,} events, {NUM_REQUESTS} requests, {final.step:,} steps, "
        f"{sum(r.num_preemptions for r in final.requests.values())} preemptions, "
        f"recorded in {record_s:.1f} s; mix: "
        + ", ".join(f"{k} {v:,}" for k, v in kinds.most_common())
        + "\n\n"
        + c.md_table(["reader", "events/s", "time (ms)", "vs baseline", "target"], table)
    )
    summary = [
        {
            "name": "fold (fold / read+decode)",
            "value": f"{ratio:.3f}x "
            f"({c.fmt_rate(rate['fold'])} vs {c.fmt_rate(rate['reader'])} events/s; "
            f"vs in-memory decode {ratio_mem:.3f}x)",
            "target": f">= {TARGET}x",
            "pass": ratio >= TARGET,
        }
    ]
    c.emit(
        {
            "bench": "fold",
            "repeats": args.repeats,
            "events": n,
            "rates": rate,
            "ratio": ratio,
            "ratio_vs_memory_decode": ratio_mem,
            "summary": summary,
        },
        md,
        args.json,
    )


if __name__ == "__main__":
    main()
