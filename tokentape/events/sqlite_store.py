"""The SQLite tape: an append-only event table in WAL mode, created through sqlite-utils.

Layout (see docs/tape-format.md):
- `meta(key, value)`: `format_version` (integer) and `header` (msgpack TapeHeader);
- `events(seq, step, kind, data)`: one row per event, `data` is the msgpack event.
Triggers refuse UPDATE and DELETE on both tables, and inserts that would replace a row.
`SQLiteTape` creates the file, then hands each step's rows to a writer process
(tokentape/events/sqlite_writer.py) that commits them as one transaction, so the SQLite work
runs on another core instead of inside the engine's step. WAL lets any other process read
while the tape is written.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import NoReturn

import msgspec
import sqlite_utils

from tokentape.events import schema as ev
from tokentape.events import sqlite_writer
from tokentape.events.store import TapeError, check_format_version, decode_at

_SQLITE_MAGIC = b"SQLite format 3\x00"
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


def _create_tape_file(path: str, header: ev.TapeHeader) -> None:
    """The empty tape: WAL mode, both tables with their triggers, and the header."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        db = sqlite_utils.Database(conn)
        db.enable_wal()
        db.table("meta").create({"key": str, "value": bytes}, pk="key")
        db.table("events").create({"seq": int, "step": int, "kind": str, "data": bytes}, pk="seq")
        for table in ("meta", "events"):
            conn.executescript(_APPEND_ONLY_TRIGGERS.format(table=table))
            conn.executescript(_APPEND_ONLY_INSERT[table])
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO meta(key, value) VALUES (?, ?)",
            [("format_version", ev.FORMAT_VERSION), ("header", ev.encode_header(header))],
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


class SQLiteTape:
    """Writes a new tape file. Refuses to overwrite an existing one.

    `append` encodes an event into the current transaction; `commit` (a step boundary) hands
    the transaction to the writer process and returns without waiting for SQLite. The writer
    commits each transaction whole and in order. What `commit` has handed over survives the
    engine's own death, even by SIGKILL: the writer drains its pipe, commits and exits.
    `flush` returns once everything committed is in the file, for readers in this process.
    If the writer process fails, the next `commit` or `flush` raises TapeError with its error.
    """

    def __init__(self, path: str | os.PathLike[str], header: ev.TapeHeader) -> None:
        self.path = os.fspath(path)
        self.header = header
        if os.path.exists(self.path):
            raise FileExistsError(f"{self.path}: a tape already exists here; choose a new path")
        _create_tape_file(self.path, header)
        self._writer = subprocess.Popen(
            [sys.executable, "-I", sqlite_writer.__file__, self.path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
        )
        assert self._writer.stdin is not None and self._writer.stdout is not None
        self._to_writer = self._writer.stdin.fileno()
        self._from_writer = self._writer.stdout
        self._buffer: list[tuple[int, int, str, bytes]] = []
        self._next_seq = 0
        self._failure: str | None = None
        # Ends the writer (it commits what it was sent, then exits) when the tape is closed,
        # dropped, or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_writer, self._writer)

    def append(self, event: ev.Event) -> None:
        self._buffer.append((self._next_seq, event.step, ev.KIND_OF_TYPE[type(event)], _encode(event)))
        self._next_seq += 1

    def commit(self) -> None:
        """End a transaction (a step boundary): the rows appended since go to the writer."""
        if not self._buffer:
            return
        self._send(sqlite_writer.frame_rows(self._buffer))
        self._buffer.clear()

    def flush(self) -> None:
        """Commit, and return once the writer has every committed row in the file."""
        if not self._finalizer.alive and not self._buffer and self._failure is None:
            return  # closed: everything is in the file already
        self.commit()
        self._send(sqlite_writer.FLUSH_REQUEST)
        if self._from_writer.read(1) != sqlite_writer.FLUSH_DONE:
            self._writer_failed()

    def _send(self, data: bytes) -> None:
        if self._failure is not None or not self._finalizer.alive:
            raise TapeError(self.path, self._failure or "the tape is closed")
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._to_writer, view):]
        except BrokenPipeError:
            self._writer_failed()

    def _writer_failed(self, stopped: tuple[int, str] | None = None) -> NoReturn:
        """Record and raise the writer's failure (stopping it first, unless the caller did)."""
        code, message = stopped or self._finalizer() or (None, "")
        self._failure = (
            f"the tape writer process stopped (exit code {code}: {message or 'no message'}); "
            f"the tape ends at its last commit, of the {self._next_seq} events appended"
        )
        raise TapeError(self.path, self._failure)

    @property
    def writer_pid(self) -> int:
        """The process id of the writer process (it outlives the engine until it has drained)."""
        return self._writer.pid

    def __len__(self) -> int:
        return self._next_seq

    def close(self) -> None:
        """Commit what is left, wait for the writer to finish, and report its failure."""
        if not self._finalizer.alive:
            return  # closed already, or the writer failed and that was reported
        try:
            self.commit()
        finally:
            stopped = self._finalizer()  # None when a failed commit has already stopped it
        if stopped is not None and stopped[0] != 0:
            self._writer_failed(stopped)


def _stop_writer(writer: subprocess.Popen[bytes]) -> tuple[int, str]:
    """Close the writer's input (it commits everything sent, then exits) and wait for it."""
    _, err = writer.communicate()
    return writer.returncode, err.decode(errors="replace").strip()


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
