"""The SQLite tape: an append-only event table, created through sqlite-utils.

Layout (see docs/tape-format.md):
- `meta(key, value)`: `format_version` (integer) and `header` (msgpack TapeHeader);
- `events(seq, step, kind, data)`: one row per event, `data` is the msgpack event.
Triggers refuse UPDATE and DELETE on both tables, and inserts that would replace a row.
`SQLiteTape` creates the file, then hands each step's rows to a writer process
(tokentape/events/sqlite_writer.py) that commits them, so the SQLite work runs on another
core instead of inside the engine's step. While it is written the tape is in WAL mode, so any
other process may read it; the writer leaves it as one file in rollback-journal mode.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import warnings
import weakref
from collections import deque
from collections.abc import Iterable
from typing import NoReturn

import msgspec
import sqlite_utils

from tokentape.events import schema as ev
from tokentape.events import sqlite_repair, sqlite_writer
from tokentape.events.sqlite_reader import SQLiteTapeReader, TapeFileStatus, tape_file_status
from tokentape.events.sqlite_repair import TapeWriterError, account_for_loss, repair_tape
from tokentape.events.store import TapeError

__all__ = [
    "SQLiteTape",
    "SQLiteTapeReader",
    "TapeFileStatus",
    "TapeWarning",
    "TapeWriterError",
    "copy_tape",
    "make_self_contained",
    "remove_tape_files",
    "repair_tape",
    "tape_file_status",
    "write_tape",
]

_encode = msgspec.msgpack.Encoder().encode
_TRIM_EVERY = 1024  # commits between two looks at what the writer has confirmed
# The folder that holds the msgspec package this process imported: the isolated writer
# process looks there too (sqlite_writer.py).
_MSGSPEC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(msgspec.__file__)))

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


class TapeWarning(UserWarning):
    """The tape is complete but not one file: a reader held the WAL when it was closed."""


def _create_tape_file(path: str, header: ev.TapeHeader) -> None:
    """The empty tape, in rollback-journal mode (the writer switches it to WAL, so a WAL-mode
    file with no -wal beside it is never a live tape): both tables, triggers, the header.
    Made under another name and renamed into place, so a process killed halfway never leaves
    a file at `path` without its header (a segmented tape's readers list such paths)."""
    part = f"{path}.creating"
    remove_tape_files(part)  # what an earlier death halfway left
    _build_tape_file(part, header)
    os.replace(part, path)


def _build_tape_file(path: str, header: ev.TapeHeader) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        db = sqlite_utils.Database(conn)
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


def _shared_ack_fd() -> int:
    """A file descriptor of 8 zeroed bytes to share with the writer (memory, not disk, where
    the platform allows)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("tokentape-ack", os.MFD_CLOEXEC)
    else:
        fd, name = tempfile.mkstemp(prefix="tokentape-ack-")
        os.unlink(name)
    os.ftruncate(fd, 8)
    return fd


class SQLiteTape:
    """Writes a new tape file. Refuses to overwrite an existing one.

    `append` encodes an event into the current transaction; `commit` (a step boundary) hands
    the transaction to the writer process and returns without waiting for SQLite. The writer
    commits the transactions in order, never splitting one. What `commit` has handed over
    survives the engine's own death, even by SIGKILL: the writer drains its pipe, commits and
    exits, leaving one self-contained file. `flush` returns once everything committed is in
    the file, for readers in this process.

    If the writer process fails or is killed, the next `commit`, `flush` or `close` raises
    TapeWriterError, naming the events (and steps) handed over but never committed; the file
    is repaired into one file that ends at the writer's last commit, followed, when events
    were lost, by an EngineError that says so. A transaction whose hand-over an interrupt
    (a Ctrl-C) cut short ends the writer's input instead; the rest goes into the file from
    this process, nothing lost.
    """

    def __init__(self, path: str | os.PathLike[str], header: ev.TapeHeader) -> None:
        self.path = os.fspath(path)
        self.header = header
        if os.path.exists(self.path):
            raise FileExistsError(f"{self.path}: a tape already exists here; choose a new path")
        _create_tape_file(self.path, header)
        ack_fd = _shared_ack_fd()
        try:
            self._ack = sqlite_writer.map_ack(ack_fd)
            # Its own process group: a terminal's Ctrl-C (or Ctrl-Z) goes to the
            # engine's group, and the engine, not the signal, ends the writer (end of stdin).
            self._writer = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    sqlite_writer.__file__,
                    self.path,
                    str(ack_fd),
                    _MSGSPEC_DIR,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                bufsize=0,
                pass_fds=(ack_fd,),
                process_group=0,
            )
        finally:
            os.close(ack_fd)  # the mapping keeps its own reference
        assert self._writer.stdin is not None and self._writer.stdout is not None
        self._to_writer = self._writer.stdin.fileno()
        self._from_writer = self._writer.stdout
        self._buffer: list[tuple[int, int, str, bytes]] = []
        self._next_seq = 0
        self.num_bytes = 0  # encoded events appended (a segmented tape closes a segment on it)
        # (end seq, message) of each commit the writer has not confirmed yet: what a failure
        # report needs, trimmed against the writer's acknowledgement every _TRIM_EVERY commits.
        self._unconfirmed: deque[tuple[int, bytes]] = deque()
        self._trim_at = _TRIM_EVERY
        self._failure: TapeWriterError | None = None
        # Set while a message is being handed over: an interrupt (a Ctrl-C) can stop the
        # write halfway, and the writer would read what follows as the message's rest.
        self._torn = False
        self._in_process = False  # after a torn message: rows go into the file from here
        # Ends the writer (it commits what it was sent, then exits) when the tape is closed,
        # dropped, or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_writer, self._writer)

    def append(self, event: ev.Event) -> None:
        data = _encode(event)
        # The count moves before the row goes in: an interrupt between the two must not
        # leave the next row the same seq.
        self._next_seq += 1
        self._buffer.append((self._next_seq - 1, event.step, ev.KIND_OF_TYPE[type(event)], data))
        self.num_bytes += len(data)

    def commit(self) -> None:
        """End a transaction (a step boundary): the rows appended since go to the writer."""
        if self._torn:
            self._end_torn_stream()
        if not self._buffer:
            return
        if self._in_process:
            sqlite_repair.append_rows(self.path, self._buffer)
            self._buffer.clear()
            return
        message = sqlite_writer.frame_rows(self._buffer)
        if len(self._unconfirmed) >= self._trim_at:
            self._trim_confirmed()
        self._torn = True  # until the whole message is written (see __init__)
        self._unconfirmed.append((self._next_seq, message))
        self._buffer.clear()
        self._send(message)
        self._torn = False

    def _end_torn_stream(self) -> None:
        """A message was cut short by an interrupt. End the writer's input there: it commits
        every whole message, drops the torn one and exits. The rows it did not commit, and
        every later commit, go into the file from this process."""
        self._torn = False
        stopped = self._finalizer()
        if stopped is not None and stopped[0] not in (0, sqlite_writer.EXIT_WAL_KEPT):
            self._writer_failed(stopped)
        rows = {
            row[0]: row
            for _, message in self._unconfirmed
            for row in sqlite_writer.unframe_rows(message)
        }
        rows.update((row[0], row) for row in self._buffer)
        self._buffer = [rows[seq] for seq in sorted(rows)]
        self._unconfirmed.clear()
        self._in_process = True

    def flush(self) -> None:
        """Commit, and return once the writer has every committed row in the file."""
        if not self._finalizer.alive and not self._buffer and self._failure is None:
            return  # closed: everything is in the file already
        self.commit()
        if self._in_process:
            return  # committed into the file by this process
        self._send(sqlite_writer.FLUSH_REQUEST)
        # An answer (the writer is up, the file in WAL mode), then more until the file holds
        # every row: an interrupt (a Ctrl-C) during an earlier wait left that flush's answer
        # in the pipe, read here first.
        while True:
            if self._from_writer.read(1) != sqlite_writer.FLUSH_DONE:
                self._writer_failed()
            if sqlite_writer.read_ack(self._ack) >= self._next_seq:
                break
        self._unconfirmed.clear()

    def _trim_confirmed(self) -> None:
        confirmed = sqlite_writer.read_ack(self._ack)
        while self._unconfirmed and self._unconfirmed[0][0] <= confirmed:
            self._unconfirmed.popleft()
        self._trim_at = len(self._unconfirmed) + _TRIM_EVERY

    def _send(self, data: bytes) -> None:
        if self._failure is not None:
            f = self._failure
            raise TapeWriterError(self.path, f.message, f.committed, f.lost, f.lost_steps)
        if not self._finalizer.alive:
            raise TapeError(self.path, "the tape is closed")
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._to_writer, view) :]
        except BrokenPipeError:
            self._writer_failed()

    def _writer_failed(self, stopped: tuple[int, str] | None = None) -> NoReturn:
        """Stop the writer (unless the caller did), repair the file, and raise what was lost."""
        code, message = stopped or self._finalizer() or (None, "")
        self._torn = False  # the stream is over: what it lost is accounted for below
        cause = f"the tape writer process stopped (exit code {code}: {message or 'no message'})"
        self._failure = account_for_loss(
            self.path, cause, self._next_seq, self._unconfirmed, self._buffer
        )
        self._unconfirmed.clear()
        raise self._failure

    @property
    def writer_pid(self) -> int:
        """The process id of the writer process (it outlives the engine until it has drained)."""
        return self._writer.pid

    def __len__(self) -> int:
        """Events appended so far. The file (what another process reads) may lag behind by
        the last commits, which the writer commits up to COMMIT_INTERVAL_S later (more on a
        busy machine); after `flush` it holds them all."""
        return self._next_seq

    def close(self) -> None:
        """Commit what is left, wait for the writer to finish, and report its failure."""
        if self._in_process:
            self.commit()
            return
        if not self._finalizer.alive:
            return  # closed already, or the writer failed and that was reported
        try:
            self.commit()
        finally:
            stopped = self._finalizer()  # None when a failed commit has already stopped it
        if stopped is None:
            return
        if stopped[0] == sqlite_writer.EXIT_WAL_KEPT:
            warnings.warn(
                TapeWarning(
                    f"{self.path}: {stopped[1]}; "
                    "the tape is complete only with that file beside it "
                    f"(copy it with `tokentape export {self.path} --format sqlite -o COPY.tape`)"
                ),
                stacklevel=2,
            )
        elif stopped[0] != 0:
            self._writer_failed(stopped)
        self._unconfirmed.clear()


def _stop_writer(writer: subprocess.Popen[bytes]) -> tuple[int, str]:
    """Close the writer's input (it commits everything sent, then exits) and wait for it."""
    _, err = writer.communicate()
    return writer.returncode, err.decode(errors="replace").strip()


def write_tape(
    path: str | os.PathLike[str], header: ev.TapeHeader, events: Iterable[ev.Event]
) -> int:
    """Write a whole tape at once, in this process, as one finished file: for a tape recorded
    in memory and kept afterwards (no writer process to start). Refuses an existing `path`.
    Returns the number of events written."""
    path = os.fspath(path)
    if os.path.lexists(path):
        raise TapeError(path, "a tape already exists here")
    _create_tape_file(path, header)
    rows = [(seq, e.step, ev.kind_of(e), ev.encode(e)) for seq, e in enumerate(events)]
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.execute("BEGIN")
            conn.executemany(sqlite_writer.INSERT_EVENT, rows)
            conn.execute("COMMIT")
        finally:
            conn.close()
    except BaseException:
        remove_tape_files(path)
        raise
    return len(rows)


def remove_tape_files(path: str | os.PathLike[str]) -> None:
    """Delete a tape file and the -wal / -shm / -journal files SQLite may keep beside it."""
    path = os.fspath(path)
    for p in (path, f"{path}-wal", f"{path}-shm", f"{path}-journal"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def make_self_contained(path: str | os.PathLike[str]) -> None:
    """Switch a closed tape from WAL to a rollback journal: one file, readable read-only with
    no -wal / -shm beside it (the writer does this itself when it finishes)."""
    conn = sqlite3.connect(os.fspath(path))
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()


def copy_tape(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> int:
    """Copy a tape into a new single file `dst`, even while it is being written: a consistent
    snapshot (SQLite's VACUUM INTO, in one read transaction, so it ends on a commit, a step
    boundary), with the tables, triggers and header, in rollback-journal mode. Refuses an
    existing `dst`. Returns the number of events copied."""
    src, dst = os.fspath(src), os.fspath(dst)
    reader = SQLiteTapeReader(src)  # refuses what is not a tape, before dst is created
    try:
        # O_EXCL claims the name, so nothing is ever overwritten; VACUUM INTO fills an empty file.
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        try:
            reader.vacuum_into(dst)
            with open(dst, "rb+") as f:
                os.fsync(f.fileno())  # VACUUM INTO does not sync the file it writes
            copy = SQLiteTapeReader(dst)
            try:
                return len(copy)
            finally:
                copy.close()
        except BaseException:
            remove_tape_files(dst)
            raise
    finally:
        reader.close()
