"""`why(tape, request, position)`: the chain of events behind one output token of a request.

Pernosco's dataflow view answers "where did this value come from?" with the writes that made
it; here the value is the token at output position P of a request, and the answer is:
the step that scheduled it (and the position that step scheduled it for: a fresh frame
dropped earlier shifts every later token), the frame that produced it and its epoch, every
discard decision that touched the position (frames dropped by the policy, stale frames,
preemptions in between), and the `OutputsEmitted` that delivered it; for a token that never
came, why not.

The request is folded alone: its own events (tokentape/replay/why_source.py finds them by
seeks) go through the reducer into a state that holds only this request, with every step and
frame cut to its entry. The reducer changes a request only for events that name it, so the
projected request equals the one a full fold derives (tests/replay/test_why.py checks it). On
a tape with weight updates, why_weights.py adds the weights that computed the token and any
prefix it reused from KV of older weights.
"""

from __future__ import annotations

import heapq
from typing import Any

from tokentape.events import schema as ev
from tokentape.replay.tape import Tape, load_tape
from tokentape.replay.why_explain import WhyError, WhyResult, explain
from tokentape.replay.why_sleep import SleepFacts
from tokentape.replay.why_source import WhySource, merged
from tokentape.replay.why_trace import RequestTracer, project
from tokentape.replay.why_weights import add_weights


def _held_by_first_snapshot(tape: Tape, req_id: str) -> bool:
    first = next(tape.events(), None)
    return (
        first is not None
        and type(first[1]) is ev.EngineSnapshot
        and any(r.req_id == req_id for r in first[1].requests)
    )


def trace_request(
    tape: Tape, req_id: str, source: WhySource | None = None, position: int | None = None
) -> RequestTracer:
    """Fold the request alone, from its `RequestAdded` until it is settled (or the tape ends),
    or, given a `position`, until that position is delivered and nothing in flight targets it."""
    own = source or WhySource(tape)
    try:
        start = own.added_seq(req_id)
        if start is None and _held_by_first_snapshot(tape, req_id):
            raise WhyError(
                f"{tape.path or 'the tape'}: request {req_id!r} was added before this segment "
                "(its opening snapshot holds it); why follows a request from its RequestAdded: "
                "give the segmented tape's directory, or a window from the segment it was "
                "added in"
            )
        if start is None:
            known = own.request_ids()
            listed = ", ".join(map(repr, known)) + (", ..." if len(known) == 10 else "")
            raise WhyError(
                f"{tape.path or 'the tape'}: no request {req_id!r} on the tape"
                + (f" (requests: {listed})" if known else " (it has no requests)")
            )
        tracer = RequestTracer(tape, req_id)
        # Only the fault output_on_reused_id lets a tape add an id twice; then the latest
        # request of the id is explained.
        reused_ids = "output_on_reused_id" in tracer.state.faults
        extra: list[tuple[int, ev.Event]] = []
        looked_up: set[int] = set()
        for seq, event in merged(own.events(req_id, start), extra):
            cut = project(event, req_id)
            if cut is None:
                continue
            tracer.apply(seq, cut)
            if type(cut) is ev.StepScheduled:
                frame = tracer.frames[cut.step]
                if frame.first is None and cut.step not in looked_up:  # its frame does not name us
                    looked_up.add(cut.step)
                    found = own.frame_of(cut.step, seq)
                    if found is not None:
                        heapq.heappush(extra, found)  # type: ignore[arg-type]
            if reused_ids:
                continue  # the id may be added again later: read on (museum tapes only)
            if tracer.added is not None and (tracer.settled() or tracer.done_with(position)):
                break
        tracer.events_read = own.rows_read
        return tracer
    finally:
        if source is None:
            own.close()


def why(source: str | Any, req_id: str, position: int) -> WhyResult:
    """Explain output position `position` (0-based) of request `req_id` on a tape."""
    if type(position) is not int:
        raise TypeError(f"position must be an int, got {type(position).__name__}")
    if position < 0:
        raise WhyError(f"position must be >= 0 (output positions count from 0), got {position}")
    tape = load_tape(source)
    tracer = trace_request(tape, req_id, position=position)
    sleeps = SleepFacts.read(tape, tracer)
    result = explain(tracer, position, sleeps.parked_note(tracer) if sleeps else None)
    if sleeps is not None:
        sleeps.add_in_flight(tracer, result)
    add_weights(tape, tracer, result)
    result.tape = tape.path
    result.discard_policy = tape.header.discard_policy
    return result
