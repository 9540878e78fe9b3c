"""What a dead tape writer left behind: repair the file and name the events it lost; and
the rows a writer ended early (a transaction torn by an interrupt) did not commit.

`SQLiteTape` calls `account_for_loss` when its writer process failed or was killed: SQLite
recovers the file (committed transactions stay, a torn one is dropped), the file becomes one
file in rollback-journal mode again, and the error names the events the engine had handed over
that never reached it, with their steps. When events were lost, the tape's last event is an
EngineError that says so, so the tape itself tells where it ends and why.
"""

from __future__ import annotations

import os
import sqlite3
from collections import deque
from collections.abc import Callable

import msgspec

from tokentape.events import schema as ev
from tokentape.events import sqlite_writer
from tokentape.events.store import TapeError

_encode = msgspec.msgpack.Encoder().encode
_NEXT_SEQ = "SELECT COALESCE(MAX(seq), -1) + 1 FROM events"  # the seq an appended row takes


class TapeWriterError(TapeError):
    """The tape's writer process failed: says what the file holds and which events are lost.

    `committed`: events in the file (None if the file could not be read); `lost`: the seqs
    appended but never committed; `lost_steps`: their steps, in order, each once."""

    def __init__(
        self,
        path: str,
        message: str,
        committed: int | None,
        lost: range,
        lost_steps: tuple[int, ...],
    ) -> None:
        super().__init__(path, message)
        self.message = message
        self.committed = committed
        self.lost = lost
        self.lost_steps = lost_steps


def account_for_loss(
    path: str,
    cause: str,
    appended: int,
    unconfirmed: deque[tuple[int, bytes]],
    buffer: list[tuple[int, int, str, bytes]],
) -> TapeWriterError:
    """What a dead writer left: repair the file, name the events it never committed (their
    rows are in the unconfirmed messages and the engine's buffer) and record why it ends."""
    try:
        committed = repair_tape(path)
    except (sqlite3.Error, OSError) as exc:
        return TapeWriterError(
            path,
            f"{cause}; the tape file cannot be read to tell which events are lost ({exc})",
            None,
            range(0),
            (),
        )
    steps: dict[int, int] = {}
    for last_seq, rows in unconfirmed:
        if last_seq > committed:
            steps.update((seq, step) for seq, step, _, _ in sqlite_writer.unframe_rows(rows))
    steps.update((seq, step) for seq, step, _, _ in buffer)
    lost = range(committed, appended)
    lost_steps = tuple(sorted({steps[s] for s in lost if s in steps}))
    if not lost:
        return TapeWriterError(
            path,
            f"{cause}; no event was lost: the tape holds all {appended}",
            committed,
            lost,
            lost_steps,
        )
    end = f"ends after event {committed - 1}" if committed else "holds no event"
    message = (
        f"{cause}; events {lost.start}-{lost.stop - 1} ({len(lost)} of {appended}), of "
        f"steps {_ranges(lost_steps)}, were handed to it but never committed: the tape "
        f"{end}"
    )
    try:
        append_event(
            path, ev.EngineError(max(steps.values(), default=0), "TapeWriterError", message)
        )
    except (sqlite3.Error, OSError) as exc:
        message += f" (recording this on the tape failed: {exc})"
    return TapeWriterError(path, message, committed, lost, lost_steps)


def _ranges(values: tuple[int, ...]) -> str:
    """(1, 2, 3, 7) -> '1-3, 7'."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def repair_tape(path: str | os.PathLike[str]) -> int:
    """After its writer died: let SQLite recover the WAL (committed transactions are kept, a
    torn one is dropped), move everything into the file, switch it to a rollback journal, and
    return the number of events it holds. Only for a tape that no process is writing."""
    conn = sqlite3.connect(os.fspath(path), isolation_level=None)
    try:
        (count,) = conn.execute(_NEXT_SEQ).fetchone()
        sqlite_writer.finish(conn)
        return int(count)
    finally:
        conn.close()


def append_rows(path: str, rows: list[sqlite_writer.Row]) -> None:
    """Write rows into a tape no writer process serves any more (its writer ended on a torn
    message), those past the file's last seq: so a retry after an interrupt adds nothing
    twice."""
    _insert_past_end(path, lambda end: [r for r in rows if r[0] >= end])


def append_event(path: str, event: ev.Event) -> None:
    """Append one event to a tape no process is writing (seq follows the last one)."""
    kind, data = ev.KIND_OF_TYPE[type(event)], _encode(event)
    _insert_past_end(path, lambda end: [(end, event.step, kind, data)])


def _insert_past_end(path: str, rows_from: Callable[[int], list[sqlite_writer.Row]]) -> None:
    """Insert `rows_from(the file's next seq)` into a tape no process is writing, in one
    transaction; the file stays one file, in rollback-journal mode."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        (end,) = conn.execute(_NEXT_SEQ).fetchone()
        conn.executemany(sqlite_writer.INSERT_EVENT, rows_from(end))
        conn.execute("COMMIT")
        sqlite_writer.finish(conn)
    finally:
        conn.close()
