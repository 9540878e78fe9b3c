"""(a) Tape append rate: SQLiteTape against raw sqlite3 executemany of the same events.

The events come from a real engine run: the oracle model, 64 requests of mixed prompt lengths
and max_tokens, default engine config (async scheduling, depth 2), recorded through an
in-memory tape that also notes where the engine committed (after every command and at every
step boundary). Every writer writes those events, cycled to TARGET_EVENTS, in the same commit
batches, to a fresh file each repeat:

- store: `SQLiteTape.append(event)` for each event, `commit()` at each recorded boundary, and
  a final `close()`;
- raw (the baseline): `sqlite3` with the store's table schema (`events(seq INTEGER PRIMARY
  KEY, step INTEGER, kind TEXT, data BLOB)`), WAL, synchronous=NORMAL, each event encoded
  with the same msgpack encoder as it is written (events are Python objects: any writer has
  to serialise them), `BEGIN; executemany; COMMIT` per batch, then `close()`.

Opening the file (table creation, header) is outside the timing on every side.
Two informational rows: "raw, pre-encoded" serialises outside the timed loop (SQLite alone),
and "raw + the store's triggers" adds the append-only triggers SQLiteTape puts on its events
table, so the table shows what encoding and the triggers each cost.

Target: store >= 0.8x raw events/s.

    python benchmarks/bench_tape_append.py [--repeats 15] [--json out.json]
"""

from __future__ import annotations

import random
import sqlite3
import time
from collections import Counter

import _common as c

from tokentape import LLM, SamplingParams
from tokentape.events import schema as ev
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.events.store import MemoryTape

NUM_REQUESTS = 64
TARGET_EVENTS = 40_000
TARGET = 0.8
_INSERT = "INSERT INTO events(seq, step, kind, data) VALUES (?, ?, ?, ?)"


class _CommitRecordingTape(MemoryTape):
    """A memory tape that remembers how many events each (non-empty) commit wrote."""

    def __init__(self, header: ev.TapeHeader) -> None:
        super().__init__(header)
        self.batch_sizes: list[int] = []
        self._committed = 0

    def commit(self) -> None:
        if len(self._rows) > self._committed:
            self.batch_sizes.append(len(self._rows) - self._committed)
            self._committed = len(self._rows)

    def close(self) -> None:
        self.commit()


def record_workload() -> tuple[ev.TapeHeader, list[ev.Event], list[int]]:
    rng = random.Random(1234)
    llm = LLM(model="oracle", tape=None)
    rec = llm.llm_engine.engine_core.tape = _CommitRecordingTape(
        llm.llm_engine.engine_core.tape.header
    )
    prompts = [
        [rng.randrange(3, 259) for _ in range(rng.randint(16, 512))] for _ in range(NUM_REQUESTS)
    ]
    params = [SamplingParams(max_tokens=rng.randint(16, 256), seed=i) for i in range(NUM_REQUESTS)]
    llm.generate(prompts, params)
    llm.close()
    events = [e for _, e in rec.iter_events()]
    assert sum(rec.batch_sizes) == len(events)
    return rec.header, events, rec.batch_sizes


def cycle(events: list[ev.Event], sizes: list[int], target: int) -> list[list[ev.Event]]:
    """The recorded events in their commit batches, repeated until `target` events."""
    batches, i, total = [], 0, 0
    while total < target:
        for n in sizes:
            batches.append(events[i : i + n])
            i, total = i + n, total + n
        i = 0
    return batches


def open_raw(path: str, triggers: list[str] = ()) -> sqlite3.Connection:  # type: ignore[assignment]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(
        "CREATE TABLE events (seq INTEGER PRIMARY KEY, step INTEGER, kind TEXT, data BLOB)"
    )
    for sql in triggers:
        conn.execute(sql)
    return conn


def store_triggers(path: str, header: ev.TapeHeader) -> list[str]:
    """The triggers SQLiteTape puts on its events table (append-only enforcement)."""
    SQLiteTape(path, header).close()
    with sqlite3.connect(path) as conn:
        sql = [
            s
            for (s,) in conn.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'events'"
            )
        ]
    conn.close()
    return sql


def main() -> None:
    args = c.parse_args(__doc__.splitlines()[0], default_repeats=15)
    header, events, sizes = record_workload()
    batches = cycle(events, sizes, TARGET_EVENTS)
    n_events = sum(len(b) for b in batches)
    seq = 0
    row_batches = []
    for b in batches:
        rows = []
        for e in b:
            rows.append((seq, e.step, ev.kind_of(e), ev.encode(e)))
            seq += 1
        row_batches.append(rows)
    tmp = c.TempDir()
    last: dict[str, str] = {}

    def store() -> float:
        last["store"] = path = tmp.new("store")
        tape = SQLiteTape(path, header)
        tape.flush()  # opening includes starting the tape's writer process: untimed, as above
        append, commit = tape.append, tape.commit
        with c.gc_collected():
            t0 = time.perf_counter()
            for batch in batches:
                for e in batch:
                    append(e)
                commit()
            tape.close()
            return time.perf_counter() - t0

    def write_raw(triggers: list[str] = ()) -> float:  # type: ignore[assignment]
        """Pre-encoded rows through plain sqlite3, optionally with the store's triggers."""
        conn = open_raw(tmp.new("raw"), triggers)
        execute, executemany = conn.execute, conn.executemany
        with c.gc_collected():
            t0 = time.perf_counter()
            for rows in row_batches:
                execute("BEGIN")
                executemany(_INSERT, rows)
                execute("COMMIT")
            conn.close()
            return time.perf_counter() - t0

    triggers = store_triggers(tmp.new("schema"), header)

    def raw_encode() -> float:
        last["raw"] = path = tmp.new("rawenc")
        conn = open_raw(path)
        execute, executemany = conn.execute, conn.executemany
        encode, kind_of = ev.encode, ev.kind_of
        with c.gc_collected():
            t0 = time.perf_counter()
            s = 0
            for batch in batches:
                rows = []
                for e in batch:
                    rows.append((s, e.step, kind_of(e), encode(e)))
                    s += 1
                execute("BEGIN")
                executemany(_INSERT, rows)
                execute("COMMIT")
            conn.close()
            return time.perf_counter() - t0

    try:
        variants = {"store": store, "raw": write_raw, "raw_encode": raw_encode}
        if triggers:
            variants["raw_triggers"] = lambda: write_raw(triggers)
        best = c.best_of(variants, repeats=args.repeats)
        # Both sides wrote the same rows: the comparison is like for like.
        query = "SELECT seq, step, kind, data FROM events ORDER BY seq"
        with sqlite3.connect(last["store"]) as a, sqlite3.connect(last["raw"]) as b:
            assert a.execute(query).fetchall() == b.execute(query).fetchall()
        a.close()
        b.close()
    finally:
        tmp.cleanup()
    rate = {k: n_events / v for k, v in best.items()}
    ratio = rate["store"] / rate["raw_encode"]
    kinds = Counter(ev.kind_of(e) for e in events)
    mean_bytes = sum(len(r[3]) for rows in row_batches for r in rows) / n_events

    def row(label: str, key: str, target: str = "") -> list[str]:
        return [
            label,
            c.fmt_rate(rate[key]),
            f"{best[key] * 1e3:,.1f}",
            f"{rate[key] / rate['raw_encode']:.3f}x",
            target,
        ]

    rows = [
        row(
            "`SQLiteTape` (append + commit per step + close)",
            "store",
            f">= {TARGET}x: {c.verdict(ratio >= TARGET)}",
        ),
        row("raw `sqlite3` executemany, encoding each event (baseline)", "raw_encode"),
        row("raw `sqlite3` executemany, pre-encoded: SQLite alone (info)", "raw"),
    ]
    if triggers:
        rows.append(
            row(
                f"raw, pre-encoded, + the store's {len(triggers)} triggers on `events` (info)",
                "raw_triggers",
            )
        )
    md = (
        f"### (a) Tape append rate (best of {args.repeats})\n\n"
        f"{n_events:,} events ({len(events)} recorded from {NUM_REQUESTS} requests, cycled), "
        f"{len(batches):,} commits (mean {n_events / len(batches):.2f} events per commit), "
        f"mean event {mean_bytes:,.0f} bytes; mix: "
        + ", ".join(f"{k} {v}" for k, v in kinds.most_common())
        + "\n\n"
        + c.md_table(["writer", "events/s", "time (ms)", "vs raw", "target"], rows)
    )
    summary = [
        {
            "name": "tape append (store / raw)",
            "value": f"{ratio:.3f}x "
            f"({c.fmt_rate(rate['store'])} vs {c.fmt_rate(rate['raw_encode'])} events/s; "
            f"{rate['store'] / rate['raw']:.3f}x of pre-encoded)",
            "target": f">= {TARGET}x",
            "pass": ratio >= TARGET,
        }
    ]
    c.emit(
        {
            "bench": "tape_append",
            "repeats": args.repeats,
            "events": n_events,
            "commits": len(batches),
            "rates": rate,
            "ratio": ratio,
            "summary": summary,
        },
        md,
        args.json,
    )


if __name__ == "__main__":
    main()
