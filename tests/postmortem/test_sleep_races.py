"""The sleep races of issue 25 beyond their museum tapes (tests/tapes/parked_while_asleep_45268
and sleep_in_flight_45520): a frame that comes back after a sleep released its memory, whether
the engine woke up first or not, is named, and the default engine is held to neither race."""

from __future__ import annotations

from pathlib import Path

from tokentape import LLM, SamplingParams
from tokentape.events import schema as ev
from tokentape.events.store import MemoryTape
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape
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
