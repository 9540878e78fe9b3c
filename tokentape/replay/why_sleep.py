"""`tokentape why` on a tape with sleeps (vLLM's sleep mode): what a sleep did to the request.

- Added while the engine slept and never scheduled after the wake-up: the sleep parked it
  (vLLM #45268; `tokentape postmortem`: request_parked_after_wake).
- A step of the request in flight when a sleep released the memory (level 1 or 2): its frame
  came back after the release, and an engine without its memory cannot apply it (vLLM #45520;
  step_in_flight_across_sleep). The request's own fold does not see the sleep, so the sleep
  joins the chain here, and the frame's link, if one came back, says what it ran across.
- A step of the request scheduled after a wake-up that woke the weights alone, the KV cache
  still released: generation resumed on a partial wake-up and the step ran on the released
  KV cache (vLLM #44395; step_on_sleeping_kv_cache). The wake-up joins the chain.

The sleep events are few: one query by kind on an SQLite tape; a tape without sleeps changes
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokentape.events import schema as ev
from tokentape.events.sqlite_reader import SQLiteTapeReader, open_readonly
from tokentape.events.store import decode_at
from tokentape.replay.tape import Tape
from tokentape.replay.why_explain import Link, WhyResult

if TYPE_CHECKING:
    from tokentape.replay.why_trace import RequestTracer

Item = tuple[int, ev.Event]
_KINDS = ("EngineSlept", "EngineWokeUp", "EngineError")


def _sleep_events(tape: Tape) -> list[Item]:
    if isinstance(tape.reader, SQLiteTapeReader) and tape.path is not None:
        conn = open_readonly(tape.path)
        try:
            rows = conn.execute(
                "SELECT seq, data FROM events WHERE kind IN (?, ?, ?) ORDER BY seq", _KINDS
            ).fetchall()
        finally:
            conn.close()
        return [(seq, decode_at(data, seq, tape.path)) for seq, data in rows]
    return [(s, e) for s, e in tape.events() if ev.kind_of(e) in _KINDS]


@dataclass(slots=True)
class SleepFacts:
    """What the tape's sleeps did to one request."""

    slept_at_add: ev.EngineSlept | None = None  # the sleep it was added during
    woke: Item | None = None  # the wake-up after it that left nothing asleep
    # step of the request in flight at a memory release -> that EngineSlept's (seq, event)
    across: dict[int, Item] = field(default_factory=dict)
    error: Item | None = None  # the engine's failure, if the tape records one
    # a wake-up that left the KV cache asleep (the weights awake) -> the seq its window ends
    kv_asleep: list[tuple[Item, int]] = field(default_factory=list)

    @classmethod
    def read(cls, tape: Tape, tracer: RequestTracer) -> SleepFacts | None:
        events = _sleep_events(tape)
        if not any(type(e) is ev.EngineSlept for _, e in events) or tracer.added is None:
            return None
        facts, added = cls(), tracer.added[0]
        asleep: ev.EngineSlept | None = None
        tags: set[str] = set()
        partial: Item | None = None  # the wake-up of the weights alone, the KV cache asleep
        for seq, e in events:
            if partial is not None and type(e) in (ev.EngineSlept, ev.EngineWokeUp):
                facts.kv_asleep.append((partial, seq))  # a sleep or wake-up ends its window
                partial = None
            if type(e) is ev.EngineSlept:
                asleep, tags = e, set(ev.MEMORY_TAGS if e.level else ())
                if e.level:
                    facts.across.update({s: (seq, e) for s in e.in_flight if s in tracer.frames})
            elif type(e) is ev.EngineWokeUp and asleep is not None:
                tags = set() if e.tags is None else tags - set(e.tags)
                if tags == {"kv_cache"}:
                    partial = (seq, e)
                if not tags:
                    asleep = None
                    if facts.slept_at_add is not None and facts.woke is None and seq > added:
                        facts.woke = (seq, e)
            elif type(e) is ev.EngineError:
                facts.error = (seq, e)
            if seq < added:
                facts.slept_at_add = asleep
        if partial is not None:
            facts.kv_asleep.append((partial, 1 << 62))
        return facts

    def parked_note(self, tracer: RequestTracer) -> str | None:
        """For a request never scheduled: whether a sleep parked it."""
        if self.slept_at_add is None or tracer.added is None:
            return None
        woke = (
            f", not even after the wake-up of step {self.woke[1].step} (event {self.woke[0]})"
            if self.woke is not None
            else ""
        )
        return (
            f"It was added in step {tracer.added[1].step} while the engine slept (level "
            f"{self.slept_at_add.level}) and was never scheduled{woke}: the sleep parked it "
            "(`tokentape postmortem` names it: request_parked_after_wake, vLLM #45268)."
        )

    def add_in_flight(self, tracer: RequestTracer, res: WhyResult) -> None:
        """The request's steps that compute the position and ran across a release of memory
        (the sleep joins the chain, the frame's link says so, and so does the verdict), or
        were scheduled on a KV cache still asleep (`_on_sleeping_kv_cache`)."""
        p = res.position
        steps = sorted(
            f.step
            for f in tracer.frames.values()
            if f.first is not None and f.first <= p < f.first + f.span
        )
        for step in steps:
            sleep = self.across.get(step)
            if sleep is None:
                continue
            seq, slept = sleep
            assert isinstance(slept, ev.EngineSlept)
            released = f"memory released with step(s) {slept.in_flight} in flight"
            res.chain.append(
                Link(seq, slept.step, "EngineSlept", "slept", f"level {slept.level}: {released}")
            )
            for link in res.chain:
                if link.kind == "FrameProduced" and link.step == step:
                    link.detail += f"; the step ran across the release of its memory (event {seq})"
            failed = self._failed_after(seq)
            res.verdict += (
                f" Step {step} was in flight when the engine fell asleep in step {slept.step} "
                f"(event {seq}, level {slept.level}): the sleep did not drain it and released "
                f"the memory it ran on{failed} (step_in_flight_across_sleep, vLLM #45520)."
            )
        for step in steps:
            self._on_sleeping_kv_cache(tracer.frames[step].sched_seq, step, res)
        res.chain.sort(key=lambda x: x.seq)

    def _failed_after(self, seq: int) -> str:
        if self.error is None or self.error[0] <= seq:
            return ""
        err = self.error[1]
        assert isinstance(err, ev.EngineError)
        return f"; the engine failed on it (event {self.error[0]}: {err.error_type})"

    def _on_sleeping_kv_cache(self, sched_seq: int, step: int, res: WhyResult) -> None:
        """The step was scheduled after a wake-up of the weights alone, before the KV cache
        woke: the wake-up joins the chain, and the verdict says what the step ran on."""
        for (seq, woke), end in self.kv_asleep:
            if not seq < sched_seq < end:
                continue
            res.chain.append(
                Link(seq, woke.step, "EngineWokeUp", "woke", "weights only: the KV cache asleep")
            )
            res.verdict += (
                f" Step {step} was scheduled while the KV cache slept: the wake-up of step "
                f"{woke.step} (event {seq}) woke only the weights, generation resumed anyway, "
                f"and the step ran on the KV cache the sleep released{self._failed_after(seq)} "
                "(step_on_sleeping_kv_cache, vLLM #44395)."
            )
            return
