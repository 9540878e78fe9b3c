"""admission_stalled: the engine kept serving its running requests, step after step, while
the head of the waiting queue had everything it needed to be admitted and nobody was.

A step had room to admit the head when every rule of the scheduler says it must have
(room.py). A correct engine leaves no such step at all; the threshold is a margin. Unlike
`request_stuck` (one request, 200 steps, a warning), this is the engine's admission itself
stopping while every health check passes (vLLM #53130).

When the head was added while the engine slept, and the engine, awake again, serves others
past it, the finding is `request_parked_after_wake` instead: the sleep parked it and nothing
took it out again (vLLM #45268). A correct engine queues such a request and admits it after
the wake-up like any other, so the same rule holds it.
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.postmortem.base import Hook
from tokentape.postmortem.context import Context, Item
from tokentape.postmortem.room import RoomChecker

STALLED_AFTER_STEPS = 8  # consecutive steps with room for the head, nobody admitted


class AdmissionChecker(RoomChecker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._head: str | None = None  # the head of the stretch being counted
        self._since = 0  # the stretch's first step
        self._steps = 0  # steps in it
        self._reported: set[str] = set()
        self._slept: Item | None = None  # the latest EngineSlept
        self._woke: Item | None = None  # the latest wake-up that left nothing asleep
        self._added_asleep: dict[str, tuple[Item, Item | None]] = {}  # with its EngineSlept

    def after(self) -> dict[type, Hook]:
        return {
            ev.StepScheduled: self._scheduled,
            ev.RequestAdded: self._added,
            ev.EngineSlept: self._fell_asleep,
            ev.EngineWokeUp: self._woke_up,
        }

    def _added(self, seq: int, e: ev.RequestAdded) -> None:
        if self.state.sleep_level is not None:
            self._added_asleep[e.req_id] = ((seq, e), self._slept)

    def _fell_asleep(self, seq: int, e: ev.EngineSlept) -> None:
        self._slept = (seq, e)

    def _woke_up(self, seq: int, e: ev.EngineWokeUp) -> None:
        if self.state.sleep_level is None:
            self._woke = (seq, e)

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
        if head in self._added_asleep:
            self._report_parked(seq, e, head, f"{need} of {free} free")
            return
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

    def _report_parked(self, seq: int, e: ev.StepScheduled, head: str, blocks: str) -> None:
        (added_seq, added), slept = self._added_asleep[head]
        level = f" (level {slept[1].level})" if slept is not None else ""
        woke = self._woke
        after = f" after the wake-up of step {woke[1].step}" if woke is not None else ""
        self.ctx.report(
            "request_parked_after_wake",
            "error",
            [head],
            self._since,
            f"request {head!r} was added in step {added.step} while the engine slept{level} "
            f"and was never scheduled{after}: for {self._steps} steps ({self._since}-{e.step}) "
            f"the engine served {len(self.state.running)} running request(s) while {head!r}, "
            f"the head of the waiting queue, had a sequence slot, token budget and the KV "
            f"blocks it needs ({blocks}); the sleep parked it and nothing took it out again",
            [(added_seq, added), slept, woke, (seq, e)],
            "vllm#45268",
            seq,
            last_step=e.step,
        )
