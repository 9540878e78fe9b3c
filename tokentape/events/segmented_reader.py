"""Reading a segmented tape's directory as one tape, or a time window of it.

The segments are read in order as one stream of events, numbered from 0 at the first segment
read. Each segment opens with an `EngineSnapshot`: the first one starts the fold (the
reducer restores it), the later ones restate the state there (a fold restores them again,
to the same state; verify checks that its replay reaches exactly that state).

A window (`since`, `until`: seconds since the epoch, or a `timedelta` counted back from the
tape's end, its last commit) keeps the segments whose time overlaps it: a segment covers the
time from its snapshot to the next segment's (the last one, to its last commit). The window
therefore begins at a snapshot, at most a segment before `since`.

Every segment file is opened when the reader is made, so a segment that the retention
deletes afterwards stays readable to the end. Segments must follow each other: reading
stops at a segment missing in the middle (deleted by hand), cut short (its writer killed
before its last commit) or damaged, and names it; the segments before it read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

from tokentape.events import schema as ev
from tokentape.events.segment_dir import read_manifest, segment_files
from tokentape.events.sqlite_reader import SQLiteTapeReader
from tokentape.events.store import TapeError

# A moment in a tape's time: seconds since the epoch, or how long before the tape's end.
TimePoint = float | timedelta


@dataclass(slots=True)
class Segment:
    path: str
    reader: SQLiteTapeReader
    snapshot: ev.EngineSnapshot
    num_events: int
    ends_at: float  # when its last event was committed (the next segment's start, or mtime)
    last: ev.Event | None = None  # SegmentClosed when the run went on from it

    @property
    def starts_at(self) -> float:
        return self.snapshot.wall_time


def first_snapshot(reader: SQLiteTapeReader) -> ev.EngineSnapshot | None:
    """The snapshot a segment opens with; None for a tape that is not a segment."""
    for _, event in reader.iter_events(0):
        return event if isinstance(event, ev.EngineSnapshot) else None
    return None


def _last_event(reader: SQLiteTapeReader) -> ev.Event | None:
    for _, event in reader.iter_events(max(len(reader) - 1, 0)):
        return event
    return None


def _last_write(path: str) -> float:
    times = [os.path.getmtime(p) for p in (path, f"{path}-wal") if os.path.exists(p)]
    return max(times)


class SegmentedTapeReader:
    """A segmented tape's directory (or a window of it) read as one tape: `header`,
    `iter_events`, `len` as SQLiteTapeReader's. `segments`: the segment files read."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        since: TimePoint | None = None,
        until: TimePoint | None = None,
    ) -> None:
        self.path = os.fspath(directory)
        try:
            self.manifest = read_manifest(self.path)
        except (OSError, ValueError) as exc:
            raise TapeError(self.path, f"not a segmented tape ({exc})") from None
        self.segments: list[Segment] = []
        # A segment that cannot be opened: reading stops there (the ones before it read).
        self.damage: TapeError | None = None
        self.continues = False
        try:
            self._open_segments(since, until)
        except BaseException:
            self.close()
            raise
        if not self.segments and self.damage is not None:
            raise self.damage
        if not self.segments:
            window = "" if since is None and until is None else " in the time window asked for"
            raise TapeError(self.path, f"the segmented tape has no segment{window}")
        self.header = self.segments[0].reader.header
        self._starts = []
        start = 0
        for seg in self.segments:
            self._starts.append(start)
            start += seg.num_events
        self._len = start

    def _open_segments(self, since: TimePoint | None, until: TimePoint | None) -> None:
        opened: list[Segment] = []
        files = segment_files(self.path)
        for path in files:
            try:
                reader = SQLiteTapeReader(path)
            except TapeError as exc:
                if not os.path.exists(path) and not opened:
                    continue  # deleted by the retention since the listing: the tape starts later
                self.damage = exc  # the segments after it cannot be joined to the ones before
                break
            snapshot = first_snapshot(reader) if len(reader) else None
            if snapshot is None and path == files[-1] and not len(reader):
                reader.close()  # the next segment's file, made ahead: not opened yet
                continue
            if snapshot is None:
                reader.close()
                self.damage = TapeError(
                    path, "not a segment of a segmented tape (no snapshot first)"
                )
                break
            opened.append(Segment(path, reader, snapshot, len(reader), 0.0, _last_event(reader)))
        for seg, nxt in zip(opened, [*opened[1:], None], strict=False):
            seg.ends_at = nxt.starts_at if nxt is not None else _last_write(seg.path)
        end = opened[-1].ends_at if opened else 0.0
        if isinstance(since, timedelta):
            since = end - since.total_seconds()
        if isinstance(until, timedelta):
            until = end - until.total_seconds()
        for seg in opened:
            inside = (since is None or seg.ends_at >= since) and (
                until is None or seg.starts_at <= until
            )
            if inside:
                self.segments.append(seg)
            else:
                seg.reader.close()
        # The run goes on after the last segment read: a window that --until ends early.
        self.continues = bool(self.segments) and self.segments[-1] is not opened[-1]
        for i, (prev, seg) in enumerate(zip(self.segments, self.segments[1:], strict=False)):
            expected = prev.snapshot.seq_offset + prev.num_events
            follows = (prev.snapshot.segment + 1, expected)
            closed = isinstance(prev.last, ev.SegmentClosed)
            if not closed or (seg.snapshot.segment, seg.snapshot.seq_offset) != follows:
                # Reading stops at the gap, as at any damage: the segments before it read.
                self.damage = TapeError(
                    seg.path,
                    f"does not follow {os.path.basename(prev.path)}: segment "
                    f"{prev.snapshot.segment + 1} is missing or cut short (its writer killed "
                    "before its last commit, or deleted by hand); read the segments from "
                    f"{os.path.basename(seg.path)} on with --since, or each on its own",
                )
                for later in self.segments[i + 1 :]:
                    later.reader.close()
                del self.segments[i + 1 :]
                break

    def __len__(self) -> int:
        return self._len

    def segment_of(self, seq: int) -> tuple[Segment, int]:
        """The segment holding event `seq`, and the event's position in it."""
        for seg, start in zip(reversed(self.segments), reversed(self._starts), strict=True):
            if seq >= start:
                return seg, seq - start
        raise IndexError(seq)

    def iter_events(self, start: int = 0) -> Iterator[tuple[int, ev.Event]]:
        yield from self._iter_segments(start)
        if self.damage is not None:  # the segment that could not be opened, where it begins
            raise TapeError(self.damage.path, self.damage.message, self._len)

    def _iter_segments(self, start: int) -> Iterator[tuple[int, ev.Event]]:
        for seg, first in zip(self.segments, self._starts, strict=True):
            if start >= first + seg.num_events and seg is not self.segments[-1]:
                continue
            local = max(0, start - first)
            try:
                for seq, event in seg.reader.iter_events(local):
                    yield first + seq, event
            except TapeError as exc:
                at = None if exc.position is None else first + exc.position
                raise TapeError(seg.path, exc.message, at) from None

    def close(self) -> None:
        for seg in self.segments:
            seg.reader.close()
