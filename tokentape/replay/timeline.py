"""A tape as a timeline: per-request spans (phases) and instant markers.

`build_timeline(tape)` folds the tape through the reducer, event by event, and records when
each request changes phase and where something noteworthy happened. Export to Perfetto and
the postmortem's HTML timeline draw from it.

Time is the tape position: an item at `seq` happened at the event with that sequence
number; spans are half-open `[start_seq, end_seq)`. Each item also carries the engine step
of its events, for labels.

Phases of a request (`Span.phase`), in the order they usually come:

- `waiting`: added, never scheduled yet;
- `prefill`: scheduled in its current epoch, no frame of that epoch has come back yet
  (chunked prefill, then the first sampling step's pipeline latency: time to first token);
- `decode`: running, and a frame of its current epoch has come back;
- `preempted`: preempted (KV pressure or a prefix-cache reset), waiting to be recomputed;
- `paused`: generation is paused and the request is not progressing: every unfinished
  request under `keep` (and `abort`, until the aborts land), the not-running ones under
  `wait`, whose running requests keep decoding.

A finished request has no span after its finish; a span still open at the end of the tape
ends at `Timeline.num_events` with `open=True`.

Markers (`Marker.kind`): `reset` (PrefixCacheReset, engine-wide), `pause`, `resume`,
`weights` (WeightsUpdated), `sleep` (EngineSlept, detail: the level), `wake` (EngineWokeUp,
detail: the tags), `error` (EngineError), `stopped` (RecordingStopped: another engine's
recorder stopped there), all engine-wide (`req_id` None); and per
request: `preempt` (detail: the reason), `discarded` (a frame thrown away by the discard
policy; detail `stale`, or `fresh` when a valid frame was lost: the #42043 signature),
`finish` (detail: stop, length or abort).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from tokentape.events import schema as ev
from tokentape.events.reducer import evolve
from tokentape.events.state import EngineState, RequestState, RequestStatus
from tokentape.events.store import MemoryTape

Phase = Literal["waiting", "prefill", "decode", "preempted", "paused"]
MarkerKind = Literal[
    "reset",
    "pause",
    "resume",
    "weights",
    "sleep",
    "wake",
    "error",
    "stopped",
    "preempt",
    "discarded",
    "finish",
]

PHASES: tuple[Phase, ...] = ("waiting", "prefill", "decode", "preempted", "paused")
ENGINE_MARKERS: frozenset[str] = frozenset(
    {"reset", "pause", "resume", "weights", "sleep", "wake", "error", "stopped"}
)


@dataclass(frozen=True, slots=True)
class Span:
    """A request in one phase over the events `[start_seq, end_seq)`."""

    req_id: str
    phase: Phase
    start_seq: int
    end_seq: int
    start_step: int  # the engine step of the event that opened the span
    end_step: int  # the engine step of the event that closed it (the last step if open)
    open: bool = False  # still in this phase when the tape ends

    @property
    def num_events(self) -> int:
        return self.end_seq - self.start_seq


@dataclass(frozen=True, slots=True)
class Marker:
    """Something that happened at one event: engine-wide (`req_id` None) or to one request."""

    kind: MarkerKind
    seq: int
    step: int
    req_id: str | None = None
    detail: str = ""


@dataclass(slots=True)
class Timeline:
    requests: list[str]  # request ids in the order they were added
    spans: list[Span]  # ordered by start_seq (per request: consecutive, never overlapping)
    markers: list[Marker]  # ordered by seq
    num_events: int  # events read: the time axis is [0, num_events)
    num_steps: int  # steps scheduled
    discard_policy: str = "epoch"
    finish_reasons: dict[str, str] = field(default_factory=dict)  # req_id -> stop/length/abort

    def spans_of(self, req_id: str) -> list[Span]:
        return [s for s in self.spans if s.req_id == req_id]

    def markers_of(self, req_id: str | None) -> list[Marker]:
        """The markers of one request, or the engine-wide ones for None."""
        return [m for m in self.markers if m.req_id == req_id]


def _event_requests(event: ev.Event, state: EngineState) -> Iterable[str]:
    """The requests whose phase this event may change."""
    match event:
        case (
            ev.RequestAdded(req_id=r)
            | ev.RequestAborted(req_id=r)
            | ev.RequestFinished(req_id=r)
            | ev.RequestPreempted(req_id=r)
        ):
            return (r,)
        case ev.StepScheduled(entries=entries):
            return [e.req_id for e in entries]
        case ev.FrameProduced(entries=entries):
            return [e.req_id for e in entries]
        case ev.GenerationPaused() | ev.GenerationResumed():
            return [r.req_id for r in state.requests.values() if not r.is_finished]
    return ()


class _Builder:
    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.spans: list[Span] = []
        self.markers: list[Marker] = []
        self.requests: list[str] = []
        self.finish_reasons: dict[str, str] = {}
        # Per request: its open span (phase, start_seq, start_step), and the epoch whose
        # frame came back last (decode starts when that is the current epoch).
        self.open: dict[str, tuple[Phase, int, int]] = {}
        self.answered_epoch: dict[str, int] = {}
        self.last_step = 0

    def phase(self, req: RequestState) -> Phase | None:
        if req.is_finished:
            return None
        paused = self.state.paused
        if paused is not None and (paused != "wait" or req.status is not RequestStatus.RUNNING):
            return "paused"
        if req.status is RequestStatus.WAITING:
            return "waiting"
        if req.status is RequestStatus.PREEMPTED:
            return "preempted"
        return "decode" if self.answered_epoch.get(req.req_id) == req.epoch else "prefill"

    def close(self, req_id: str, seq: int, step: int, still_open: bool = False) -> None:
        phase, start_seq, start_step = self.open.pop(req_id)
        if seq > start_seq:
            self.spans.append(Span(req_id, phase, start_seq, seq, start_step, step, still_open))

    def update(self, req_id: str, seq: int, step: int) -> None:
        req = self.state.requests.get(req_id)
        if req is None:
            return
        new = self.phase(req)
        current = self.open.get(req_id)
        if current is not None and current[0] == new:
            return
        if current is not None:
            self.close(req_id, seq, step)
        if new is not None:
            self.open[req_id] = (new, seq, step)

    def apply(self, seq: int, event: ev.Event) -> None:
        state, step = self.state, event.step
        self.last_step = max(self.last_step, step)
        dropped_before: dict[str, tuple[int, bool]] = {}
        if isinstance(event, ev.FrameProduced) and state.in_flight_steps:
            head = state.in_flight_steps[0]
            for entry, req in zip(head.entries, head.requests):
                # Whether the frame answers the request's current epoch, and the drops so far.
                dropped_before[entry.req_id] = (req.num_frames_dropped, entry.epoch != req.epoch)
        evolve(state, event)
        # A phase that changes at this event starts just after it, so the event itself (a
        # preemption, a finish) sits at the end of the span it closes.
        at = seq + 1
        match event:
            case ev.RequestAdded(req_id=r):
                self.requests.append(r)
            case ev.PrefixCacheReset(ok=ok, reset_running_requests=running):
                detail = ("ok" if ok else "failed") + (
                    ", running requests reset" if running else ""
                )
                self.markers.append(Marker("reset", seq, step, None, detail))
            case ev.GenerationPaused(mode=mode, clear_cache=clear):
                detail = f"mode={mode}" + (", clear_cache" if clear else "")
                self.markers.append(Marker("pause", seq, step, None, detail))
            case ev.GenerationResumed():
                self.markers.append(Marker("resume", seq, step))
            case ev.WeightsUpdated(weights_id=w, weight_version=version):
                detail = f"{w}, version {version}" if version else w
                self.markers.append(Marker("weights", seq, step, None, detail))
            case ev.EngineSlept(level=level):
                self.markers.append(Marker("sleep", seq, step, None, f"level={level}"))
            case ev.EngineWokeUp(tags=tags):
                detail = "all" if tags is None else ",".join(tags)
                self.markers.append(Marker("wake", seq, step, None, detail))
            case ev.EngineError(error_type=t, message=m):
                self.markers.append(Marker("error", seq, step, None, f"{t}: {m}"))
            case ev.RecordingStopped(reason=reason):
                self.markers.append(Marker("stopped", seq, step, None, reason))
            case ev.RequestPreempted(req_id=r, reason=reason):
                self.markers.append(Marker("preempt", seq, step, r, reason))
            case ev.RequestFinished(req_id=r, reason=reason):
                self.markers.append(Marker("finish", seq, step, r, reason))
                self.finish_reasons[r] = reason
            case ev.RequestAborted(req_id=r):
                if r not in self.finish_reasons:
                    self.markers.append(Marker("finish", seq, step, r, "abort"))
                    self.finish_reasons[r] = "abort"
            case ev.FrameProduced(entries=entries):
                for fe in entries:
                    req = state.requests[fe.req_id]
                    before = dropped_before.get(fe.req_id)
                    if before is not None and req.num_frames_dropped > before[0]:
                        kind = "stale" if before[1] else "fresh"
                        self.markers.append(Marker("discarded", seq, step, fe.req_id, kind))
                    if before is not None and not before[1]:
                        self.answered_epoch[fe.req_id] = req.epoch
        if isinstance(event, ev.RequestAdded):
            at = seq  # a request's life starts at its own event
        for req_id in _event_requests(event, state):
            self.update(req_id, at, step)

    def finish(self, num_events: int) -> Timeline:
        for req_id in list(self.open):
            self.close(req_id, num_events, self.last_step, still_open=True)
        self.spans.sort(key=lambda s: (s.start_seq, s.req_id))
        return Timeline(
            self.requests,
            self.spans,
            self.markers,
            num_events,
            self.state.step,
            self.state.discard_policy,
            self.finish_reasons,
        )


def timeline_from_events(
    events: Iterable[tuple[int, ev.Event]],
    state: EngineState,
    progress: Callable[[int], None] | None = None,
) -> Timeline:
    """Build a timeline from `(seq, event)` pairs folded into `state` (an initial state)."""
    builder = _Builder(state)
    n = 0
    for seq, event in events:
        builder.apply(seq, event)
        n = seq + 1
        if progress is not None and not n & 0xFFF:
            progress(n)
    return builder.finish(n)


def build_timeline(
    source: str | os.PathLike[str] | MemoryTape | object,
    progress: Callable[[int], None] | None = None,
) -> Timeline:
    """The timeline of a whole tape (a path, a MemoryTape or a loaded `Tape`).

    `progress`, if given, is called with the number of events read every 4096 events."""
    from tokentape.replay.tape import load_tape

    tape = load_tape(source)  # type: ignore[arg-type]
    return timeline_from_events(tape.events(), tape.initial_state(), progress)


def iter_items(timeline: Timeline) -> Iterator[Span | Marker]:
    """Spans and markers merged in time order (spans at their start)."""
    spans, markers = timeline.spans, timeline.markers
    i = j = 0
    while i < len(spans) or j < len(markers):
        if j >= len(markers) or (i < len(spans) and spans[i].start_seq <= markers[j].seq):
            yield spans[i]
            i += 1
        else:
            yield markers[j]
            j += 1
