"""The sleep-mode events (EngineSlept, EngineWokeUp) on the tape: the reducer's rules (no step
while asleep; no frame after the memory went, vLLM #45520), their round trip through an SQLite
tape, and what the postmortem says of a tape that breaks the rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokentape import LLM, SamplingParams
from tokentape.events import schema as ev
from tokentape.events.fold_errors import ReducerError
from tokentape.events.reducer import evolve, initial_state
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.events.state import EngineState
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape, verify

PARAMS = ev.SamplingParams(max_tokens=10)


def apply(state: EngineState, *events: ev.Event) -> EngineState:
    for e in events:
        evolve(state, e)
    return state


def running() -> EngineState:
    """Request r prefilled in step 0, its frame back and its token delivered."""
    return apply(
        initial_state("epoch"),
        ev.RequestAdded(0, "r", [5, 6, 7], PARAMS),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 3, 0, [0])]),
        ev.FrameProduced(0, [ev.FrameEntry("r", [42])]),
        ev.OutputsEmitted(1, [ev.EmittedOutput("r", [42], False)]),
    )


def test_no_step_while_asleep_and_a_wake_up_tag_by_tag() -> None:
    s = apply(running(), ev.GenerationPaused(1, "keep", False), ev.EngineSlept(1, 1, [], ["r"]))
    assert s.sleep_level == 1 and s.sleeping_tags == ("weights", "kv_cache")
    with pytest.raises(ReducerError, match="while the engine sleeps"):
        evolve(s, ev.StepScheduled(1, [ev.ScheduledEntry("r", 0, 3, 1, 0, [])]))
    with pytest.raises(ReducerError, match="resumed in step 1 while the engine sleeps"):
        evolve(s, ev.GenerationResumed(1))
    apply(s, ev.EngineWokeUp(1, ["weights", "scheduling"]))
    assert s.sleep_level == 1 and s.sleeping_tags == ("kv_cache",)
    apply(s, ev.EngineWokeUp(1, None, "sha256:new"))  # the weights rebuilt (level 2's way)
    assert s.sleep_level is None and s.sleeping_tags == () and s.weights_id == "sha256:new"
    assert s.weight_version == "default"
    apply(s, ev.GenerationResumed(1), ev.StepScheduled(1, [ev.ScheduledEntry("r", 0, 3, 1, 0, [])]))
    assert s.step == 2


def test_level_0_sleeps_without_releasing_anything() -> None:
    s = apply(running(), ev.GenerationPaused(1, "keep", False), ev.EngineSlept(1, 0, [], ["r"]))
    assert s.sleep_level == 0 and s.sleeping_tags == ()
    apply(s, ev.EngineWokeUp(1, ["scheduling"]))
    assert s.sleep_level is None


def test_a_frame_after_the_memory_went_is_vllm_45520() -> None:
    """A recording of an engine that slept with a decode in flight: the fact is on the tape
    (EngineSlept lists the step), and the frame that comes back after it is refused."""
    s = apply(
        running(),
        ev.StepScheduled(1, [ev.ScheduledEntry("r", 0, 3, 1, 0, [])]),
        ev.GenerationPaused(2, "keep", False),
        ev.EngineSlept(2, 1, [1], ["r"]),
    )
    with pytest.raises(ReducerError, match="#45520"):
        evolve(s, ev.FrameProduced(1, [ev.FrameEntry("r", [43])]))


@pytest.mark.parametrize(
    "events,message",
    [
        ([ev.EngineSlept(1, 1, [], ["r"])], "without pausing first"),
        ([ev.GenerationPaused(1, "keep", False), ev.EngineSlept(1, 1, [], [])], "requests"),
        ([ev.GenerationPaused(1, "keep", False), ev.EngineSlept(1, 1, [0], ["r"])], "in flight"),
        ([ev.GenerationPaused(1, "keep", False), ev.EngineSlept(1, 3, [], ["r"])], "not one of"),
        (
            [
                ev.GenerationPaused(1, "keep", False),
                ev.EngineSlept(1, 1, [], ["r"]),
                ev.EngineSlept(1, 1, [], ["r"]),
            ],
            "asleep already",
        ),
        ([ev.EngineWokeUp(1, None)], "while awake"),
        (
            [
                ev.GenerationPaused(1, "keep", False),
                ev.EngineSlept(1, 1, [], ["r"]),
                ev.EngineWokeUp(1, ["gpu"]),
            ],
            "unknown tags",
        ),
    ],
)
def test_events_that_cannot_follow_are_refused(events: list[ev.Event], message: str) -> None:
    with pytest.raises(ReducerError, match=message):
        apply(running(), *events)


def sleepy_tape(path: Path) -> LLM:
    """An oracle run on an SQLite tape: a sleep with a step in flight, a request that arrives
    asleep, a wake-up in two calls."""
    llm = LLM(model="oracle", tape=str(path), block_size=4, num_kv_blocks=64, pipeline_depth=2)
    engine = llm.llm_engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=16))
    engine.step()
    engine.step()
    engine.sleep(level=2, mode="keep")
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=8))
    engine.wake_up(["kv_cache"])
    engine.wake_up(["weights"])
    while engine.has_unfinished_requests():
        engine.step()
    llm.close()
    return llm


def test_the_events_round_trip_through_an_sqlite_tape_that_verifies(tmp_path: Path) -> None:
    llm = sleepy_tape(tmp_path / "sleepy.tape")
    tape = load_tape(tmp_path / "sleepy.tape")
    assert tape.header.format_version == ev.FORMAT_VERSION >= 5  # format 5 added them
    recorded = [e for _, e in tape.events()]
    assert ev.EngineSlept(2, 2, [], ["a"]) in recorded
    woke = [e for e in recorded if isinstance(e, ev.EngineWokeUp)]
    assert woke == [ev.EngineWokeUp(2, ["kv_cache"]), ev.EngineWokeUp(2, ["weights"])]
    for event in recorded:
        assert ev.decode(ev.encode(event)) == event
    assert verify(tape).ok and tape.fold() == llm.llm_engine.engine_core.state
    assert postmortem(tape).findings == []


def test_a_step_while_asleep_is_a_postmortem_finding(tmp_path: Path) -> None:
    sleepy_tape(tmp_path / "sleepy.tape")
    tape = load_tape(tmp_path / "sleepy.tape")
    bad = SQLiteTape(tmp_path / "bad.tape", tape.header)
    for _, event in tape.events():  # never woken up: the steps that follow ran asleep
        if not isinstance(event, (ev.EngineWokeUp, ev.GenerationResumed)):
            bad.append(event)
    bad.close()
    report = postmortem(tmp_path / "bad.tape")
    assert [f.kind for f in report.findings] == ["tape_inconsistent"]
    assert "scheduled while the engine sleeps (level 2)" in report.findings[0].message
