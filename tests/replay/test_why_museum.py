"""`tokentape why` on the museum tapes of issue 25: each names what its bug left at the
position (tests/tapes/regenerate.py records them; docs/postmortem.md, The museum)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokentape.replay.why import why

TAPES = Path(__file__).resolve().parents[1] / "tapes"

CASES = [
    # tape, request, output position, what the verdict must say
    ("reused_id_42492", "late", 0, "a stale output on a reused request id: vLLM #42492"),
    ("duplicated_token_395", "a", 5, "position 4 was delivered twice"),
    ("spec_reset_46066", "r", 5, "position 4 was delivered twice"),
    ("block_reused_45357", "b", 0, "KV block(s) [8] as already holding its first 4 tokens"),
    ("admission_stalled_53130", "h1", 0, "It was never scheduled: it waited from step 2"),
    ("omni_discard_one_5183", "r", 15, "1 fresh frame(s) dropped before it"),
    ("parked_while_asleep_45268", "late", 0, "while the engine slept (level 1) and was never"),
    ("sleep_in_flight_45520", "a", 3, "Step 3 was in flight when the engine fell asleep"),
    ("partial_wake_44395", "b", 0, "Step 4 was scheduled while the KV cache slept"),
]


@pytest.mark.parametrize(("name", "req", "position", "says"), CASES, ids=[c[0] for c in CASES])
def test_why_explains_the_museum_bug(name: str, req: str, position: int, says: str) -> None:
    result = why(TAPES / f"{name}.tape", req, position)
    assert says in result.format()


def test_why_on_a_reused_id_explains_the_new_request() -> None:
    result = why(TAPES / "reused_id_42492.tape", "late", 0)
    # The token at 0 is the old request's step's output, not the new request's own.
    assert result.step is not None and result.scheduled_for is None
    roles = [(x.role, x.kind) for x in result.chain]
    assert ("added", "RequestAdded") in roles
    assert any("for the earlier request 'late'" in x.detail for x in result.chain)


def test_why_names_the_sleep_races() -> None:
    parked = why(TAPES / "parked_while_asleep_45268.tape", "late", 0)
    assert "not even after the wake-up of step 5" in parked.format()
    assert "vLLM #45268" in parked.verdict and "admission_stalled" not in parked.verdict
    in_flight = why(TAPES / "sleep_in_flight_45520.tape", "a", 3)
    assert "the engine failed on it" in in_flight.verdict and "vLLM #45520" in in_flight.verdict
    roles = [(x.role, x.kind) for x in in_flight.chain]
    # The request's own fold does not see the sleep: it joins the chain; the frame never came.
    assert ("slept", "EngineSlept") in roles
    assert not any(kind == "FrameProduced" for _, kind in roles)


def test_why_names_the_step_on_the_sleeping_kv_cache() -> None:
    said = why(TAPES / "partial_wake_44395.tape", "a", 4)  # 'a' kept across the sleep
    assert "woke only the weights, generation resumed anyway" in said.verdict
    assert "the engine failed on it" in said.verdict and "vLLM #44395" in said.verdict
    roles = [(x.role, x.kind, x.step) for x in said.chain]
    # The wake-up of the weights alone joins the chain, before the step it let run.
    assert roles[-2:] == [("woke", "EngineWokeUp", 4), ("scheduled", "StepScheduled", 4)]
    assert not any(kind == "FrameProduced" for _, kind, _ in roles)  # it never came back
    before = why(TAPES / "partial_wake_44395.tape", "a", 1)  # served before the sleep
    assert "44395" not in before.verdict and all(x.role != "woke" for x in before.chain)
