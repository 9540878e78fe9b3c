"""`bisect(a, b)`: the first event at which two tapes differ, found by binary search.

Each probe is one seek per tape: the event at position m, read by its `seq` (the primary key
of an SQLite tape, so a B-tree lookup) and compared as raw msgpack bytes, decoded only when
the bytes differ. The search assumes that two tapes equal at position m are equal before it,
so it reads O(log n) events where a linear scan reads them all.

That assumption can fail: two tapes may diverge and then agree again at the same positions
(one corrupted token on an otherwise identical run). No search that reads fewer events than
the common prefix can be exact, so the prefix before the candidate is then confirmed in one
pass that SQLite runs itself, comparing the two files' `data` bytes row by row (nothing is
decoded); if it finds an earlier difference, that one is the answer, and the result says the
tapes re-converged. `confirm=False` skips the pass (O(log n) seeks only).
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokentape.events import schema as ev
from tokentape.events.sqlite_reader import SQLiteTapeReader, open_readonly, tape_file_status
from tokentape.events.store import MemoryTape, decode_at
from tokentape.replay.export import to_builtin
from tokentape.replay.tape import Tape, load_tape

TapeSource = str | os.PathLike[str] | MemoryTape | Tape
_HEADER_IGNORED = ("created_at", "package_version")  # differ between any two runs


class _Rows:
    """Point reads of one tape's events, as raw bytes, counting the seeks."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.path = tape.path
        self.seeks = 0
        self.conn: sqlite3.Connection | None = None
        self.length: int
        if isinstance(tape.reader, SQLiteTapeReader):
            self.conn = open_readonly(tape.path)  # type: ignore[arg-type]
            ((last,),) = self.conn.execute("SELECT MAX(seq) FROM events").fetchall()
            self.length = 0 if last is None else last + 1  # not COUNT(*): no full scan
        else:
            self.length = len(tape)

    def raw(self, seq: int) -> bytes:
        self.seeks += 1
        if self.conn is None:
            return ev.encode(next(self.tape.events(seq))[1])
        row = self.conn.execute("SELECT data FROM events WHERE seq = ?", (seq,)).fetchone()
        return bytes(row[0])

    def event(self, seq: int) -> ev.Event | None:
        if seq >= self.length:
            return None
        if self.conn is None:
            return next(self.tape.events(seq))[1]
        row = self.conn.execute("SELECT data FROM events WHERE seq = ?", (seq,)).fetchone()
        return decode_at(row[0], seq, self.path)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def _same(a: _Rows, b: _Rows, seq: int) -> bool:
    x, y = a.raw(seq), b.raw(seq)
    if x == y:
        return True
    return decode_at(x, seq, a.path) == decode_at(y, seq, b.path)  # another encoding, same event


def _readonly_uri(path: str) -> str:
    uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
    status = tape_file_status(path)
    return uri + (
        "&immutable=1" if status.journal_mode == "wal" and status.wal_bytes is None else ""
    )


def _first_mismatch_before(a: _Rows, b: _Rows, end: int) -> int | None:
    """The first position before `end` where the tapes' bytes differ: one pass, run by SQLite
    when both are files, else event by event."""
    if a.conn is not None and b.conn is not None and b.path is not None:
        a.conn.execute("ATTACH DATABASE ? AS other", (_readonly_uri(b.path),))
        try:
            row = a.conn.execute(
                "SELECT x.seq FROM main.events x JOIN other.events y ON y.seq = x.seq "
                "WHERE x.seq < ? AND x.data != y.data ORDER BY x.seq LIMIT 1",
                (end,),
            ).fetchone()
        finally:
            a.conn.execute("DETACH DATABASE other")
        if row is None:
            return None
        # Bytes differ: the events may still be equal (another encoding of the same values).
        if not _same(a, b, row[0]):
            return int(row[0])
        start = row[0] + 1
    else:
        start = 0
    for (s, x), (_, y) in zip(a.tape.events(start), b.tape.events(start)):
        if s >= end:
            break
        if x != y:
            return s
    return None


@dataclass(slots=True)
class BisectResult:
    a: str
    b: str
    len_a: int
    len_b: int
    index: int | None  # the first position where the tapes differ; None when identical
    event_a: ev.Event | None = None  # the events there (None: that tape has ended)
    event_b: ev.Event | None = None
    seeks: int = 0  # probes of the binary search (one event read from each tape per probe)
    confirmed: bool = True  # the prefix before the candidate was checked
    reconverged: bool = False  # the confirmation found an earlier difference
    header_differences: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.index is None

    def to_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        for name in ("event_a", "event_b"):
            event = out[name]
            out[name] = None if event is None else {"kind": ev.kind_of(event), **to_builtin(event)}
        out["identical"] = self.identical
        return out


def _header_differences(a: Tape, b: Tape) -> list[str]:
    x, y = msgspec.to_builtins(a.header), msgspec.to_builtins(b.header)
    diffs = []
    for key in x:
        if key in _HEADER_IGNORED or x[key] == y.get(key):
            continue
        if isinstance(x[key], dict) and isinstance(y.get(key), dict):
            for k in sorted(set(x[key]) | set(y[key])):
                if x[key].get(k) != y[key].get(k):
                    diffs.append(f"{key}.{k}: {x[key].get(k)!r} != {y[key].get(k)!r}")
        else:
            diffs.append(f"{key}: {x[key]!r} != {y.get(key)!r}")
    return diffs


def bisect(a: TapeSource, b: TapeSource, confirm: bool = True) -> BisectResult:
    """The first event at which tapes `a` and `b` differ (their headers are compared apart:
    `header_differences`). An event only one tape has (the other ended) is a difference."""
    ta, tb = load_tape(a), load_tape(b)
    ra, rb = _Rows(ta), _Rows(tb)
    try:
        n = min(ra.length, rb.length)
        lo, hi, probes = 0, n, 0
        while lo < hi:  # invariant: equal before lo (assumed), different at hi (or hi == n)
            mid = (lo + hi) // 2
            probes += 1
            if _same(ra, rb, mid):
                lo = mid + 1
            else:
                hi = mid
        result = BisectResult(
            str(ta.path),
            str(tb.path),
            ra.length,
            rb.length,
            None,
            seeks=probes,
            confirmed=confirm,
            header_differences=_header_differences(ta, tb),
        )
        index: int | None = lo if lo < n or ra.length != rb.length else None
        if confirm and lo > 0:
            earlier = _first_mismatch_before(ra, rb, lo)
            if earlier is not None:
                index, result.reconverged = earlier, True
        result.index = index
        if index is not None:
            result.event_a, result.event_b = ra.event(index), rb.event(index)
        return result
    finally:
        ra.close()
        rb.close()


def linear_first_difference(a: TapeSource, b: TapeSource) -> int | None:
    """The reference: read both tapes from the start and compare event by event."""
    ta, tb = load_tape(a), load_tape(b)
    ea, eb = ta.events(), tb.events()
    seq = 0
    while True:
        x, y = next(ea, None), next(eb, None)
        if x is None and y is None:
            return None
        if x is None or y is None or x[1] != y[1]:
            return seq
        seq += 1
