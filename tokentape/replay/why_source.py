"""The events of one request, found by seeks: what `tokentape why` folds.

A request's derived state depends only on the events that name it and on the frames of the
steps it was scheduled in (the reducer never changes a request another event names), so one
request can be explained from its own events, without folding the tape around them.

On an SQLite tape they are found without reading the whole file:
- where the request was added: a request index (req_id -> position of its `RequestAdded`),
  built once by one SQL pass over the `RequestAdded` rows (their `kind` column; no event is
  folded) and kept in a small SQLite file under the cache directory
  (`$XDG_CACHE_HOME/tokentape/why`, else `~/.cache/tokentape/why`), keyed by the tape's path,
  size, modification time and event count. Nothing is written beside the tape; a tape still
  being written is indexed every time, and an unwritable cache is skipped;
- from there on: the rows whose msgpack `data` holds the request id's msgpack encoding
  (`instr`, run by SQLite in a range scan by `seq`, the primary key), decoded and checked, so
  a false match costs one decode; a step's frame that does not name the request (the request
  had a prefill chunk in it) is read by a bounded scan from its `StepScheduled`.
The reader stops as soon as its consumer has what it needs (`WhySource.events` is lazy).
Any other tape (in memory) is scanned from the start: the same events, no index.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import sqlite3
from collections.abc import Iterator

import msgspec

from tokentape.events import schema as ev
from tokentape.events.sqlite_reader import SQLiteTapeReader, open_readonly, tape_file_status
from tokentape.events.store import TapeError, decode_at
from tokentape.replay.tape import Tape

_WINDOW = 1024  # rows scanned by the first query for a request's events; doubled each time
_MAX_WINDOW = 1 << 13  # past the request's end, a window is scanned for nothing


def cache_dir() -> str:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "tokentape", "why")


def _names(event: ev.Event, req_id: str) -> bool:
    """Whether the event is about `req_id` (a candidate row may match by accident)."""
    entries = getattr(event, "entries", None)
    if entries is not None:
        return any(e.req_id == req_id for e in entries)
    return getattr(event, "req_id", None) == req_id


class _RequestIndex:
    """req_id -> position of its RequestAdded: in memory, or an SQLite file in the cache
    directory (a primary-key lookup, nothing loaded whole)."""

    def __init__(self, table: dict[str, int] | None, conn: sqlite3.Connection | None) -> None:
        self.table, self.conn = table, conn

    @staticmethod
    def _file(key: str) -> str:
        return os.path.join(cache_dir(), f"{key}.requests")

    @classmethod
    def load(cls, key: str) -> _RequestIndex | None:
        path = cls._file(key)
        if not os.path.exists(path):
            return None
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            conn.execute("SELECT seq FROM requests LIMIT 1").fetchall()
        except sqlite3.Error:
            return None  # a damaged cache is rebuilt
        return cls(None, conn)

    @classmethod
    def build(cls, tape: sqlite3.Connection, path: str | None, key: str | None) -> _RequestIndex:
        table: dict[str, int] = {}
        for seq, data in tape.execute("SELECT seq, data FROM events WHERE kind = 'RequestAdded'"):
            table.setdefault(decode_at(data, seq, path).req_id, seq)  # type: ignore[attr-defined]
        if key:
            cls._store(key, table)
        return cls(table, None)

    @classmethod
    def _store(cls, key: str, table: dict[str, int]) -> None:
        path = cls._file(key)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            conn = sqlite3.connect(tmp)
            try:
                conn.execute(
                    "CREATE TABLE requests (req_id TEXT PRIMARY KEY, seq INTEGER) WITHOUT ROWID"
                )
                conn.executemany("INSERT INTO requests VALUES (?, ?)", table.items())
                conn.commit()
            finally:
                conn.close()
            os.replace(tmp, path)  # readers never see half a file
        except (OSError, sqlite3.Error):
            try:
                os.remove(tmp)
            except OSError:
                pass  # no cache: the next call indexes again

    def get(self, req_id: str) -> int | None:
        if self.table is not None:
            return self.table.get(req_id)
        assert self.conn is not None
        row = self.conn.execute("SELECT seq FROM requests WHERE req_id = ?", (req_id,)).fetchone()
        return None if row is None else int(row[0])

    def first(self, limit: int) -> list[str]:
        if self.table is not None:
            return list(self.table)[:limit]
        assert self.conn is not None
        rows = self.conn.execute("SELECT req_id FROM requests ORDER BY seq LIMIT ?", (limit,))
        return [r[0] for r in rows]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class WhySource:
    """The events of one tape that name a request, in tape order, plus step lookups."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.path = tape.path
        self._conn: sqlite3.Connection | None = None
        self.num_events: int
        self.index_built = False  # whether this call had to build the request index
        self.rows_read = 0  # rows decoded (candidates, frames): the cost of the answer
        self._index: _RequestIndex | None = None
        if isinstance(tape.reader, SQLiteTapeReader):
            self._conn = open_readonly(self.path)
            # The last seq, not COUNT(*): that would read every page of the table.
            ((last,),) = self._conn.execute("SELECT MAX(seq) FROM events").fetchall()
            self.num_events = 0 if last is None else last + 1
        else:
            self.num_events = len(tape)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._index is not None:
            self._index.close()

    # -- where a request starts --------------------------------------------------------------

    def added_seq(self, req_id: str) -> int | None:
        """The position of the request's `RequestAdded`, or None if the tape never adds it."""
        if self._conn is None:
            for seq, event in self.tape.events():
                if type(event) is ev.RequestAdded and event.req_id == req_id:
                    return seq
            return None
        return self._request_index().get(req_id)

    def request_ids(self, limit: int = 10) -> list[str]:
        """Some request ids of the tape, for an error message."""
        if self._conn is None:
            return [e.req_id for _, e in self.tape.events() if type(e) is ev.RequestAdded][:limit]
        return self._request_index().first(limit)

    def _request_index(self) -> _RequestIndex:
        if self._index is None:
            assert self._conn is not None
            key = self._cache_key()
            self._index = _RequestIndex.load(key) if key else None
            if self._index is None:
                self._index = _RequestIndex.build(self._conn, self.path, key)
                self.index_built = True
        return self._index

    def _cache_key(self) -> str | None:
        if self.path is None:
            return None
        try:
            if not tape_file_status(self.path).finished:
                return None  # still written (or never finished): it may grow
            st = os.stat(self.path)
        except (OSError, TapeError):
            return None
        ident = f"{os.path.realpath(self.path)}\0{st.st_size}\0{st.st_mtime_ns}\0{self.num_events}"
        return hashlib.sha256(ident.encode()).hexdigest()[:32]

    # -- the request's events ------------------------------------------------------------------

    def events(self, req_id: str, start: int) -> Iterator[tuple[int, ev.Event]]:
        """(seq, event) from `start` on: every event that names `req_id`, and every
        `FrameProduced` (a consumer asks `frame_of` for one it is missing) in tape order."""
        if self._conn is None:
            for seq, event in self.tape.events(start):
                self.rows_read += 1
                if type(event) is ev.FrameProduced or _names(event, req_id):
                    yield seq, event
            return
        needle = msgspec.msgpack.encode(req_id)
        # In windows of rows: a cursor asked for a batch would scan on to the end of the tape
        # for matches nobody needs once the request has settled.
        lo, width, end = start, _WINDOW, self.num_events
        while lo < end:
            rows = self._conn.execute(
                "SELECT seq, data FROM events WHERE seq >= ? AND seq < ? AND instr(data, ?) > 0 "
                "ORDER BY seq",
                (lo, lo + width, needle),
            ).fetchall()
            for seq, data in rows:
                self.rows_read += 1
                event = decode_at(data, seq, self.path)
                if _names(event, req_id):
                    yield seq, event
            lo += width
            width = min(width * 2, _MAX_WINDOW)

    def frame_of(self, step: int, after: int) -> tuple[int, ev.FrameProduced] | None:
        """The `FrameProduced` of `step`, searched from position `after` on (its frame comes
        within the pipeline's depth of steps), or None if the tape ends first."""
        if self._conn is None:
            for seq, event in self.tape.events(after):
                if type(event) is ev.FrameProduced and event.step == step:
                    return seq, event
            return None
        row = self._conn.execute(
            "SELECT seq, data FROM events WHERE seq > ? AND kind = 'FrameProduced' AND step = ? "
            "ORDER BY seq LIMIT 1",
            (after, step),
        ).fetchone()
        if row is None:
            return None
        self.rows_read += 1
        return row[0], decode_at(row[1], row[0], self.path)  # type: ignore[return-value]


def merged(
    main: Iterator[tuple[int, ev.Event]], extra: list[tuple[int, ev.Event]]
) -> Iterator[tuple[int, ev.Event]]:
    """`main` with the (seq, event) pairs pushed onto the heap `extra` while it is consumed,
    in seq order, each position once."""
    last = -1
    for seq, event in main:
        while extra and extra[0][0] < seq:
            s, e = heapq.heappop(extra)
            if s > last:
                last = s
                yield s, e
        if seq > last:
            last = seq
            yield seq, event
    while extra:
        s, e = heapq.heappop(extra)
        if s > last:
            last = s
            yield s, e
