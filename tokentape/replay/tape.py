"""Open a recorded tape and fold it into state: `load_tape(path).fold()` or `.at(step)`."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

from tokentape.engine.config import EngineConfig
from tokentape.events import schema as ev
from tokentape.events.reducer import fold_events, initial_state
from tokentape.events.segment_dir import MANIFEST, is_segmented_tape
from tokentape.events.segmented_reader import SegmentedTapeReader, TimePoint
from tokentape.events.sqlite_store import SQLiteTapeReader
from tokentape.events.state import EngineState
from tokentape.events.store import MemoryTape, TapeError, TapeReader, check_format_version
from tokentape.events.validation import check_int
from tokentape.replay.snapshots import DEFAULT_INTERVAL, SnapshotIndex

PROGRESS_EVERY = 1 << 16  # events folded between progress callbacks
MAX_KV_BLOCKS = 1 << 22  # 4M blocks (64M tokens of 16): a header claiming more is damaged


def state_before_events(header: ev.TapeHeader, config: EngineConfig) -> EngineState:
    """The state a tape with this header starts its fold from."""
    return initial_state(
        header.discard_policy,
        config.effective_pipeline_depth > 1,
        header.eos_token_id,
        config.effective_max_model_len,
        config.faults,
    )


class Tape:
    """A read-only view of a tape: its header, its events in order, and folds over them."""

    def __init__(self, reader: TapeReader, snapshot_interval: int = DEFAULT_INTERVAL) -> None:
        self.reader = reader
        self.snapshot_interval = snapshot_interval
        self._snapshots: SnapshotIndex | None = None
        self.path = reader.path
        self.header = reader.header
        check_format_version(self.header.format_version, self.path)  # the header's own, too
        try:
            self.config = EngineConfig(**self.header.config)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TapeError(
                self.path, f"the engine config in the header is invalid ({exc})"
            ) from None
        # Readers size tables by the KV pool (the postmortem's block counts, verify's engine);
        # no engine that recorded a tape held more blocks than this.
        # An engine records the block count it allocated: a header without one is damaged.
        if self.config.num_kv_blocks is None or self.config.num_kv_blocks > MAX_KV_BLOCKS:
            raise TapeError(
                self.path,
                f"the engine config in the header is invalid (num_kv_blocks "
                f"{self.config.num_kv_blocks} is not in 1..{MAX_KV_BLOCKS})",
            )

    def __len__(self) -> int:
        return len(self.reader)

    def events(self, start: int = 0) -> Iterator[tuple[int, ev.Event]]:
        """(seq, event) pairs in tape order, streamed."""
        return self.reader.iter_events(start)

    def initial_state(self) -> EngineState:
        return state_before_events(self.header, self.config)

    def fold(
        self, until_seq: int | None = None, progress: Callable[[int], None] | None = None
    ) -> EngineState:
        """The state after every event (or after the events before `until_seq`). `progress`,
        if given, is called with the number of events folded so far, every PROGRESS_EVERY."""
        if progress is None:
            return fold_events(self.events(), self.initial_state(), until_seq)
        events, state, done = self.events(), self.initial_state(), 0
        while True:  # in chunks: islice keeps the per-event cost that of fold_events alone
            before = state.num_events
            fold_events(itertools.islice(events, PROGRESS_EVERY), state, until_seq)
            done += PROGRESS_EVERY
            if state.num_events - before < PROGRESS_EVERY:  # the end, or until_seq
                return state
            progress(done)

    @property
    def snapshots(self) -> SnapshotIndex:
        """The tape's snapshot index, built lazily as far as seeks need it."""
        if self._snapshots is None:
            self._snapshots = SnapshotIndex(
                self.events, self.initial_state(), len(self), self.snapshot_interval
            )
        return self._snapshots

    def at(self, step: int, progress: Callable[[int], None] | None = None) -> EngineState:
        """The state at step `step`: after it was scheduled, before step `step + 1` was.
        Seeks through periodic snapshots; the result is a fresh copy. A step the tape does
        not schedule (negative, or past its last) raises IndexError. `progress` is called
        with the number of events indexed while the index is extended to find the step."""
        check_int("step", step)
        if step < 0:
            raise IndexError(f"step {step} is out of range: steps are numbered from 0")
        index = self.snapshots
        if index.seq_of_step(step, progress) is None:
            last = len(index.step_seqs) - 1  # the whole tape is indexed when a step is missing
            known = f"steps 0..{last}" if last >= 0 else "no step"
            raise IndexError(f"step {step} is out of range: the tape schedules {known}")
        return index.state_at_step(step)

    def state_at(self, seq: int) -> EngineState:
        """The state after the first `seq` events, through snapshots (a fresh copy)."""
        return self.snapshots.state_at(seq)


def load_tape(
    source: str | os.PathLike[str] | MemoryTape | Tape,
    since: TimePoint | None = None,
    until: TimePoint | None = None,
) -> Tape:
    """A tape file, a segmented tape's directory (its segments as one tape, or those of the
    window `since`..`until`: seconds since the epoch, or a timedelta before the tape's end),
    a memory tape, or a Tape as is."""
    if isinstance(source, Tape):
        return source
    if isinstance(source, MemoryTape):
        return Tape(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        if not is_segmented_tape(path):
            raise TapeError(
                path,
                f"is a directory, not a tape: it has no segmented tape's manifest ({MANIFEST})",
            )
        return Tape(SegmentedTapeReader(path, since, until))
    if since is not None or until is not None:
        raise TapeError(path, "a time window (--since, --until) needs a segmented tape's directory")
    return Tape(SQLiteTapeReader(path))


def fold(source: str | os.PathLike[str] | MemoryTape | Tape) -> EngineState:
    """The engine state derived from a whole tape: what the live engine had at its end."""
    return load_tape(source).fold()
