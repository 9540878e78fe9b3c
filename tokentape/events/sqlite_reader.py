"""Reading a tape file: `SQLiteTapeReader`, and what the file itself says about its state.

Readers open the tape read-only and leave nothing beside it: a closed tape is in rollback-
journal mode, which a read-only connection reads without a -wal or -shm file. A WAL-mode tape
with no -wal beside it (its writer finished before tapes were switched back to a rollback
journal, or the file was copied alone) holds everything in the file and is opened as
immutable, which needs no -shm either. A live tape (WAL mode, -wal beside it) is read through
its WAL, as SQLite's readers share it with the writer.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from collections.abc import Iterator
from typing import NamedTuple

from tokentape.events import schema as ev
from tokentape.events.store import TapeError, check_format_version, decode_at

SQLITE_MAGIC = b"SQLite format 3\x00"
_READ_BATCH = 4096


class TapeFileStatus(NamedTuple):
    """What the file says about how its writing ended, without opening it through SQLite.

    `journal_mode`: "rollback" once a writer finished (or the tape was repaired or copied),
    "wal" while it is written, or when its writer did not finish; `wal_bytes`: the size of the
    -wal file beside it (None when there is none); `shm`: whether a -shm file is beside it."""

    journal_mode: str
    wal_bytes: int | None
    shm: bool

    @property
    def finished(self) -> bool:
        """The writer finished: the tape is one self-contained file."""
        return self.journal_mode == "rollback"

    @property
    def self_contained(self) -> bool:
        """Every committed event is in the file itself (copying it alone loses nothing)."""
        return self.finished or not self.wal_bytes


def tape_file_status(path: str | os.PathLike[str]) -> TapeFileStatus:
    """Read the SQLite header's journal-mode bytes and look beside the file. Raises TapeError
    for a file that is not an SQLite file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError as exc:
        raise TapeError(path, f"cannot read the tape file ({exc.strerror or exc})") from None
    if len(head) < 20 or head[:16] != SQLITE_MAGIC:
        raise TapeError(path, "not a tokentape tape (not an SQLite file)")
    # Bytes 18 and 19 are the file format's write and read versions: 2 for WAL, 1 for legacy.
    mode = "wal" if head[18] == 2 else "rollback"
    try:
        wal_bytes: int | None = os.path.getsize(f"{path}-wal")
    except OSError:
        wal_bytes = None
    return TapeFileStatus(mode, wal_bytes, os.path.exists(f"{path}-shm"))


def open_readonly(path: str) -> sqlite3.Connection:
    """A read-only connection in autocommit mode (no implicit transaction) that creates no file
    beside a closed tape (see the module's docstring)."""
    uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
    status = tape_file_status(path)
    if status.journal_mode == "wal" and status.wal_bytes is None:
        uri += "&immutable=1"  # no WAL, so no writer: nothing can change under this reader
    return sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)


class SQLiteTapeReader:
    """Reads a tape file, streaming events in batches. Safe while another process writes.

    Each read is one statement run to its end, so no read transaction stays open between
    calls or between two batches of `iter_events`: a reader never holds the writer's WAL."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise TapeError(self.path, "no such tape file")
        self._conn = open_readonly(self.path)
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
                raise TapeError(
                    self.path, f"not a tokentape tape or damaged header ({exc})"
                ) from None
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
            ((n,),) = self._conn.execute("SELECT COUNT(*) FROM events").fetchall()
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

    def _rows_until_damage(
        self, start: int
    ) -> tuple[list[tuple[int, bytes]], sqlite3.DatabaseError | None]:
        rows: list[tuple[int, bytes]] = []
        for seq in range(start, start + _READ_BATCH):
            try:
                row = self._conn.execute(
                    "SELECT seq, data FROM events WHERE seq = ?", (seq,)
                ).fetchone()
            except sqlite3.DatabaseError as exc:
                return rows, exc
            if row is None:
                break
            rows.append(row)
        return rows, None

    def vacuum_into(self, dst: str) -> None:
        """Write a compact copy of this tape, as one consistent snapshot, into `dst` (which must
        not exist or be empty): see sqlite_store.copy_tape."""
        try:
            self._conn.execute("VACUUM INTO ?", (dst,))
        except sqlite3.DatabaseError as exc:
            raise TapeError(self.path, f"the tape cannot be copied ({exc})") from None

    def close(self) -> None:
        self._conn.close()
