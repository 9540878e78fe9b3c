"""The tape's writer process: commits the rows the engine hands it into an SQLite tape.

`SQLiteTape` creates the tape file (schema, triggers, header), then starts this script as a
child process (`python -I sqlite_writer.py TAPE`) and sends it each step's rows through its
stdin, so that the SQLite transaction runs on another core, outside the engine's step and its
GIL. It imports only the standard library and msgspec, never the tokentape package (which
would pull in torch), so it starts in tens of milliseconds.

Protocol on stdin, one message after another:
- a 4-byte little-endian length n > 0, then n bytes: a msgpack array of rows
  `[seq, step, kind, data]`, committed as one transaction (one step boundary);
- a length of 0: a flush request; one byte is written to stdout once every row sent before it
  is committed.

At the end of stdin (the engine closed the tape, or died, even by SIGKILL) every complete
message is committed, the WAL is checkpointed into the file and the process exits 0. A message
cut short by the engine's death is dropped whole, as an uncommitted transaction would be. On
any error the process prints one line to stderr and exits 1; the engine reports that line.
"""

from __future__ import annotations

import os
import sqlite3
import struct
import sys
import time
from typing import BinaryIO

import msgspec

INSERT_EVENT = "INSERT INTO events(seq, step, kind, data) VALUES (?, ?, ?, ?)"
FLUSH_REQUEST = struct.pack("<I", 0)
FLUSH_DONE = b"\x01"
CHECKPOINT_INTERVAL_S = 0.25

_length = struct.Struct("<I")
_encode_rows = msgspec.msgpack.Encoder().encode
Row = tuple[int, int, str, bytes]


def frame_rows(rows: list[Row]) -> bytes:
    """One message of the protocol: the rows of one transaction, length-prefixed."""
    body = _encode_rows(rows)
    return _length.pack(len(body)) + body


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    """n bytes, or None at the end of the stream (a short read means the sender died)."""
    data = stream.read(n)
    return data if len(data) == n else None


def _yield_to_the_engine() -> None:
    """Never preempt the engine on wake-up. Each commit wakes this process through the pipe,
    and Linux tends to wake it on the engine's own core, where a normal task would preempt
    the engine mid-step (~0.1 ms lost per step) instead of running on the idle core.
    SCHED_BATCH turns off that wake-up preemption and keeps a fair share of the CPU."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass  # not permitted here: the writer still works, with normal wake-ups


def serve(path: str, stdin: BinaryIO, stdout: BinaryIO) -> None:
    decode_rows = msgspec.msgpack.Decoder(list[Row]).decode
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous=NORMAL")  # durable across a crash of either process
        # Checkpoints run here between commits, where they delay no one.
        conn.execute("PRAGMA wal_autocheckpoint=0")
        last_checkpoint = time.monotonic()
        while (head := _read_exactly(stdin, 4)) is not None:
            (size,) = _length.unpack(head)
            if size == 0:
                try:
                    stdout.write(FLUSH_DONE)
                    stdout.flush()
                except BrokenPipeError:
                    pass  # the engine died waiting; keep committing what it sent
                continue
            body = _read_exactly(stdin, size)
            if body is None:
                break
            conn.execute("BEGIN")
            try:
                conn.executemany(INSERT_EVENT, decode_rows(body))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            if time.monotonic() - last_checkpoint >= CHECKPOINT_INTERVAL_S:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                last_checkpoint = time.monotonic()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # leave one self-contained file
    finally:
        conn.close()


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: sqlite_writer.py TAPE (started by tokentape's SQLiteTape)", file=sys.stderr)
        return 2
    _yield_to_the_engine()
    try:
        serve(sys.argv[1], sys.stdin.buffer, sys.stdout.buffer)
    except Exception as exc:  # reported to the engine, which names the tape
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
