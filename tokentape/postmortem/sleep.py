"""step_in_flight_across_sleep: the engine fell asleep, releasing its memory, while steps it
had scheduled were still in flight (vLLM #45520: /sleep with decodes in flight answers 200,
then the engine dies on the step that runs on the freed memory).

A sleep must drain first: tokentape's does, and its EngineSlept records the steps in flight
at the release, an empty list. The checker reads the tape, not the engine's word:
- an EngineSlept of a level that releases memory (1 or 2) while the tape has steps
  scheduled and not yet answered by their frame (EngineSlept's own `in_flight` says so too,
  and the reducer holds the two equal);
- a FrameProduced, after such a sleep, of a step scheduled before it: the step ran on
  memory that was released under it (its output is not to be trusted, and the engine that
  applies it, asleep, fails: the reducer refuses that frame).
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context, Item


class SleepChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._across: dict[int, Item] = {}  # step in flight at a sleep -> that EngineSlept

    def before(self) -> dict[type, Hook]:
        return {ev.EngineSlept: self._slept, ev.FrameProduced: self._frame}

    def _requests_of(self, steps: list[int]) -> list[str]:
        names: dict[str, None] = {}
        for s in self.state.in_flight_steps:
            if s.step in steps:
                names.update(dict.fromkeys(e.req_id for e in s.entries))
        return list(names)

    def _slept(self, seq: int, e: ev.EngineSlept) -> None:
        in_flight = [s.step for s in self.state.in_flight_steps]
        if not in_flight or not e.level:
            return  # level 0 releases nothing: its steps in flight come back harmlessly
        for step in in_flight:
            self._across[step] = (seq, e)
        steps = ", ".join(map(str, in_flight))
        scheduled = [self.ctx.scheduled.get(s) for s in in_flight]
        self.ctx.report(
            "step_in_flight_across_sleep",
            "error",
            self._requests_of(in_flight),
            e.step,
            f"the engine fell asleep (level {e.level}) in step {e.step} with step(s) {steps} "
            "still in flight: the sleep did not drain them, released the memory they run on "
            "and returned as if all were well",
            [*scheduled, (seq, e)],
            "vllm#45520",
            seq,
        )

    def _frame(self, seq: int, e: ev.FrameProduced) -> None:
        sleep = self._across.pop(e.step, None)
        if sleep is None:
            return
        slept = sleep[1]
        awake = "still asleep" if self.state.sleep_level is not None else "awake again"
        self.ctx.report(
            "step_in_flight_across_sleep",
            "error",
            list(dict.fromkeys(x.req_id for x in e.entries)),
            slept.step,
            f"the frame of step {e.step}, scheduled before the engine fell asleep in step "
            f"{slept.step} (level {slept.level}), came back to the engine {awake}: the "
            "step ran across the release of its memory, and an engine without it cannot "
            "apply its output",
            [self.ctx.scheduled.get(e.step), sleep, (seq, e)],
            "vllm#45520",
            seq,
            key="frame",
        )
