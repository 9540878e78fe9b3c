"""Periodic snapshots of the derived state, so that seeking anywhere in a tape is cheap.

A `SnapshotIndex` folds its tape once, in one streaming pass that goes only as far as it is
asked to, and keeps a snapshot of the `EngineState` every `interval` events (in memory),
plus the position of every `StepScheduled`. The state at any position is then the nearest
snapshot at or before it, copied, with at most `interval - 1` events folded on top: the cost
of a seek no longer grows with the length of the tape.

Copies are made field by field (`copy_state`), not by pickling: a request's output and block
lists are copied with one C-level slice each, the prompt (never mutated), the sampling params
(frozen) and the scheduled entries (frozen) are shared. It works on the interpreted and on the
mypyc-compiled state classes alike, since it only reads and sets their attributes.

A *settled* request (finished, nothing of it in flight, its output delivered) is never
changed by the reducer again: no event can name it any more (tests/replay/test_snapshots.py checks
the invariant). So a `Snapshot` keeps copies of the requests still live only, and the index
keeps every request object of its pass in arrival order: restoring takes the settled ones
from there. A snapshot costs time and memory in proportion to the live requests, not to
every request the tape ever served, and `copy_state` shares settled requests the same way.
States handed out are therefore to be read and folded on, not edited by hand.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from tokentape.events import schema as ev
from tokentape.events.fold_errors import FOLD_ERRORS, ReducerError, event_refused, one_line
from tokentape.events.reducer import evolve, fold_events
from tokentape.events.state import EngineState, InFlightStep, RequestState

DEFAULT_INTERVAL = 2048

# Attribute names, read once: the compiled classes keep their dataclass fields.
_REQUEST_ARGS = ("req_id", "prompt_token_ids", "params", "arrival_step")  # the constructor's
_REQUEST_FIELDS = tuple(
    f.name for f in dataclasses.fields(RequestState) if f.init and f.name not in _REQUEST_ARGS
)
_REQUEST_DERIVED = tuple(f.name for f in dataclasses.fields(RequestState) if not f.init)
_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineState))
# Immutable, or never mutated after the request is added: shared between copies.
_SHARED = frozenset({"prompt_token_ids", "params", "stop_ids"})


def _copy_value(value: Any) -> Any:
    """A shallow copy of a mutable container; immutable values are returned as they are."""
    if isinstance(value, (list, dict, set, deque)):
        return value.copy()
    return value


def copy_request(req: RequestState) -> RequestState:
    """An independent copy of a request's derived state."""
    new = RequestState(req.req_id, req.prompt_token_ids, req.params, req.arrival_step)
    for name in _REQUEST_FIELDS:
        value = getattr(req, name)
        setattr(new, name, value if name in _SHARED else _copy_value(value))
    for name in _REQUEST_DERIVED:
        setattr(new, name, getattr(req, name))
    return new


def is_settled(state: EngineState, req: RequestState) -> bool:
    """Finished, nothing in flight, output delivered: no later event changes the request."""
    return (
        req.finish_reason is not None
        and not req.num_in_flight
        and req.req_id not in state.pending_output
    )


def _with_requests(state: EngineState, requests: dict[str, RequestState]) -> EngineState:
    """A copy of the engine-level fields of `state` around `requests` (already copied);
    in-flight steps are pointed at those requests."""
    new = EngineState(state.discard_policy)
    for name in _ENGINE_FIELDS:
        if name == "requests":
            new.requests = requests
        elif name == "in_flight_steps":
            new.in_flight_steps = deque(
                InFlightStep(
                    s.step, s.entries, [requests[r.req_id] for r in s.requests], set(s.partial)
                )
                for s in state.in_flight_steps
            )
        elif name == "frame_outputs":
            # Settled requests are shared: those of the latest frame may be among them.
            new.frame_outputs = [(requests.get(r.req_id, r), n) for r, n in state.frame_outputs]
        else:
            setattr(new, name, _copy_value(getattr(state, name)))
    return new


def copy_state(state: EngineState) -> EngineState:
    """An independent copy of the engine state: folding more events into either leaves the
    other unchanged. Settled requests are shared (nothing changes them); in-flight steps point
    at the copied requests."""
    return _with_requests(
        state,
        {
            req_id: r if is_settled(state, r) else copy_request(r)
            for req_id, r in state.requests.items()
        },
    )


class Snapshot:
    """The state after `seq` events, kept small: the engine-level fields, copies of the
    requests not settled then, and how many requests had been added. The settled ones are
    the index's own request objects (in arrival order), which nothing changes any more."""

    __slots__ = ("engine", "live", "num_requests", "seq")

    def __init__(self, state: EngineState, seq: int) -> None:
        self.seq = seq
        self.num_requests = len(state.requests)
        self.live = {
            req_id: copy_request(r)
            for req_id, r in state.requests.items()
            if not is_settled(state, r)
        }
        # Every request of an in-flight step has something in flight, so it is live.
        self.engine = _with_requests(state, self.live)
        self.engine.requests = {}  # the requests are rebuilt on restore

    def restore(self, arrivals: list[RequestState]) -> EngineState:
        """A fresh state equal to the one snapshotted; `arrivals` are the index's requests in
        the order they were added (at least `num_requests` of them)."""
        live = self.live
        requests = {}
        for r in arrivals[: self.num_requests]:
            copy = live.get(r.req_id)
            requests[r.req_id] = r if copy is None else copy_request(copy)
        return _with_requests(self.engine, requests)


EventSource = Callable[[int], Iterator[tuple[int, ev.Event]]]


class SnapshotIndex:
    """Snapshots of one tape's state every `interval` events, built lazily and incrementally.

    `events_from(seq)` streams the tape's `(seq, event)` pairs from `seq` on; `initial` is the
    state before any event. `state_at(seq)` is the state after the first `seq` events (the
    events before position `seq`), `seq_of_step(step)` the position of step `step`'s
    `StepScheduled` event.
    """

    def __init__(
        self,
        events_from: EventSource,
        initial: EngineState,
        num_events: int,
        interval: int = DEFAULT_INTERVAL,
    ) -> None:
        if interval < 1:
            raise ValueError(f"the snapshot interval must be >= 1, got {interval}")
        self.events_from = events_from
        self.interval = interval
        self.num_events = num_events
        # Snapshot i holds the state after the first positions[i] events.
        self.positions: list[int] = [0]
        self.snapshots: list[Snapshot] = [Snapshot(initial, 0)]
        # Every request of the indexing pass, in arrival order: a settled one is shared by
        # the snapshots taken after it settled.
        self.arrivals: list[RequestState] = list(initial.requests.values())
        self.step_seqs: list[int] = []  # step_seqs[n]: position of StepScheduled(step=n)
        # The live fold of the indexing pass, and how far it got.
        self._frontier = initial
        self._frontier_seq = 0
        self._frontier_events: Iterator[tuple[int, ev.Event]] | None = None
        self.error: str | None = None  # why the index ends before the tape does, if it does

    # -- building ------------------------------------------------------------------------------

    @property
    def indexed_to(self) -> int:
        """Events folded by the indexing pass so far."""
        return self._frontier_seq

    def extend_to(self, seq: int, progress: Callable[[int], None] | None = None) -> None:
        """Run the indexing pass until it has folded `seq` events (or the tape ends)."""
        seq = min(seq, self.num_events)
        if self._frontier_seq >= seq:
            return
        if self._frontier_events is None:
            self._frontier_events = self.events_from(self._frontier_seq)
        state, step_seqs, interval = self._frontier, self.step_seqs, self.interval
        n = self._frontier_seq
        s = -1
        event: ev.Event | None = None
        try:
            for s, event in self._frontier_events:
                if s != n:
                    raise ValueError(f"the tape skips from event {n} to {s}")
                evolve(state, event)
                kind = type(event)
                if kind is ev.StepScheduled:
                    step_seqs.append(s)
                elif kind is ev.RequestAdded:
                    self.arrivals.append(state.requests[event.req_id])  # type: ignore[attr-defined]
                n += 1
                if n % interval == 0:
                    self.positions.append(n)
                    self.snapshots.append(Snapshot(state, n))
                    if progress is not None:
                        progress(n)
                if n >= seq:
                    break
        except FOLD_ERRORS as exc:
            if s >= n and event is not None:  # the event in hand was refused
                self._cut_at(n, event_refused(s, event, exc))
            else:  # event n - 1 was applied; reading the next one failed
                self._cut_at(n, exc)
        self._frontier_seq = n
        if n < seq:  # the tape is shorter than its count said (it is still being written)
            self.num_events = n

    def _cut_at(self, n: int, exc: Exception) -> None:
        """The event at position `n` cannot follow the ones before it (a damaged or
        hand-edited tape): the index ends before it, with a clean state, and says why."""
        self.num_events = n
        self.error = (
            str(exc)
            if isinstance(exc, ReducerError)
            else (f"event {n} cannot be read: {one_line(exc)}")
        )
        self._frontier_events = None
        i = bisect.bisect_right(self.positions, n) - 1
        state = self.snapshots[i].restore(self.arrivals)
        # Requests the failed event may have half-added are not in the arrival list yet.
        self._frontier = fold_events(self.events_from(self.positions[i]), state, n)
        self._frontier_seq = n
        raise ReducerError(self.error) from None

    def build(self, progress: Callable[[int], None] | None = None) -> SnapshotIndex:
        """Index the whole tape."""
        self.extend_to(self.num_events, progress)
        return self

    # -- seeking -------------------------------------------------------------------------------

    def state_at(self, seq: int) -> EngineState:
        """The state after the first `seq` events: a fresh copy, the caller may fold on."""
        if not 0 <= seq <= self.num_events:
            raise IndexError(f"position {seq} is outside the tape (0..{self.num_events})")
        self.extend_to(seq)
        if seq == self._frontier_seq:
            return copy_state(self._frontier)
        i = bisect.bisect_right(self.positions, seq) - 1
        start = self.positions[i]
        state = self.snapshots[i].restore(self.arrivals)
        if seq > start:
            fold_events(self.events_from(start), state, seq)
        return state

    def seq_of_step(self, step: int, progress: Callable[[int], None] | None = None) -> int | None:
        """The position of `StepScheduled(step)`, or None when the tape never schedules it
        (a negative step included). `progress` is passed on to `extend_to`."""
        if step < 0:
            return None
        while len(self.step_seqs) <= step and self._frontier_seq < self.num_events:
            # Index on in chunks until the step is found or the tape ends.
            self.extend_to(self._frontier_seq + self.interval, progress)
        return self.step_seqs[step] if step < len(self.step_seqs) else None

    def state_at_step(self, step: int) -> EngineState:
        """As `Tape.at(step)`: after step `step` was scheduled, before step `step + 1` was
        (a negative step: before step 0)."""
        nxt = self.seq_of_step(max(step + 1, 0))
        return self.state_at(self.num_events if nxt is None else nxt)
