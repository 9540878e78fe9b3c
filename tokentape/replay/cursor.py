"""A position on a tape and the state there: what the debugger moves.

The position is a place on the tape: after the first `pos` events, so the *current event* is
the one at sequence number `pos - 1` and the state is the state just after it. Moving
forwards folds events into the state; moving backwards (and any jump) goes through the
tape's periodic snapshots, so it costs at most one snapshot interval of events. Long reads
show a progress bar on a terminal.
"""

from __future__ import annotations

from collections.abc import Callable

from tokentape.events import schema as ev
from tokentape.events.fold_errors import FOLD_ERRORS, ReducerError, event_refused
from tokentape.events.reducer import evolve
from tokentape.events.state import EngineState
from tokentape.progress import progress
from tokentape.replay.breakpoints import Breakpoint, DebuggerError, Scanner
from tokentape.replay.tape import Tape

Stop = Callable[[int, ev.Event, EngineState], "str | None"]


class TapeCursor:
    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.num_events = len(tape)
        self.pos = 0
        self.state = tape.state_at(0)
        self._last_applied: tuple[int, ev.Event] | None = None

    # -- indexing ----------------------------------------------------------------------------

    def index_to(self, pos: int) -> None:
        """Run the snapshot index's pass up to `pos`, with a progress bar when it is long."""
        index = self.tape.snapshots
        with progress(pos - index.indexed_to, "indexing the tape") as update:
            start = index.indexed_to
            index.extend_to(pos, lambda done: update(done - start))

    def seq_of_step(self, step: int) -> int | None:
        """The position of StepScheduled(step), indexing on (with a progress bar) to find it."""
        index = self.tape.snapshots
        start = index.indexed_to
        with progress(self.num_events - start, "indexing the tape") as update:
            return index.seq_of_step(step, lambda done: update(done - start))

    def all_request_ids(self) -> list[str]:
        self.index_to(self.num_events)
        return [r.req_id for r in self.tape.snapshots.arrivals]

    def event_out_of_range(self, seq: int) -> str:
        return f"event {seq} is out of range: the tape has events 0..{self.num_events - 1}"

    def step_out_of_range(self, step: int) -> str:
        self.index_to(self.num_events)  # the last step is known once the whole tape is indexed
        last = len(self.tape.snapshots.step_seqs) - 1
        return f"step {step} is out of range: the tape schedules steps 0..{last}"

    def clip_to_damage(self) -> None:
        """After the reducer refused an event: keep to the part of the tape the index could
        fold, with a clean state."""
        index = self.tape.snapshots
        if index.error is None:
            try:
                self.index_to(self.num_events)  # to find where the damage starts
            except ReducerError:
                pass  # index.error says where
        self.num_events = min(self.num_events, index.num_events)
        self.pos = min(self.pos, self.num_events)
        self.state = self.tape.state_at(self.pos)

    # -- moving ------------------------------------------------------------------------------

    def seek(self, pos: int) -> None:
        if not 0 <= pos <= self.num_events:
            raise DebuggerError(f"position {pos} is outside the tape (0..{self.num_events})")
        self.index_to(pos)
        self.state = self.tape.state_at(pos)
        self.pos = pos

    def run_forward(self, stop: Stop, limit: int | None = None) -> str | None:
        """Fold events forwards until `stop` returns a reason (after applying the event), or
        `limit` events, or the end of the tape."""
        remaining = self.num_events - self.pos
        todo = remaining if limit is None else min(limit, remaining)
        if todo <= 0:
            return None
        state = self.state
        with progress(todo, "reading the tape") as update:
            for n, (seq, event) in enumerate(self.tape.events(self.pos), 1):
                try:
                    evolve(state, event)
                except FOLD_ERRORS as exc:
                    raise event_refused(seq, event, exc) from None
                self.pos = seq + 1
                self._last_applied = (seq, event)
                reason = stop(seq, event, state)
                if reason is not None:
                    return reason
                if n >= todo:
                    break
                if not n & 0xFFFF:
                    update(n)
        return None

    def last_hit_before(self, breakpoints: list[Breakpoint]) -> tuple[int, Breakpoint] | None:
        """The latest position before the current one where a breakpoint is hit, searching
        backwards one snapshot interval at a time."""
        index = self.tape.snapshots
        end = self.pos - 1  # hits must be at positions before the current one
        positions = index.positions
        i = max(j for j, p in enumerate(positions) if p <= end)
        while i >= 0:
            start = positions[i]
            found = self._last_hit_between(breakpoints, start, end)
            if found is not None:
                return found
            end, i = start, i - 1
        return None

    def _last_hit_between(
        self, breakpoints: list[Breakpoint], start: int, end: int
    ) -> tuple[int, Breakpoint] | None:
        """The last position in (start, end] where a breakpoint is hit, folding from `start`."""
        if end <= start:
            return None
        state = self.tape.state_at(start)
        scanner = Scanner(breakpoints, state)
        last = None
        for seq, event in self.tape.events(start):
            if seq >= end:
                break
            try:
                evolve(state, event)
            except FOLD_ERRORS as exc:
                raise event_refused(seq, event, exc) from None
            bp = scanner.check(event, state)
            if bp is not None:
                last = (seq + 1, bp)
        return last

    # -- looking -----------------------------------------------------------------------------

    def current_event(self) -> tuple[int, ev.Event] | None:
        if self.pos == 0:
            return None
        last = self._last_applied  # the event a forward move just applied: no second read
        if last is not None and last[0] == self.pos - 1:
            return last
        return next(self.tape.events(self.pos - 1), None)
