"""The SQLite tape: an append-only event table in WAL mode, created through sqlite-utils.

Layout (see docs/tape-format.md):
- `meta(key, value)`: `format_version` (integer) and `header` (msgpack TapeHeader);
- `events(seq, step, kind, data)`: one row per event, `data` is the msgpack event.
Triggers refuse UPDATE and DELETE on both tables, and inserts that would replace a row. Rows
are buffered and written with one `executemany` per commit; the engine commits at every step
boundary, so a killed process leaves a tape that reads back up to its last completed step.
WAL lets another process read while the engine writes; checkpoints run on a background
thread (see SQLiteTape).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import weakref
from collections.abc import Iterator

import msgspec
import sqlite_utils

from tokentape.events import schema as ev
from tokentape.events.store import TapeError, check_format_version, decode_at

_SQLITE_MAGIC = b"SQLite format 3\x00"
_INSERT_EVENT = "INSERT INTO events(seq, step, kind, data) VALUES (?, ?, ?, ?)"
_encode = msgspec.msgpack.Encoder().encode
_READ_BATCH = 4096

_APPEND_ONLY_TRIGGERS = """
CREATE TRIGGER IF NOT EXISTS {table}_no_update BEFORE UPDATE ON {table}
BEGIN SELECT RAISE(ABORT, 'the tape is append-only'); END;
CREATE TRIGGER IF NOT EXISTS {table}_no_delete BEFORE DELETE ON {table}
BEGIN SELECT RAISE(ABORT, 'the tape is append-only'); END;
"""
# INSERT OR REPLACE deletes the old row without firing the DELETE trigger (SQLite fires it on
# REPLACE only with recursive_triggers), so inserts must be checked too.
_APPEND_ONLY_INSERT = {
    "events": """
CREATE TRIGGER IF NOT EXISTS events_append_only BEFORE INSERT ON events
WHEN NEW.seq != (SELECT COALESCE(MAX(seq), -1) + 1 FROM events)
BEGIN SELECT RAISE(ABORT, 'the tape is append-only'); END;
""",
    "meta": """
CREATE TRIGGER IF NOT EXISTS meta_append_only BEFORE INSERT ON meta
WHEN EXISTS (SELECT 1 FROM meta WHERE key = NEW.key)
BEGIN SELECT RAISE(ABORT, 'the tape is append-only'); END;
""",
}


class SQLiteTape:
    """Writes a new tape file. Refuses to overwrite an existing one."""

    def __init__(self, path: str | os.PathLike[str], header: ev.TapeHeader) -> None:
        self.path = os.fspath(path)
        self.header = header
        if os.path.exists(self.path):
            raise FileExistsError(f"{self.path}: a tape already exists here; choose a new path")
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db = sqlite_utils.Database(self._conn)
        db.enable_wal()
        self._conn.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash
        db["meta"].create({"key": str, "value": bytes}, pk="key")
        db["events"].create({"seq": int, "step": int, "kind": str, "data": bytes}, pk="seq")
        for table in ("meta", "events"):
            self._conn.executescript(_APPEND_ONLY_TRIGGERS.format(table=table))
            self._conn.executescript(_APPEND_ONLY_INSERT[table])
        self._conn.execute("BEGIN")
        self._conn.executemany(
            "INSERT INTO meta(key, value) VALUES (?, ?)",
            [("format_version", ev.FORMAT_VERSION), ("header", ev.encode_header(header))],
        )
        self._conn.execute("COMMIT")
        self._buffer: list[tuple[int, int, str, bytes]] = []
        self._next_seq = 0
        # Checkpoints (copying the WAL into the file) run on their own connection in a
        # background thread, not inside the engine's step: sqlite3 releases the GIL while
        # it copies, and a passive checkpoint never blocks the writer.
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        stop = threading.Event()
        checkpointer = threading.Thread(
            target=_checkpoint_periodically, args=(self.path, stop),
            name="tape-checkpointer", daemon=True,
        )
        checkpointer.start()
        # Stops the checkpointer and closes the file when the tape is closed, dropped, or the
        # interpreter exits.
        self._finalizer = weakref.finalize(self, _shut, stop, checkpointer, self._conn)

    def append(self, event: ev.Event) -> None:
        self._buffer.append((self._next_seq, event.step, ev.KIND_OF_TYPE[type(event)], _encode(event)))
        self._next_seq += 1

    def commit(self) -> None:
        """End a transaction (a step boundary): the rows appended since are written."""
        if not self._buffer:
            return
        conn = self._conn
        conn.execute("BEGIN")
        try:
            conn.executemany(_INSERT_EVENT, self._buffer)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        self._buffer.clear()

    def flush(self) -> None:
        self.commit()  # a commit is in the file (its WAL) when it returns

    def __len__(self) -> int:
        return self._next_seq

    def close(self) -> None:
        if self._finalizer.alive:
            try:
                self.commit()
            finally:
                self._finalizer()


_CHECKPOINT_INTERVAL_S = 0.25


def _checkpoint_periodically(path: str, stop: threading.Event) -> None:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        while not stop.wait(_CHECKPOINT_INTERVAL_S):
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
    except sqlite3.Error:
        pass  # a checkpoint is an optimisation; the WAL keeps every committed event
    finally:
        conn.close()


def _shut(stop: threading.Event, checkpointer: threading.Thread, conn: sqlite3.Connection) -> None:
    stop.set()
    checkpointer.join()
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # leave one self-contained file
    except sqlite3.Error:
        pass  # the WAL still holds every committed event; the next reader recovers it
    finally:
        conn.close()


def remove_tape_files(path: str | os.PathLike[str]) -> None:
    """Delete a tape file and the -wal / -shm files SQLite may keep beside it."""
    for p in (os.fspath(path), f"{os.fspath(path)}-wal", f"{os.fspath(path)}-shm"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def make_self_contained(path: str | os.PathLike[str]) -> None:
    """Switch a closed tape from WAL to a rollback journal: one file, readable read-only with
    no -wal / -shm beside it (for tapes that are kept or committed)."""
    conn = sqlite3.connect(os.fspath(path))
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()


class SQLiteTapeReader:
    """Reads a tape file, streaming events in batches. Safe while another process writes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise TapeError(self.path, "no such tape file")
        with open(self.path, "rb") as f:
            if f.read(16) != _SQLITE_MAGIC:
                raise TapeError(self.path, "not a tokentape tape (not an SQLite file)")
        self._conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        try:
            rows = dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as exc:
            # A truncated file (its header counts more pages than the file holds) is refused
            # whole by SQLite; writable_schema skips that check (the connection stays
            # read-only), so the intact prefix reads and iter_events names where it stops.
            try:
                self._conn.execute("PRAGMA writable_schema=ON")
                rows = dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
            except sqlite3.DatabaseError:
                self._conn.close()
                raise TapeError(self.path, f"not a tokentape tape or damaged header ({exc})") from None
        if "format_version" not in rows or "header" not in rows:
            self._conn.close()
            raise TapeError(self.path, "not a tokentape tape (no format version in its header)")
        check_format_version(int(rows["format_version"]), self.path)
        try:
            self.header = ev.decode_header(rows["header"])
        except Exception as exc:  # msgspec.DecodeError or a type mismatch
            self._conn.close()
            raise TapeError(self.path, f"the tape header cannot be decoded ({exc})") from None

    def __len__(self) -> int:
        try:
            (n,) = self._conn.execute("SELECT COUNT(*) FROM events").fetchone()
        except sqlite3.DatabaseError as exc:
            raise TapeError(self.path, f"the tape is damaged ({exc})") from None
        return n

    def iter_events(self, start: int = 0) -> Iterator[tuple[int, ev.Event]]:
        next_seq = start
        while True:
            damage: sqlite3.DatabaseError | None = None
            try:
                rows = self._conn.execute(
                    "SELECT seq, data FROM events WHERE seq >= ? ORDER BY seq LIMIT ?",
                    (next_seq, _READ_BATCH),
                ).fetchall()
            except sqlite3.DatabaseError as exc:
                # A page of this batch is lost: read on row by row, so that every event before
                # the break is returned and the error names the first one that is not.
                rows, damage = self._rows_until_damage(next_seq)
                damage = damage or exc
            if not rows and damage is None:
                return
            for seq, data in rows:
                if seq != next_seq:
                    raise TapeError(self.path, f"events are missing (next is {seq})", next_seq)
                yield seq, decode_at(data, seq, self.path)
                next_seq += 1
            if damage is not None:
                raise TapeError(self.path, f"the tape is truncated or damaged ({damage})", next_seq)

    def _rows_until_damage(self, start: int) -> tuple[list[tuple[int, bytes]], sqlite3.DatabaseError | None]:
        rows: list[tuple[int, bytes]] = []
        for seq in range(start, start + _READ_BATCH):
            try:
                row = self._conn.execute("SELECT seq, data FROM events WHERE seq = ?", (seq,)).fetchone()
            except sqlite3.DatabaseError as exc:
                return rows, exc
            if row is None:
                break
            rows.append(row)
        return rows, None

    def close(self) -> None:
        self._conn.close()
