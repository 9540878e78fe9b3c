"""The tracer behind `why` (why.py): a request's own events folded alone, keeping what became
of each scheduled entry and its frame; `why_explain.py` reads the result to explain one
output position. A module of its own so both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from tokentape.events import schema as ev
from tokentape.events.reducer import evolve
from tokentape.events.state import EngineState, RequestState, RequestStatus
from tokentape.replay.tape import Tape


@dataclass(slots=True)
class TracedFrame:
    """One scheduled entry of the request, and what became of its frame."""

    sched_seq: int
    step: int
    epoch: int
    first: int | None  # the first output position it computes (None: a prefill chunk)
    span: int  # positions it may fill: 1 + speculative tokens
    frame_seq: int | None = None
    stale: bool = False
    fate: str = "in flight"  # applied, dropped, ignored, prefill, in flight
    landed: tuple[int, int] | None = None  # output positions its tokens took [a, b)
    would: tuple[int, int] | None = None  # where a dropped frame's tokens would have gone
    sampled_at: int | None = None  # the output position its frame says it was sampled at
    trusted: list[int] | None = None  # blocks an admitted entry took as computed, not computing
    earlier: int | None = None  # scheduled for an earlier request of this id (its RequestAdded)


def project(event: ev.Event, req_id: str) -> ev.Event | None:
    """The event cut to the request's entries (None when nothing of it is left)."""
    kind = type(event)
    if kind is ev.StepScheduled or kind is ev.OutputsEmitted:
        mine = [e for e in event.entries if e.req_id == req_id]  # type: ignore[attr-defined]
        return kind(event.step, mine) if mine else None  # type: ignore[call-arg]
    if kind is ev.FrameProduced:
        return ev.FrameProduced(
            event.step,
            [
                e
                for e in event.entries  # type: ignore[attr-defined]
                if e.req_id == req_id
            ],
        )
    return event if getattr(event, "req_id", None) == req_id else None


class RequestTracer:
    """Folds the request's projected events and keeps what happened to each entry."""

    def __init__(self, tape: Tape, req_id: str) -> None:
        self.req_id = req_id
        self.state: EngineState = tape.initial_state()
        self.frames: dict[int, TracedFrame] = {}  # by step
        self.preemptions: list[tuple[int, ev.RequestPreempted, int]] = []  # with output length
        self.emitted: list[tuple[int, ev.OutputsEmitted, int, int]] = []  # delivered [a, b)
        self.added: tuple[int, ev.RequestAdded] | None = None
        self.finish: tuple[int, ev.Event] | None = None
        self.num_delivered = 0
        self.events_read = 0
        self.block_size = tape.config.block_size
        self.readded: int | None = None  # the id was added again here (a museum fault only)

    @property
    def req(self) -> RequestState:
        return self.state.requests[self.req_id]

    def settled(self) -> bool:
        req = self.req
        return (
            req.finish_reason is not None
            and not req.num_in_flight
            and self.req_id not in self.state.pending_output
        )

    def done_with(self, p: int | None) -> bool:
        """Position `p` is delivered, and no frame in flight may still touch it."""
        if p is None or self.num_delivered <= p:
            return False
        return not any(
            f.fate == "in flight" and f.first is not None and f.first <= p
            for f in self.frames.values()
        )

    def apply(self, seq: int, event: ev.Event) -> None:
        state, kind = self.state, type(event)
        if kind is ev.RequestAdded:
            if self.added is not None:
                self._added_again(seq)
            self.added = (seq, event)  # type: ignore[assignment]
            evolve(state, event)
        elif kind is ev.StepScheduled:
            state.step = event.step  # only this request's steps are folded
            entry = event.entries[0]  # type: ignore[attr-defined]
            admitted = self.req.status is not RequestStatus.RUNNING
            evolve(state, event)
            req = self.req
            partial = self.req_id in state.in_flight_steps[-1].partial
            first = (
                None
                if partial
                else (
                    entry.num_computed_before
                    + entry.num_new_tokens
                    - entry.num_spec_tokens
                    - req.num_prompt_tokens
                )
            )
            self.frames[event.step] = TracedFrame(
                seq,
                event.step,
                entry.epoch,
                first,
                1 + entry.num_spec_tokens,
                fate="prefill" if partial else "in flight",
            )
            if admitted and entry.num_computed_before:
                n = entry.num_computed_before // self.block_size
                self.frames[event.step].trusted = entry.new_block_ids[:n]
        elif kind is ev.FrameProduced:
            if not state.in_flight_steps or state.in_flight_steps[0].step != event.step:
                return  # a step this request was not in
            self._frame(seq, event)  # type: ignore[arg-type]
        elif kind is ev.RequestPreempted:
            evolve(state, event)
            self.preemptions.append((seq, event, len(self.req.output_token_ids)))  # type: ignore[arg-type]
        elif kind is ev.OutputsEmitted:
            got = len(event.entries[0].token_ids)  # type: ignore[attr-defined]
            evolve(state, event)
            self.emitted.append((seq, event, self.num_delivered, self.num_delivered + got))  # type: ignore[arg-type]
            self.num_delivered += got
        else:  # RequestFinished, RequestAborted
            if self.req.finish_reason is None:
                self.finish = (seq, event)
            evolve(state, event)
            # The finish cuts the tokens of the last frame after the stop.
            kept = len(self.req.output_token_ids)
            for f in self.frames.values():
                if f.landed is not None and f.landed[1] > kept:
                    f.landed = (f.landed[0], max(f.landed[0], kept))

    def _added_again(self, seq: int) -> None:
        """The id is added again (a finished request's, as vLLM allows; tokentape's engine only
        under the fault output_on_reused_id): explain the new request, keeping the earlier
        one's steps still in flight, whose output the fault gives to the new one."""
        assert self.added is not None
        first = self.added[0]
        self.frames = {s: f for s, f in self.frames.items() if f.fate in ("in flight", "prefill")}
        for f in self.frames.values():
            f.earlier = first
        self.preemptions, self.emitted, self.finish = [], [], None
        self.num_delivered, self.readded = 0, seq

    def _frame(self, seq: int, event: ev.FrameProduced) -> None:
        req, f = self.req, self.frames[event.step]
        f.frame_seq, f.stale = seq, f.epoch != req.epoch
        before, dropped, stopped = (
            len(req.output_token_ids),
            req.num_frames_dropped,
            req.finish_reason,
        )
        evolve(self.state, event)
        after = len(req.output_token_ids)
        if f.first is None:
            f.fate = "prefill"
        elif req.num_frames_dropped > dropped:
            f.fate = "dropped"
            f.would = (before, before + len(event.entries[0].token_ids))
        elif after > before:
            f.fate, f.landed = "applied", (before, after)
            position = event.entries[0].position
            if position >= 0:
                f.sampled_at = position - req.num_prompt_tokens
        else:
            f.fate = "ignored" if stopped is not None else "applied"
