"""The sleep races beyond their museum tapes (tests/tapes/parked_while_asleep_45268,
sleep_in_flight_45520 and partial_wake_44395): a frame that comes back after a sleep released
its memory, whether the engine woke up first or not, is named; so is a resume, or a step, on
a KV cache a wake-up of the weights alone left asleep, whether the tape's reducer accepts it or
not; and the default engine is held to none of these races."""

from __future__ import annotations

from pathlib import Path

import msgspec.structs
import pytest

from tokentape import LLM, SamplingParams
from tokentape.engine.runners.oracle_weights import oracle_state_dict
from tokentape.events import schema as ev
from tokentape.events.fold_errors import ReducerError
from tokentape.events.reducer import evolve
from tokentape.events.store import MemoryTape
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape
from tokentape.replay.verify import verify
from tokentape.replay.why import why

TAPES = Path(__file__).resolve().parents[1] / "tapes"
PROMPT = list(range(10, 30))


def _sleep_with_a_step_in_flight(faults: tuple[str, ...]) -> LLM:
    llm = LLM(model="oracle-random", tape=None, pipeline_depth=2, faults=faults)
    llm.llm_engine.add_request("a", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(4):
        llm.llm_engine.step()
    assert llm.llm_engine.engine_core.state.in_flight_steps
    llm.llm_engine.sleep(level=1, mode="keep")
    return llm


def test_a_frame_after_the_wake_up_of_a_step_in_flight_across_the_sleep() -> None:
    """Woken before the step was collected: the frame is applied (stale: dropped), yet the
    step ran across the release of its memory."""
    llm = _sleep_with_a_step_in_flight(("sleep_without_drain",))
    slept = llm.llm_engine.engine_core.state.in_flight_steps[0].step
    llm.llm_engine.wake_up()
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    tape = llm.llm_engine.engine_core.tape
    report = postmortem(tape)  # type: ignore[arg-type]
    llm.close()
    kinds = [(f.kind, f.bug_class) for f in report.findings]
    assert kinds == [("step_in_flight_across_sleep", "vllm#45520")] * 2, kinds
    assert f"the frame of step {slept}, scheduled before" in report.findings[1].message
    assert "came back to the engine awake again" in report.findings[1].message
    position = 3  # the output position the step in flight computed
    said = why(tape, "a", position)
    frame = next(x for x in said.chain if x.kind == "FrameProduced" and x.step == slept)
    assert "dropped as stale" in frame.detail and "ran across the release" in frame.detail
    assert f"Step {slept} was in flight when the engine fell asleep" in said.verdict


def test_a_frame_the_sleeping_engine_cannot_apply_is_named_once() -> None:
    """A tape whose frame comes back while the memory is released (the reducer refuses it):
    the checker's finding names it; no tape_inconsistent beside it."""
    fault = load_tape(TAPES / "sleep_in_flight_45520.tape")
    events = [e for _, e in fault.events()]
    cut = next(i for i, e in enumerate(events) if isinstance(e, ev.EngineSlept))
    llm = LLM(model="oracle-random", tape=None, pipeline_depth=2)  # step 3's frame, for real
    llm.llm_engine.add_request("a", PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    llm.llm_engine.add_request("b", PROMPT[:9], SamplingParams(max_tokens=16, ignore_eos=True))
    for _ in range(6):
        llm.llm_engine.step()
    frame = next(
        e
        for _, e in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(e, ev.FrameProduced) and e.step == 3
    )
    llm.close()
    tape = MemoryTape(fault.header)
    for e in [*events[: cut + 1], frame]:
        tape.append(e)
    report = postmortem(tape)
    assert [f.kind for f in report.findings] == ["step_in_flight_across_sleep"] * 2
    assert {f.bug_class for f in report.findings} == {"vllm#45520"}
    assert not report.summary.read_to_end  # the pass stops at the frame it cannot apply


def test_the_default_engine_drains_before_it_sleeps_and_serves_what_came_meanwhile() -> None:
    llm = _sleep_with_a_step_in_flight(())
    engine = llm.llm_engine
    slept = [e for _, e in engine.engine_core.tape.iter_events() if isinstance(e, ev.EngineSlept)]
    assert slept and slept[0].in_flight == []
    engine.add_request("late", PROMPT[:9], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.wake_up()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.engine_core.state.requests["late"].finish_reason == "length"
    report = postmortem(engine.engine_core.tape)  # type: ignore[arg-type]
    llm.close()
    assert report.findings == []


# -- vLLM #44395: a wake-up of the weights alone resumed scheduling ---------------------------


def _staged_wake(faults: tuple[str, ...]) -> LLM:
    """'a' runs; sleep(level=1, mode="keep"), then wake_up(["weights"]) as an RL trainer does
    before it updates the weights."""
    llm = LLM(model="oracle-random", tape=None, pipeline_depth=2, faults=faults)
    llm.llm_engine.add_request("a", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(4):
        llm.llm_engine.step()
    llm.llm_engine.sleep(level=1, mode="keep")
    llm.llm_engine.wake_up(["weights"])
    return llm


def test_the_default_engine_schedules_nothing_between_the_two_wake_ups() -> None:
    """sleep, wake_up(["weights"]), a weight update, wake_up(["kv_cache"]): a request added
    between the two wake-ups waits, however long the core's loop runs, and is served after
    the second; no finding."""
    llm = _staged_wake(())
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    engine.add_request("late", PROMPT[:9], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(3):
        engine.step()  # the core's loop: nothing may run on the released KV cache
    assert core.state.sleeping_tags == ("kv_cache",) and core.state.paused is not None
    engine.update_weights(oracle_state_dict(1), weight_version="step-1")
    engine.wake_up(["kv_cache"])
    while engine.has_unfinished_requests():
        engine.step()
    events = [e for _, e in core.tape.iter_events()]
    first, second = (i for i, e in enumerate(events) if isinstance(e, ev.EngineWokeUp))
    kinds = [ev.kind_of(e) for e in events[first + 1 : second]]
    assert kinds == ["RequestAdded", "WeightsUpdated"], kinds  # no resume, no step
    assert isinstance(events[second + 1], ev.GenerationResumed)  # once every tag is awake
    late = next(
        i
        for i, e in enumerate(events)
        if isinstance(e, ev.StepScheduled) and any(x.req_id == "late" for x in e.entries)
    )
    assert late > second
    assert core.state.requests["late"].finish_reason == "length"
    report = postmortem(core.tape)  # type: ignore[arg-type]
    llm.close()
    assert report.findings == [], [f.message for f in report.findings]


def _without_the_fault() -> MemoryTape:
    """The museum tape's events under its header without the fault."""
    fault = load_tape(TAPES / "partial_wake_44395.tape")
    config = {**fault.header.config, "faults": []}
    tape = MemoryTape(msgspec.structs.replace(fault.header, config=config))
    for _, e in fault.events():
        tape.append(e)
    return tape


def test_the_plain_reducer_refuses_the_resume_and_the_step() -> None:
    """The museum tape's events are what the buggy engine did: its reducer fault accepts
    them; the plain reducer refuses the resume on a partial wake-up, and a step while the KV
    cache sleeps."""
    tape = load_tape(TAPES / "partial_wake_44395.tape")
    events = [e for _, e in tape.events()]
    resume = max(i for i, e in enumerate(events) if isinstance(e, ev.GenerationResumed))
    step = next(i for i, e in enumerate(events) if isinstance(e, ev.StepScheduled) and i > resume)
    woke = events[resume - 1]  # the resume follows the wake-up of the weights alone
    assert isinstance(woke, ev.EngineWokeUp) and woke.tags == ["weights"]
    state = tape.fold()  # the fault's reducer: the engine died with the KV cache asleep
    assert state.sleeping_tags == ("kv_cache",) and state.paused is None
    plain = load_tape(_without_the_fault()).initial_state()
    assert not plain.faults
    for e in events[:resume]:
        evolve(plain, e)
    with pytest.raises(ReducerError, match="resumed in step .* while the engine sleeps"):
        evolve(plain, events[resume])
    with pytest.raises(ReducerError, match="scheduled while the engine sleeps"):
        evolve(plain, events[step])


def test_a_resume_on_a_partial_wake_is_named_where_the_plain_reducer_refuses_it() -> None:
    """The same events under a header without the fault (as another recorder might write
    them): the pass stops at the resume, the finding standing for it, no tape_inconsistent."""
    report = postmortem(_without_the_fault())
    assert [(f.kind, f.bug_class) for f in report.findings] == [
        ("step_on_sleeping_kv_cache", "vllm#44395")
    ], [f.message for f in report.findings]
    message = report.findings[0].message
    assert message.startswith("generation resumed in step 4 while the engine still sleeps")
    assert "the wake-up of step 4 (event 17) woke only the weights" in message
    assert report.findings[0].request_ids == ["a"]  # kept across the sleep, to be run
    assert not report.summary.read_to_end


def test_a_resume_on_a_partial_wake_with_nothing_to_run_is_named() -> None:
    """The fault resumes with no request waiting: nothing ran on the released KV cache before
    it woke, but the resume is the bug (anything that arrived would have run on it)."""
    llm = LLM(
        model="oracle-random", tape=None, pipeline_depth=2, faults=("resume_on_partial_wake",)
    )
    engine = llm.llm_engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.sleep(level=1)
    engine.wake_up(["weights"])
    engine.step()
    engine.wake_up(["kv_cache"])
    engine.add_request("b", PROMPT[:9], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    report = postmortem(engine.engine_core.tape)  # type: ignore[arg-type]
    llm.close()
    assert [(f.kind, f.bug_class) for f in report.findings] == [
        ("step_on_sleeping_kv_cache", "vllm#44395")
    ], [f.message for f in report.findings]
    assert "no step was scheduled before the engine was awake again" in report.findings[0].message
    assert [x.kind for x in report.findings[0].excerpt] == ["EngineWokeUp", "GenerationResumed"]


def test_the_partial_wake_tape_verifies_as_the_recording_failed() -> None:
    result = verify(TAPES / "partial_wake_44395.tape")
    assert result.ok and result.ended_with_error is not None
    assert "illegal memory access: step 4 writes the KV cache" in result.ended_with_error
