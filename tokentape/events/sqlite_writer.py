"""The tape's writer process: commits the rows the engine hands it into an SQLite tape.

`SQLiteTape` creates the tape file (schema, triggers, header), then starts this script as a
child process (`python -I sqlite_writer.py TAPE ACK_FD MSGSPEC_DIR`) and sends it each step's
rows through its stdin, so that the SQLite work runs on another core, outside the engine's step
and its GIL. It imports only the standard library and msgspec, never the tokentape package (which
would pull in torch), so it starts in tens of milliseconds.

Protocol on stdin, one message after another:
- a 4-byte little-endian length n > 0, then n bytes: a msgpack array of rows
  `[seq, step, kind, data]` (one engine commit, a step boundary);
- a length of 0: a flush request; one byte is written to stdout once every row sent before it
  is committed.
After each SQLite commit the writer stores the number of events in the file (the next seq) in
the 8 shared bytes of ACK_FD, so the engine can forget what is confirmed without a syscall.

Transactions and checkpoints (docs/tape-format.md, "Checkpoints"): consecutive messages share
one transaction, committed at most COMMIT_INTERVAL_S after its first row, on a flush request
and at the end of stdin, so a commit always ends on an engine commit. A passive checkpoint
follows a commit at most every CHECKPOINT_INTERVAL_S; it never waits for readers.

At the end of stdin (the engine closed the tape, or died, even by SIGKILL) every complete
message is committed, the WAL is checkpointed into the file and the file is switched to a
rollback journal: one self-contained file. A message cut short by the engine's death is
dropped whole, as an uncommitted transaction would be. Exit status: 0; EXIT_WAL_KEPT when a
reader held a snapshot for FINISH_WAIT_S, so that the last commits stay in `TAPE-wal` (one line
on stderr says how many frames); 1 on any error (one line on stderr, which the engine reports).
"""

from __future__ import annotations

import mmap
import os
import select
import sqlite3
import struct
import sys
import time
from typing import BinaryIO

if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[3] not in sys.path:
    # Isolated (-I), the writer would miss a msgspec installed where only the engine's
    # environment looks (PYTHONPATH, the user's site-packages, a `pip install --target`
    # folder): the engine names the folder its own msgspec came from.
    sys.path.append(sys.argv[3])

import msgspec  # noqa: E402  (found through the folder the engine names, above)

INSERT_EVENT = "INSERT INTO events(seq, step, kind, data) VALUES (?, ?, ?, ?)"
FLUSH_REQUEST = struct.pack("<I", 0)
FLUSH_DONE = b"\x01"
COMMIT_INTERVAL_S = 0.01  # the longest a live reader lags; also what bounds the WAL (see docs)
CHECKPOINT_INTERVAL_S = 0.25
WAL_SIZE_LIMIT = 8 << 20  # journal_size_limit: a WAL that grew past this shrinks when it restarts
FINISH_WAIT_S = 1.0  # how long the end waits for readers to let go of the WAL
EXIT_WAL_KEPT = 3
_READ_SIZE = 1 << 20

_length = struct.Struct("<I")
_ack = struct.Struct("<q")
Row = tuple[int, int, str, bytes]
_encode_rows = msgspec.msgpack.Encoder().encode
_decode_rows = msgspec.msgpack.Decoder(list[Row]).decode


def frame_rows(rows: list[Row]) -> bytes:
    """One message of the protocol: the rows of one engine commit, length-prefixed."""
    body = _encode_rows(rows)
    return _length.pack(len(body)) + body


def unframe_rows(message: bytes) -> list[Row]:
    """The rows of one message (for the engine's report of what a dead writer lost)."""
    return _decode_rows(memoryview(message)[_length.size :])


def map_ack(fd: int) -> mmap.mmap:
    """The 8 shared bytes behind `fd` (the engine creates them; both sides map them)."""
    return mmap.mmap(fd, _ack.size)


def read_ack(shared: mmap.mmap) -> int:
    """The number of events the writer has committed (read twice: a torn read cannot agree)."""
    while (value := _ack.unpack_from(shared)[0]) != _ack.unpack_from(shared)[0]:
        pass
    return int(value)


class _Messages:
    """Length-prefixed messages from a pipe, with a timeout (select needs the raw fd, so the
    buffering is done here, not by a BufferedReader that select cannot see into)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.pos = 0

    def next(self, timeout: float | None) -> bytes | None:
        """The next message's body (b"" for a flush request), or None at the end of the stream.
        Raises TimeoutError when nothing complete came within `timeout` seconds."""
        while True:
            if len(self.buf) - self.pos >= 4:
                (size,) = _length.unpack_from(self.buf, self.pos)
                end = self.pos + 4 + size
                if len(self.buf) >= end:
                    body = bytes(self.buf[self.pos + 4 : end])
                    self.pos = end
                    return body
            if timeout is not None and not select.select([self.fd], [], [], timeout)[0]:
                raise TimeoutError
            chunk = os.read(self.fd, _READ_SIZE)
            if not chunk:
                return None  # a message cut short by the sender's death is dropped
            if self.pos:
                del self.buf[: self.pos]
                self.pos = 0
            self.buf += chunk


class _Transactions:
    """The open transaction: rows go in as they arrive, COMMIT on a deadline or on demand."""

    def __init__(self, conn: sqlite3.Connection, ack: mmap.mmap) -> None:
        self.conn = conn
        self.ack = ack
        self.started: float | None = None  # when the open transaction began
        self.end = 0  # the next seq after the rows written so far
        self.last_checkpoint = time.monotonic()

    def time_left(self) -> float | None:
        if self.started is None:
            return None
        return max(0.0, self.started + COMMIT_INTERVAL_S - time.monotonic())

    def add(self, rows: list[Row]) -> None:
        if not rows:
            return
        if self.started is None:
            self.conn.execute("BEGIN")
            self.started = time.monotonic()
        self.conn.executemany(INSERT_EVENT, rows)
        self.end = rows[-1][0] + 1
        if self.time_left() == 0.0:
            self.commit()

    def commit(self) -> None:
        if self.started is None:
            return
        self.conn.execute("COMMIT")
        self.started = None
        _ack.pack_into(self.ack, 0, self.end)
        if time.monotonic() - self.last_checkpoint >= CHECKPOINT_INTERVAL_S:
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            self.last_checkpoint = time.monotonic()

    def rollback(self) -> None:
        if self.started is not None:
            self.conn.execute("ROLLBACK")
            self.started = None


def finish(conn: sqlite3.Connection) -> tuple[bool, int]:
    """Checkpoint everything into the file and switch it to a rollback journal, retrying while
    readers hold the WAL, for up to FINISH_WAIT_S. Returns (all in the file, WAL frames left)."""
    conn.execute("PRAGMA busy_timeout=0")  # the loop below does the waiting, with a deadline
    deadline = time.monotonic() + FINISH_WAIT_S
    while True:
        busy, frames, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if not busy:
            try:  # needs every other connection closed, not just their transactions ended
                if conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete":
                    return True, 0
            except sqlite3.OperationalError:
                pass
        if time.monotonic() >= deadline:
            return not busy, frames if busy else 0
        time.sleep(0.01)


def serve(path: str, stdin_fd: int, stdout: BinaryIO, ack: mmap.mmap) -> int:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous=NORMAL")  # durable across a crash of either process
        if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] != "wal":
            raise RuntimeError("the tape could not be switched to WAL mode")
        conn.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints run here, between commits
        conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        txn = _Transactions(conn, ack)
        messages = _Messages(stdin_fd)
        try:
            while True:
                try:
                    body = messages.next(txn.time_left())
                except TimeoutError:  # the open transaction reached its deadline
                    txn.commit()
                    continue
                if body is None:
                    break
                if not body:  # a flush request
                    txn.commit()
                    try:
                        stdout.write(FLUSH_DONE)
                        stdout.flush()
                    except BrokenPipeError:
                        pass  # the engine died waiting; keep committing what it sent
                else:
                    txn.add(_decode_rows(body))
            txn.commit()
        except BaseException:
            txn.rollback()
            raise
        in_file, frames = finish(conn)
    finally:
        conn.close()
    if not in_file:
        print(
            f"a reader held a snapshot of the tape for {FINISH_WAIT_S:g} s after the last "
            f"commit: {frames} WAL frames are still only in {path}-wal",
            file=sys.stderr,
        )
        return EXIT_WAL_KEPT
    return 0


def _yield_to_the_engine() -> None:
    """Never preempt the engine on wake-up. Each commit wakes this process through the pipe,
    and Linux tends to wake it on the engine's own core, where a normal task would preempt
    the engine mid-step instead of running on the idle core (docs/benchmarks-history.md,
    "Measurements that shaped the code").
    SCHED_BATCH turns off that wake-up preemption and keeps a fair share of the CPU."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass  # not permitted here: the writer still works, with normal wake-ups


def main() -> int:
    if len(sys.argv) != 4:
        print(
            "usage: sqlite_writer.py TAPE ACK_FD MSGSPEC_DIR (started by tokentape's SQLiteTape)",
            file=sys.stderr,
        )
        return 2
    _yield_to_the_engine()
    try:
        return serve(sys.argv[1], sys.stdin.fileno(), sys.stdout.buffer, map_ack(int(sys.argv[2])))
    except Exception as exc:  # reported to the engine, which names the tape
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
