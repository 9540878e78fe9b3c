"""Engine calls made at given steps of a generation: the RL loop's pause and resume, prefix
cache resets and aborts, scripted so that a run that shows a bug can be recorded from the
shell (`tokentape generate --pause-at 4 --discard-policy flag` records vLLM #42043).

    llm.generate(prompts, params, scenario=Scenario([Pause(4, "keep"), Abort(9, "1")]))

Each call is made when the engine is about to schedule step `step` (after the outputs of the
step before were delivered), in the order given for calls at the same step. A pause is
vLLM's `pause_generation(mode, clear_cache=True)`, which returns once drained, followed at
once by `resume_generation()`, as an RL loop does around a weight update. A reset is
`reset_prefix_cache(reset_running_requests=True)`, with whatever is in flight left in
flight. A call whose step the run never reaches is not made (`Scenario.pending` lists it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokentape.engine.core.call_args import PAUSE_MODES
from tokentape.engine.core.engine_core import EngineCore
from tokentape.events.validation import check_int, check_str


@dataclass(frozen=True, slots=True)
class Pause:
    step: int
    mode: str = "keep"

    def describe(self) -> str:
        return f"pause ({self.mode}) at step {self.step}"

    def apply(self, engine: EngineCore) -> None:
        engine.pause_generation(mode=self.mode, clear_cache=True)
        engine.resume_generation()


@dataclass(frozen=True, slots=True)
class Reset:
    step: int

    def describe(self) -> str:
        return f"prefix-cache reset at step {self.step}"

    def apply(self, engine: EngineCore) -> None:
        engine.reset_prefix_cache(reset_running_requests=True)


@dataclass(frozen=True, slots=True)
class Abort:
    step: int
    req_id: str

    def describe(self) -> str:
        return f"abort of request {self.req_id!r} at step {self.step}"

    def apply(self, engine: EngineCore) -> None:
        engine.abort_request(self.req_id)  # a request that already finished: nothing to do


Call = Pause | Reset | Abort


class Scenario:
    """Calls to make at given steps; `apply_due(engine)` before each engine step makes those
    whose step has come. One scenario drives one generation."""

    def __init__(self, calls: Iterable[Call]) -> None:
        calls = list(calls)
        for call in calls:
            if not isinstance(call, (Pause, Reset, Abort)):
                raise TypeError(f"a scenario holds Pause, Reset and Abort calls, got {call!r}")
            check_int(f"{call.describe()}: step", call.step, 0)
            if isinstance(call, Pause) and call.mode not in PAUSE_MODES:
                raise ValueError(
                    f"pause at step {call.step}: mode must be one of "
                    f"{', '.join(PAUSE_MODES)}, got {call.mode!r}"
                )
            if isinstance(call, Abort):
                check_str(f"abort at step {call.step}: request id", call.req_id)
        self.calls = sorted(calls, key=lambda c: c.step)  # stable: the given order within a step
        self._next = 0

    def check_requests(self, request_ids: Sequence[str]) -> None:
        """Refuse an abort of a request the generation does not have, before anything runs."""
        known = set(request_ids)
        for call in self.calls:
            if isinstance(call, Abort) and call.req_id not in known:
                shown = ", ".join(request_ids[:10]) + (", ..." if len(request_ids) > 10 else "")
                raise ValueError(f"{call.describe()}: no such request (the requests are {shown})")

    def apply_due(self, engine: EngineCore) -> None:
        calls, step = self.calls, engine.state.step
        while self._next < len(calls) and calls[self._next].step <= step:
            call = calls[self._next]
            self._next += 1
            call.apply(engine)

    @property
    def pending(self) -> list[Call]:
        """The calls not made (yet): the run ended before their step."""
        return self.calls[self._next :]
