"""request_stuck: an unfinished request that made no progress for many steps in which the
scheduler had to make progress with it.

The scheduler is first come, first served, as vLLM's: running requests first, then the
waiting queue from its head, and a head that does not fit stops admission (nobody behind it
jumps the queue). So a step *had room* for a request only when every rule says it must have
been scheduled:
- a running request with nothing in flight, in a step that left token budget unused (the
  budget reached it: the scheduler only skips a running request whose steps in flight already
  produce every token it may have);
- the head of the waiting queue, in a step with room to admit it (room.py).
Requests queued behind the head are never stuck: they wait for it.
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.postmortem.base import Hook
from tokentape.postmortem.context import Context
from tokentape.postmortem.room import RoomChecker

STUCK_AFTER_STEPS = 200  # steps with room for the request but no progress


class StuckChecker(RoomChecker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.idle: dict[str, int] = {}  # request -> steps with room but without progress
        self.since: dict[str, int] = {}  # request -> the step its idle stretch started
        self.reported: set[str] = set()

    def after(self) -> dict[type, Hook]:
        return {ev.StepScheduled: self._scheduled}

    def _scheduled(self, seq: int, e: ev.StepScheduled) -> None:
        idle = self.idle
        tokens = 0
        for entry in e.entries:
            tokens += entry.num_new_tokens
            if entry.req_id in idle:
                del idle[entry.req_id]
                del self.since[entry.req_id]
        if tokens >= self.budget:
            return  # the budget ran out: nobody left out of this step had room
        state = self.state
        requests, running = state.requests, state.running
        if len(e.entries) < len(running):
            scheduled = {entry.req_id for entry in e.entries}
            for req_id in running:
                if req_id not in scheduled and not requests[req_id].num_in_flight:
                    self._no_progress(req_id, seq, e)
        head = self.head_with_room(e, tokens)
        if head is not None:
            self._no_progress(head.req_id, seq, e)

    def _no_progress(self, req_id: str, seq: int, e: ev.StepScheduled) -> None:
        n = self.idle[req_id] = self.idle.get(req_id, 0) + 1
        since = self.since.setdefault(req_id, e.step)
        if n >= STUCK_AFTER_STEPS and req_id not in self.reported:
            self.reported.add(req_id)
            req = self.state.requests[req_id]
            self.ctx.report(
                "request_stuck",
                "warning",
                [req_id],
                since,
                f"request {req_id!r} ({req.status.value}) made no progress for {n} steps "
                f"(steps {since}-{e.step}) that had token budget, a sequence slot and free "
                "KV blocks for it",
                [(seq, e)],
                None,
                seq,
                last_step=e.step,
            )
