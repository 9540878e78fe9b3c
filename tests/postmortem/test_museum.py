"""The museum: every later bug of the family, reproduced on purpose by a museum policy or an
injected fault (tests/tapes/regenerate.py records each; test_postmortem.py holds each tape to
its findings), and here the same scenarios on the default engine, which must pass them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tokentape import LLM, SamplingParams
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.core.scheduler import Scheduler
from tokentape.engine.fault_hooks import FaultInjectingEngineCore
from tokentape.events.discard import DISCARD_POLICIES, MUSEUM_POLICIES, get_policy
from tokentape.events.faults import FAULTS
from tokentape.events.reducer import initial_state
from tokentape.postmortem import postmortem
from tokentape.postmortem.findings import BUG_CLASSES
from tokentape.replay import load_tape
from tokentape.replay.verify import verify

TAPES = Path(__file__).resolve().parents[1] / "tapes"
_spec = importlib.util.spec_from_file_location("regenerate", TAPES / "regenerate.py")
assert _spec is not None and _spec.loader is not None
regenerate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regenerate)

# tape name -> the upstream bug it shows (the table of issue 18, plus #26400 and #47900's
# older tape)
MUSEUM = {
    "flag_reset_only_38624": "vllm#38624",
    "spec_placeholder_input_40768": "vllm#40768",
    "counter_spec_budget_41190": "vllm#41190",
    "counter_reset_only_47900": "vllm#47900",
    "kv_pressure_in_flight": "vllm#47900",
    "late_stop_49860": "vllm#49860",
    "chunk_underflow_57562": "vllm#57562",
    "abort_final_step": "vllm#26400",
    "double_free_33377": "vllm#33377",
    "crash_aborted_52969": "vllm#52969",
    "prefix_cache_4018": "nemo-rl#4018",
    # Issue 25's newer members of the family.
    "spec_reset_46066": "vllm#46066",
    "omni_discard_one_5183": "vllm-omni#5183",
    "admission_stalled_53130": "vllm#53130",
    "duplicated_token_395": "tenstorrent-vllm#395",
    "reused_id_42492": "vllm#42492",
    "block_reused_45357": "vllm#45357",
    # The sleep races of issue 25.
    "parked_while_asleep_45268": "vllm#45268",
    "sleep_in_flight_45520": "vllm#45520",
    "partial_wake_44395": "vllm#44395",
}


@pytest.mark.parametrize("name", sorted(MUSEUM))
def test_the_tape_names_its_bug(name: str) -> None:
    report = postmortem(TAPES / f"{name}.tape")
    assert not report.ok
    assert {f.bug_class for f in report.findings if f.severity == "error"} == {MUSEUM[name]}
    assert MUSEUM[name] in BUG_CLASSES


@pytest.mark.parametrize("name", sorted(MUSEUM))
def test_the_default_engine_passes_the_same_scenario(name: str, tmp_path: Path) -> None:
    scenario, _ = regenerate.ZOO[name]
    scenario(tmp_path / "clean.tape", clean=True)
    tape = load_tape(tmp_path / "clean.tape")
    assert tape.header.discard_policy == "epoch" and tape.config.faults == []
    report = postmortem(tape)  # the oracle's streams, counts, blocks, schedule, outputs
    assert report.findings == [], [f.message for f in report.findings]
    state = tape.fold()
    assert state.requests and all(r.is_finished for r in state.requests.values())
    assert all(r.num_output_placeholders == 0 for r in state.requests.values())


def test_museum_policies_are_selectable_but_not_offered() -> None:
    assert not set(MUSEUM_POLICIES) & set(DISCARD_POLICIES)
    for name in MUSEUM_POLICIES:
        assert get_policy(name).name == name
        LLM(model="oracle", tape=None, discard_policy=name).close()


def test_faults_are_checked_recorded_and_absent_by_default(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        LLM(model="oracle", tape=None, faults=("nope",))
    with pytest.raises(TypeError, match="faults must be a list"):
        LLM(model="oracle", tape=None, faults="late_stop_after_drain")
    plain = LLM(model="oracle", tape=None)
    # Nothing installed on the default path: the plain core and scheduler, which have no hook
    # to call, no wrappers (the scheduler is compiled in a normal install, so nothing could be
    # set on it; interpreted, nothing is), and the reducer's own handlers.
    assert type(plain.llm_engine.engine_core) is EngineCore
    assert type(plain.llm_engine.engine_core.scheduler) is Scheduler
    assert not hasattr(plain.llm_engine.engine_core, "hooks")
    assert plain.llm_engine.engine_core.state.handlers is initial_state().handlers
    assert "preempt" not in getattr(plain.llm_engine.engine_core.scheduler, "__dict__", {})
    assert "pause_generation" not in vars(plain.llm_engine)
    assert not plain.llm_engine.engine_core.state.faults
    plain.close()
    llm = LLM(model="oracle", tape=str(tmp_path / "f.tape"), faults=list(FAULTS))
    assert llm.config.faults == list(FAULTS)
    assert type(llm.llm_engine.engine_core) is FaultInjectingEngineCore
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    llm.close()
    tape = load_tape(tmp_path / "f.tape")
    assert tape.config.faults == list(FAULTS)  # a replay installs them again
    assert tape.initial_state().faults == {
        "chunk_placeholder_underflow",
        "output_on_reused_id",
        "resume_on_partial_wake",
    }
    assert verify(tape).ok


def test_a_fault_crash_verifies_as_the_recording_failed() -> None:
    result = verify(TAPES / "crash_aborted_52969.tape")
    assert (
        result.ok and result.ended_with_error is not None and "KeyError" in result.ended_with_error
    )


def test_the_default_engine_refuses_a_request_id_used_before() -> None:
    """What makes #42492 impossible by default: an id is never added twice (the reducer
    keeps the request each step scheduled, whatever its id names later, besides)."""
    llm = LLM(model="oracle", tape=None, pipeline_depth=2)
    llm.llm_engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8))
    llm.llm_engine.step()
    llm.llm_engine.abort_request("a")
    with pytest.raises(ValueError, match="already in use"):
        llm.llm_engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8))
    llm.close()
