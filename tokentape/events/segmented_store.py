"""The segmented tape: a flight recorder a server can keep for weeks.

`SegmentedTape` writes a tape as a sequence of segment files in one directory
(events/segment_dir.py). A segment is an ordinary SQLite tape (`SQLiteTape`, with its writer
process) that opens with an `EngineSnapshot` of the engine, so it verifies, replays and
postmortems without the segments before it. The engine hands the writer a way to take that
snapshot (`bind_snapshots`); at a step boundary (`commit`) past `segment_seconds` or
`segment_bytes` the writer takes one, opens the next segment with it, and closes the old one
on a background thread, so the engine waits for neither the old writer's last commit nor
the deletion of what the retention no longer keeps.

Retention: after each close, closed segments older than `retention_seconds`, or beyond
`retention_bytes` for the whole tape, are deleted, oldest first. The open segment is never
deleted, so the tape stays within its retention plus one segment. A reader that opened a
segment keeps reading it after its deletion (its file stays until the reader closes it).

When the engine dies the open segment's writer process commits what it was handed and
finishes the file; closed segments are complete files already. The manifest says how the
run ended: `close` writes it (an EngineError on the tape, or a clean close), and a front end
that saw its engine core die writes it for the core (`record_engine_death`).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tokentape.events import schema as ev
from tokentape.events.segment_dir import (
    MANIFEST_KIND,
    SegmentedTapeSpec,
    check_tape_dir,
    now_iso,
    record_end,
    segment_files,
    segment_name,
    write_manifest,
)
from tokentape.events.sqlite_reader import SQLiteTapeReader, tape_file_status
from tokentape.events.sqlite_repair import append_event
from tokentape.events.sqlite_store import SQLiteTape, remove_tape_files
from tokentape.events.store import TapeError

TakeSnapshot = Callable[[int, int], ev.EngineSnapshot]  # (segment, seq_offset) -> snapshot


class SegmentedTape:
    """A tape writer over a directory of segments (see the module doc). `path` is the
    directory. Nothing is written until the engine binds its snapshots: the first segment
    opens with the engine's first state."""

    def __init__(self, spec: SegmentedTapeSpec, header: ev.TapeHeader) -> None:
        check_tape_dir(spec)
        self.spec = spec
        self.path: str | None = spec.directory
        self.header = header
        os.makedirs(spec.directory, exist_ok=True)
        write_manifest(
            spec.directory,
            {
                "kind": MANIFEST_KIND,
                "format_version": ev.FORMAT_VERSION,
                "created_at": now_iso(),
                "model_id": header.model_id,
                "segment_seconds": spec.segment_seconds,
                "segment_bytes": spec.segment_bytes,
                "retention_seconds": spec.retention_seconds,
                "retention_bytes": spec.retention_bytes,
                "ended": None,
            },
        )
        self._take_snapshot: TakeSnapshot | None = None
        self._segment: SQLiteTape | None = None
        self._index = -1
        self._seq_offset = 0  # events in the segments before the open one
        self._opened_at = 0.0
        self._error: str | None = None  # the EngineError recorded, for the manifest's end
        self._closer = ThreadPoolExecutor(1, thread_name_prefix="tokentape-segment-close")
        # Its own thread: the next file is ready even while a close waits for its writer.
        self._maker = ThreadPoolExecutor(1, thread_name_prefix="tokentape-segment-make")
        self._closing: list[Future[None]] = []
        self._spare: Future[SQLiteTape] | None = None  # the next segment's file, being made
        self._closed = False

    @property
    def segment_path(self) -> str | None:
        """The open segment's file."""
        return self._segment.path if self._segment is not None else None

    def bind_snapshots(self, take: TakeSnapshot) -> None:
        """The engine's snapshot, taken at each segment's start; opens the first segment."""
        self._take_snapshot = take
        self._segment = self._start_segment(self._segment_file(0), take(0, 0))
        self._index, self._opened_at = 0, time.monotonic()
        self._spare = self._maker.submit(self._segment_file, 1)

    def _segment_file(self, index: int) -> SQLiteTape:
        """Segment `index`'s file, empty, with its writer process. The next one is made on the
        thread of its own while the open one fills (a new SQLite file and a process take tens of
        milliseconds), so opening it costs the engine only its snapshot."""
        path = os.path.join(self.spec.directory, segment_name(index))
        try:
            return SQLiteTape(path, self.header)
        except sqlite3.Error as exc:
            raise OSError(f"{path}: cannot create the tape segment: {exc}") from exc

    @staticmethod
    def _start_segment(segment: SQLiteTape, snapshot: ev.EngineSnapshot) -> SQLiteTape:
        """The segment, opened with the snapshot and that in its file before anything else
        is handed over: a segment in the directory always has its snapshot (its writer, up
        long since, commits it in a millisecond or two)."""
        segment.append(snapshot)
        segment.flush()
        return segment

    def _open_next(self, snapshot: ev.EngineSnapshot) -> SQLiteTape:
        """The next segment: the file made ahead, or, if it could not be made or its writer
        died waiting (killed), a new one made now in its place."""
        spare, self._spare = self._spare, None
        try:
            assert spare is not None
            return self._start_segment(spare.result(), snapshot)
        except (TapeError, OSError, AssertionError):
            with contextlib.suppress(Exception):
                broken = spare.result() if spare is not None else None
                if broken is not None:
                    with contextlib.suppress(Exception):
                        broken.close()
                    remove_tape_files(broken.path)
        return self._start_segment(self._segment_file(snapshot.segment), snapshot)

    def _current(self) -> SQLiteTape:
        if self._segment is None:
            raise TapeError(self.path, "the segmented tape has no open segment (bind_snapshots)")
        return self._segment

    def append(self, event: ev.Event) -> None:
        self._current().append(event)
        if type(event) is ev.EngineError:
            self._error = f"{event.error_type}: {event.message}"

    def commit(self) -> None:
        """A step boundary: hand the rows to the segment's writer, and open the next segment
        when this one is due to close. (Here, not at the next event: the scheduler's KV
        bookkeeping changes before the event that records a step is appended.)"""
        segment = self._current()
        segment.commit()
        self._raise_closing_error()
        if (
            segment.num_bytes >= self.spec.segment_bytes
            or time.monotonic() - self._opened_at >= self.spec.segment_seconds
        ):
            self._rotate(segment)

    def _rotate(self, old: SQLiteTape) -> None:
        """Close the old segment, open the next, and let the closing thread wait for the old
        one's writer."""
        assert self._take_snapshot is not None
        # The old segment ends with SegmentClosed, handed to its writer before the new one
        # opens: a directory never holds a segment whose predecessor lacks it (a death in
        # between leaves the old one closed and no next one, which readers see). A new
        # segment that cannot open (a full disk) leaves the failure recorded in the old one.
        snapshot = self._take_snapshot(self._index + 1, self._seq_offset + len(old) + 1)
        old.append(ev.SegmentClosed(snapshot.step, snapshot.segment))
        old.commit()
        new = self._open_next(snapshot)
        seq_offset = self._seq_offset + len(old)
        self._segment = new
        self._index, self._seq_offset, self._opened_at = (
            self._index + 1,
            seq_offset,
            time.monotonic(),
        )
        self._spare = self._maker.submit(self._segment_file, self._index + 1)
        self._closing.append(self._closer.submit(self._finish_segment, old))

    def _finish_segment(self, old: SQLiteTape) -> None:
        """On the closing thread: wait for the old segment's writer, then apply retention."""
        old.close()
        self._apply_retention(old.path)

    def _apply_retention(self, last_closed: str) -> None:
        """Delete the oldest closed segments (up to `last_closed`: the ones after it may
        still be closing) while the tape is over its size, or they are older than its time."""
        spec = self.spec
        if spec.retention_seconds is None and spec.retention_bytes is None:
            return
        files = segment_files(spec.directory)
        sizes = {p: _size_on_disk(p) for p in files}
        total = sum(sizes.values())
        oldest_kept = time.time() - (spec.retention_seconds or float("inf"))
        for path in files:
            too_much = spec.retention_bytes is not None and total > spec.retention_bytes
            if not (too_much or os.path.getmtime(path) < oldest_kept):
                break
            remove_tape_files(path)
            total -= sizes[path]
            if path == last_closed:
                break

    def _raise_closing_error(self) -> None:
        while self._closing and self._closing[0].done():
            self._closing.pop(0).result()  # a closed segment's writer failure, raised here

    def flush(self) -> None:
        """Return once every committed event of every segment is in its file."""
        if self._segment is not None:
            self._segment.flush()
        for future in self._closing:
            future.result()
        self._closing.clear()

    def __len__(self) -> int:
        return self._seq_offset + (len(self._segment) if self._segment is not None else 0)

    def close(self) -> None:
        """Close the open segment, wait for the closing ones, and say in the manifest how the
        run ended."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._segment is not None:
                self._segment.close()
            for future in self._closing:
                future.result()
        finally:
            self._discard_spare()
            self._maker.shutdown(wait=True)
            self._closer.shutdown(wait=True)
            with contextlib.suppress(OSError, ValueError):
                record_end(self.spec.directory, self._error or "closed")

    def _discard_spare(self) -> None:
        """The next segment's file, never opened: closed and removed."""
        spare, self._spare = self._spare, None
        if spare is None:
            return
        with contextlib.suppress(Exception):  # one that failed to be made: nothing to remove
            segment = spare.result()
            segment.close()
            remove_tape_files(segment.path)


def _size_on_disk(path: str) -> int:
    total = 0
    for p in (path, f"{path}-wal"):
        with contextlib.suppress(OSError):
            total += os.path.getsize(p)
    return total


def record_engine_death(directory: str, how: str, wait_s: float = 5.0) -> None:
    """Say how the run ended, for an engine core that died without closing its tape (killed,
    or out of memory): once the open segment's writer process has committed what it was
    handed and finished the file (within `wait_s`), an EngineError there names the death,
    unless the core recorded its own failure; the manifest says it too. The next segment's
    file, made ahead and never opened, is removed. What cannot be done is said in one line on
    stderr: the server is going down, this must not stop it."""
    try:
        for name in os.listdir(directory):
            if name.endswith(".creating"):  # a file the core was making when it died
                remove_tape_files(os.path.join(directory, name))
        files = segment_files(directory)
        while files and _is_spare(files[-1]):
            remove_tape_files(files.pop())
        if files:
            _append_death(files[-1], how, wait_s)
        record_end(directory, how)
    except (OSError, ValueError, TapeError, sqlite3.Error) as exc:
        print(f"{directory}: how the engine ended was not recorded: {exc}", file=sys.stderr)


def _append_death(path: str, how: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while tape_file_status(path).journal_mode != "rollback" and time.monotonic() < deadline:
        time.sleep(0.02)
    if tape_file_status(path).journal_mode != "rollback":
        return  # its writer still holds it: the manifest alone says how the run ended
    reader = SQLiteTapeReader(path)
    try:
        tail = _last_event(reader)
    finally:
        reader.close()
    if tail is not None and not isinstance(tail, ev.EngineError):
        append_event(path, ev.EngineError(tail.step, "EngineDeadError", how))


def _is_spare(path: str) -> bool:
    """A segment file with no event: made ahead, never opened (a segment is opened with its
    snapshot in the file)."""
    reader = SQLiteTapeReader(path)
    try:
        return len(reader) == 0
    finally:
        reader.close()


def _last_event(reader: SQLiteTapeReader) -> ev.Event | None:
    n = len(reader)
    for _, event in reader.iter_events(max(n - 1, 0)):
        return event
    return None
