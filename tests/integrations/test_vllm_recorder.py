"""vLLM recorded onto tapes by tokentape.integrations.vllm, end to end (marker vllm).

Runs where vLLM is reachable (benchmarks/baselines/locate.py: `$TOKENTAPE_VLLM_PYTHON`,
`.venv-vllm`, or an importable vllm) with tokentape installed in its Python
(benchmarks/setup_vllm_venv.sh does both), else skips and says why. vLLM runs in its own
Python (tests/integrations/vllm_scenarios.py): its CPU engine on the tiny model exported as
a checkpoint (sync scheduling: vLLM's CPU platform turns async off; ~2 minutes, most of it
compiling at start), and its scheduler, async and sync, driven as its engine core drives it
with tokentape's oracle as the model (~20 s each). Each tape must verify, have no finding,
hold what each vLLM client received, and diff identical with tokentape's run of the same
requests. tests/integrations/test_vllm_tapes.py checks tapes recorded the same way without vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(Path(__file__).parent)]

from baselines.locate import find_vllm  # noqa: E402
from baselines.vllm_releases import recorder_missing  # noqa: E402
from vllm_scenarios import (  # noqa: E402
    ENGINE_DRIVER,
    SCHEDULER_DRIVER,
    aborts_scenario,
    async_scenario,
    engine_scenario,
    run_tokentape,
    run_vllm,
)

from tokentape.engine.model.loader import builtin_model, save_checkpoint  # noqa: E402
from tokentape.events import schema as ev  # noqa: E402
from tokentape.postmortem import postmortem  # noqa: E402
from tokentape.replay import diff, load_tape, verify  # noqa: E402
from tokentape.replay.diff import client_streams  # noqa: E402

FOUND, WHERE = find_vllm()


REASON = recorder_missing(FOUND, WHERE)
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-recorder")


@pytest.fixture(scope="module")
def model(work: Path) -> str:
    return str(save_checkpoint(builtin_model("tiny", 0)[1], work / "tiny"))


def _vllm(
    driver: Path, spec: dict[str, Any], work: Path, name: str, tape: bool = True
) -> dict[str, Any]:
    assert FOUND is not None
    return run_vllm(FOUND.python, driver, spec, work, name, tape=tape)


def _checked(result: dict[str, Any]) -> list[ev.Event]:
    """The run's tape verifies, has no finding, is one finished file and holds exactly what
    each client received; its events."""
    path = Path(result["tape"])
    assert not path.with_name(path.name + "-wal").exists()  # the scheduler closed it
    tape = load_tape(path)
    assert (tape.header.source, tape.header.source_version) == ("vllm", FOUND.version)  # type: ignore[union-attr]
    checked = verify(tape)
    assert checked.ok, checked.first_divergence.format() if checked.first_divergence else ""
    report = postmortem(tape)
    assert report.findings == [] and report.summary.complete, [f.message for f in report.findings]
    streams = client_streams(tape)
    got = {rid: (s.token_ids, s.finish_reason) for rid, s in streams.items()}
    assert got == {rid: (o["tokens"], o["finish_reason"]) for rid, o in result["outputs"].items()}
    return [e for _, e in tape.events()]


def test_vllm_cpu_engine_with_preemptions_a_reset_and_a_pause(work: Path, model: str) -> None:
    spec = engine_scenario(model)
    result = _vllm(ENGINE_DRIVER, spec, work, "engine")
    assert result["config"]["scheduler_cls"].endswith("RecordingScheduler")
    events = _checked(result)
    reasons = {e.reason for e in events if isinstance(e, ev.RequestPreempted)}
    assert reasons == {"kv_pressure", "reset_prefix_cache"}
    assert [e.mode for e in events if isinstance(e, ev.GenerationPaused)] == ["keep"]
    ours = work / "engine-tokentape.tape"
    run_tokentape(spec, model, ours)
    d = diff(result["tape"], ours)
    assert d.identical, d.format()


def test_vllm_async_scheduler_delivers_and_drops_stale_output(work: Path, model: str) -> None:
    spec = async_scenario(model)
    result = _vllm(SCHEDULER_DRIVER, spec, work, "async")
    assert result["scheduler"] == "AsyncRecordingScheduler"
    events = _checked(result)
    assert any(
        isinstance(e, ev.RequestPreempted) and e.in_flight and e.reason == "kv_pressure"
        for e in events
    )
    assert any(
        isinstance(e, ev.RequestPreempted) and e.in_flight and e.reason == "reset_prefix_cache"
        for e in events
    )
    report = postmortem(result["tape"])
    assert report.summary.tokens["dropped_stale"] > 0
    ours = work / "async-tokentape.tape"
    run_tokentape(spec, "oracle", ours)
    d = diff(result["tape"], ours)
    assert d.identical, d.format()


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_vllm_scheduler_with_aborts_and_pauses(work: Path, model: str, asynchronous: bool) -> None:
    name = f"aborts-{'async' if asynchronous else 'sync'}"
    result = _vllm(SCHEDULER_DRIVER, aborts_scenario(model, asynchronous), work, name)
    assert result["scheduler"] == (
        "AsyncRecordingScheduler" if asynchronous else "SyncRecordingScheduler"
    )
    events = _checked(result)
    aborted = {e.req_id for e in events if isinstance(e, ev.RequestAborted)}
    assert "b1" in aborted and len(aborted) > 1  # the abort, and the pause that aborts the rest
    assert load_tape(result["tape"]).config.effective_pipeline_depth == (2 if asynchronous else 1)


def test_the_recorder_refuses_to_start_without_a_tape_path(work: Path, model: str) -> None:
    with pytest.raises(RuntimeError, match=r"set \$TOKENTAPE_TAPE to the path of the tape"):
        _vllm(SCHEDULER_DRIVER, aborts_scenario(model), work, "no-tape", tape=False)
    existing = work / "exists.tape"
    existing.write_bytes(b"")
    spec = {**aborts_scenario(model)}
    with pytest.raises(RuntimeError, match="a tape already exists here"):
        _vllm(SCHEDULER_DRIVER, spec, work, "exists")
