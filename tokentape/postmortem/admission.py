"""admission_stalled: the engine kept serving its running requests, step after step, while
the head of the waiting queue had everything it needed to be admitted and nobody was.

A step had room to admit the head when every rule of the scheduler says it must have
(room.py). A correct engine leaves no such step at all; the threshold is a margin. Unlike
`request_stuck` (one request, 200 steps, a warning), this is the engine's admission itself
stopping while every health check passes (vLLM #53130).
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.postmortem.base import Hook
from tokentape.postmortem.context import Context
from tokentape.postmortem.room import RoomChecker

STALLED_AFTER_STEPS = 8  # consecutive steps with room for the head, nobody admitted


class AdmissionChecker(RoomChecker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._head: str | None = None  # the head of the stretch being counted
        self._since = 0  # the stretch's first step
        self._steps = 0  # steps in it
        self._reported: set[str] = set()

    def after(self) -> dict[type, Hook]:
        return {ev.StepScheduled: self._scheduled}

    def _scheduled(self, seq: int, e: ev.StepScheduled) -> None:
        room = self.head_with_room(e, sum(entry.num_new_tokens for entry in e.entries))
        head = room.req_id if room is not None else None
        if head is None:
            self._head = None
            return
        if head != self._head:
            self._head, self._since, self._steps = head, e.step, 0
        self._steps += 1
        if self._steps == STALLED_AFTER_STEPS and head not in self._reported:
            self._reported.add(head)
            self._report(seq, e, head)

    def _report(self, seq: int, e: ev.StepScheduled, head: str) -> None:
        state = self.state
        free = self.free_blocks()
        need = -(-state.requests[head].num_tokens // self.block_size)
        waiting = list(state.waiting)
        self.ctx.report(
            "admission_stalled",
            "error",
            waiting[:8],
            self._since,
            f"admission stalled: for {self._steps} steps ({self._since}-{e.step}) the engine "
            f"served its {len(state.running)} running request(s) while request {head!r}, the "
            f"head of {len(waiting)} waiting, had a sequence slot ({len(state.running)} of "
            f"{self.max_seqs} running), token budget and the KV blocks it needs ({need} of "
            f"{free} free), and nobody was admitted",
            [(seq, e)],
            "vllm#53130",
            seq,
            last_step=e.step,
            per_request=False,
        )
