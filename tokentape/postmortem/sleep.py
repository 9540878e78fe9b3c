"""The sleep races of vLLM's sleep mode, read from the tape.

step_in_flight_across_sleep: the engine fell asleep, releasing its memory, while steps it
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

step_on_sleeping_kv_cache: a step was scheduled while the KV cache sleeps (vLLM #44395, fixed
by #44483: wake_up(tags=["weights"]), as RL frameworks call it before a weight update,
resumed scheduling, and the next forward pass wrote the released KV cache). tokentape's
engine resumes only once every tag is awake, and its reducer refuses a resume or a step
while the engine sleeps, so a tape of it never has one:
- a StepScheduled while "kv_cache" is among the state's sleeping tags, "weights" not: the
  finding names the step, its requests and the wake-up that woke only the weights, and cites
  the wake-up, the resume and the step (the steps after it in that window count as its
  repeats);
- a GenerationResumed while the engine still sleeps after a partial wake-up (some memory
  woken, some still released), where the tape first goes wrong when the reducer refuses it
  (a tape recorded without the fault resume_on_partial_wake: the analysis stops there, this
  finding standing for it), or when no step followed before every tag woke (nothing ran on
  the released memory, but anything that arrived would have).
A step or a resume on an engine with nothing woken since its sleep is the reducer's to
refuse (tape_inconsistent): no wake-up of vLLM's leaves it so.
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.events.reducer import kv_cache_alone_asleep, resumes_on_partial_wake
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context, Item

_BUG_44395 = "vllm#44395"
_MEMORY = {"weights": "the weights", "kv_cache": "the KV cache"}  # sleeping tags, in words


class SleepChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._across: dict[int, Item] = {}  # step in flight at a sleep -> that EngineSlept
        self._sleep: Item | None = None  # the latest EngineSlept
        self._partial: Item | None = None  # the latest wake-up that left something asleep
        self._resumed: Item | None = None  # a resume while asleep, not yet reported

    def before(self) -> dict[type, Hook]:
        return {
            ev.EngineSlept: self._slept,
            ev.FrameProduced: self._frame,
            ev.GenerationResumed: self._resume,
            ev.StepScheduled: self._scheduled,
        }

    def after(self) -> dict[type, Hook]:
        return {ev.EngineWokeUp: self._woke_up}

    def finish(self) -> None:
        if self._resumed is not None:  # the tape ends in the window, no step in it
            self._report_resume(self._resumed, "the tape ends")

    def _requests_of(self, steps: list[int]) -> list[str]:
        names: dict[str, None] = {}
        for s in self.state.in_flight_steps:
            if s.step in steps:
                names.update(dict.fromkeys(e.req_id for e in s.entries))
        return list(names)

    def _slept(self, seq: int, e: ev.EngineSlept) -> None:
        self._sleep, self._partial, self._resumed = (seq, e), None, None
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

    # -- vLLM #44395: generation resumed, and steps scheduled, on a KV cache still asleep ----

    def _woke_up(self, seq: int, e: ev.EngineWokeUp) -> None:
        if self.state.sleep_level is not None:
            self._partial = (seq, e)
            return
        if self._resumed is not None:  # the window closed with no step in it
            self._report_resume(self._resumed, f"the engine was awake again (event {seq})")
        self._partial = None

    def _woken(self) -> str:
        """The wake-up that left the KV cache asleep, for a message."""
        if self._partial is None:
            slept = self._sleep[1].step if self._sleep is not None else "?"
            return f"nothing was woken since the sleep of step {slept}"
        seq, e = self._partial
        assert isinstance(e, ev.EngineWokeUp)
        what = " and ".join(_MEMORY.get(t, t) for t in e.tags or ())
        woke = f"only {what}" if what else "nothing"
        return f"the wake-up of step {e.step} (event {seq}) woke {woke}"

    def _resume(self, seq: int, e: ev.GenerationResumed) -> None:
        asleep = set(self.state.sleeping_tags)
        if not asleep or asleep == set(ev.MEMORY_TAGS):
            return  # awake, nothing released (level 0) or nothing woken: the reducer's rule
        self._resumed = (seq, e)
        if not resumes_on_partial_wake(self.state):  # the reducer refuses it: stop here
            self._report_resume(self._resumed, "")

    def _report_resume(self, resumed: Item, closed: str) -> None:
        self._resumed = None
        seq, e = resumed
        state = self.state
        asleep = " and ".join(_MEMORY.get(t, t) for t in state.sleeping_tags)
        after = (
            f"; no step was scheduled before {closed}, but any request that arrived would have "
            "run on the released memory (vLLM's data-parallel ranks run a dummy batch at once)"
            if closed
            else ""
        )
        self.ctx.report(
            "step_on_sleeping_kv_cache",
            "error",
            [r.req_id for r in state.unfinished][:16],
            e.step,
            f"generation resumed in step {e.step} while the engine still sleeps ({asleep} "
            f"released): {self._woken()}, and resuming lets the scheduler run steps on memory "
            f"that is not back{after}",
            [self._partial, resumed],
            _BUG_44395,
            seq,
            key=f"resume@{seq}",
            per_request=False,
        )

    def _scheduled(self, seq: int, e: ev.StepScheduled) -> None:
        if not kv_cache_alone_asleep(self.state):
            return  # awake; or asleep through and through: the reducer's rule
        resumed, self._resumed = self._resumed, None  # this finding stands for the resume
        names = list(dict.fromkeys(x.req_id for x in e.entries))
        shown = ", ".join(map(repr, names[:8])) + (
            f" and {len(names) - 8} more" if len(names) > 8 else ""
        )
        resume = f", generation resumed anyway (event {resumed[0]})" if resumed else ""
        window = self._partial[0] if self._partial is not None else -1
        self.ctx.report(
            "step_on_sleeping_kv_cache",
            "error",
            names,
            e.step,
            f"step {e.step} (request(s) {shown}) was scheduled while the KV cache sleeps: "
            f"{self._woken()}{resume}, and the step runs on the KV cache the sleep released",
            [self._partial, resumed, (seq, e)],
            _BUG_44395,
            seq,
            key=f"window@{window}",
            per_request=False,
        )
