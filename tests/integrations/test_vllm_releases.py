"""The recorder on every kind of vLLM release it was taught (marker vllm): the seed bug,
recorded from the release that shipped it.

vLLM 0.20.0 (the reset's discard flag, before #42117), 0.24.0 (its counter, #42117), 0.26.0 (the
counter with #46066's guard), 0.33.0 and 0.34.0 (the newest) run as overlays on the vLLM venv
(benchmarks/setup_vllm_venv.sh makes them); 0.32.0 is the venv's own. Each runs vLLM's own
AsyncScheduler under tokentape.integrations.vllm.scheduler_driver with the same scenario spec, only
PYTHONPATH changing:
- the seed bug's scenario (two requests decoding, pause(keep, clear_cache), resume): on 0.20.0
  the postmortem names vLLM #42043 for both requests and `why` shows the dropped frame; on the
  others the tape is clean and every client got tokentape's stream;
- KV-pressure preemptions with steps in flight, a reset with a step in flight, then a pause:
  every release's tape verifies under its own discard semantics. On 0.20.0 the pause drops a
  token (#42043) and leaves a request hung one token short of its limit, which the tape shows;
- speculative decoding with resets in flight: #46066 and the token-unit counter on the releases
  before #48245, clean after.
And a release the recorder was not taught: the venv's vLLM under a version past the taught
ranges records by its code, says so on stderr and in the tape's header, and checks live."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(Path(__file__).parent)]

from baselines.locate import find_vllm  # noqa: E402
from baselines.vllm_releases import overlay_dir, recorder_missing, release_env  # noqa: E402
from vllm_scenarios import (  # noqa: E402
    SCHEDULER_DRIVER,
    async_scenario,
    partial_wake_scenario,
    pause_resume_scenario,
    run_tokentape,
    run_vllm,
    run_vllm_batch,
    spec_reset_scenario,
)

from tokentape.engine.model.loader import builtin_model, save_checkpoint  # noqa: E402
from tokentape.events import schema as ev  # noqa: E402
from tokentape.postmortem import postmortem  # noqa: E402
from tokentape.replay import diff, load_tape, verify  # noqa: E402

FOUND, WHERE = find_vllm()
VENV = Path(FOUND.python).parents[1] if FOUND is not None else None
RELEASES = ["0.20.0", "0.24.0", "0.26.0", None, "0.33.0", "0.34.0"]  # None: the venv's (0.32.0)
POLICIES = {
    "0.20.0": "vllm-flag",
    "0.24.0": "vllm-counter",
    "0.26.0": "vllm-counter-guarded",
    None: "deliver",
    "0.33.0": "deliver",
    "0.34.0": "deliver",
}
# What speculative decoding with resets in flight shows on each release before #48245: the
# finding kinds, each with the bug class it names.
SPEC_FINDINGS: dict[str | None, dict[str, set[str]]] = {
    "0.20.0": {"negative_count": {"vllm#46066"}},
    "0.24.0": {
        "negative_count": {"vllm#46066"},
        "fresh_frame_dropped": {"vllm#42117-spec-units"},
        "phantom_placeholders": {"vllm#42117-spec-units"},
    },
    "0.26.0": {
        "fresh_frame_dropped": {"vllm#42117-spec-units"},
        "phantom_placeholders": {"vllm#42117-spec-units"},
    },
}


def _skip_reason(version: str | None) -> str | None:
    overlays = [overlay_dir(VENV, version)] if VENV is not None and version is not None else []
    return recorder_missing(FOUND, WHERE, *overlays)


def _release(version: str | None) -> Any:
    reason = _skip_reason(version)
    return pytest.param(
        version,
        id=version or "venv",
        marks=pytest.mark.skipif(reason is not None, reason=reason or ""),
    )


pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-releases")


@pytest.fixture(scope="module")
def model(work: Path) -> str:
    return str(save_checkpoint(builtin_model("tiny", 0)[1], work / "tiny"))


SCENARIOS = {
    "pause": pause_resume_scenario,
    "async": async_scenario,
    "spec": spec_reset_scenario,
    "wake": partial_wake_scenario,
}


@pytest.fixture(scope="module")
def recorded(work: Path, model: str) -> Iterator[dict[str | None, Future[dict[str, Any]]]]:
    """Every release's three scenarios, one driver process per release (vLLM imported once),
    two releases at a time (the drivers are single-threaded; the machine may have 2 cores)."""
    assert FOUND is not None and VENV is not None
    python, venv = FOUND.python, VENV

    def batch(version: str | None) -> dict[str, Any]:
        specs = {f"{n}-{version or 'venv'}": make(model) for n, make in SCENARIOS.items()}
        env = release_env(venv, version)
        return run_vllm_batch(python, SCHEDULER_DRIVER, specs, work, env=env)

    with ThreadPoolExecutor(2) as pool:
        yield {v: pool.submit(batch, v) for v in RELEASES if _skip_reason(v) is None}


def _run(
    recorded: dict[str | None, Future[dict[str, Any]]], version: str | None, name: str
) -> dict[str, Any]:
    result: dict[str, Any] = recorded[version].result()[f"{name}-{version or 'venv'}"]
    tape = load_tape(result["tape"])
    assert tape.header.source == "vllm" and tape.header.discard_policy == POLICIES[version]
    assert tape.header.source_version == (version or FOUND.version)  # type: ignore[union-attr]
    return result


@pytest.mark.parametrize("version", [_release(v) for v in RELEASES])
def test_the_seed_bug_recorded_from_the_release_that_shipped_it(
    recorded: Any, work: Path, model: str, version: str | None
) -> None:
    spec = pause_resume_scenario(model)
    result = _run(recorded, version, "pause")
    tape = result["tape"]
    assert verify(tape).ok
    report = postmortem(tape)
    if version != "0.20.0":
        assert report.findings == [], [f.message for f in report.findings]
        ours = work / f"pause-tokentape-{version or 'venv'}.tape"
        got = run_tokentape(spec, "oracle", ours)
        assert {r: o["tokens"] for r, o in result["outputs"].items()} == got
        d = diff(tape, ours)
        assert d.identical, d.format()
        return
    dropped = [f for f in report.findings if f.kind == "post_resume_token_dropped"]
    assert sorted(r for f in dropped for r in f.request_ids) == ["a", "b"]
    assert {f.bug_class for f in dropped} == {"vllm#42043"}
    # Each client lost the first token after the resume: its stream is the oracle's with that
    # token missing, and the run took one more step to deliver max_tokens.
    ours = run_tokentape(spec, "oracle", work / "pause-tokentape-0.20.0.tape")
    lost = {}
    for rid, out in result["outputs"].items():
        got = out["tokens"]
        lost[rid] = next(i for i, (a, b) in enumerate(zip(got, ours[rid])) if a != b)
        assert got[lost[rid] : -1] == ours[rid][lost[rid] + 1 :]  # every later token moved up
    why = subprocess.run(
        [sys.executable, "-m", "tokentape.cli", "why", tape, "a", str(lost["a"])],
        capture_output=True,
        text=True,
    )
    assert why.returncode == 0, why.stderr
    assert "the shift of vLLM #42043" in why.stdout and "dropped" in why.stdout


@pytest.mark.parametrize("version", [_release(v) for v in RELEASES])
def test_every_release_records_preemptions_with_steps_in_flight(
    recorded: Any, version: str | None
) -> None:
    result = _run(recorded, version, "async")
    checked = verify(result["tape"])
    assert checked.ok, checked.first_divergence.format() if checked.first_divergence else ""
    report = postmortem(result["tape"])
    kinds = {f.kind for f in report.findings}
    if version != "0.20.0":
        assert kinds == set() and result["hung"] == [], [f.message for f in report.findings]
        assert report.summary.tokens["dropped_stale"] > 0  # the reset's stale frames
        return
    # The pause at step 30 drains, then its reset's flag drops a fresh token per request; a
    # request that lost it one token before max_tokens is never scheduled again (vLLM's
    # placeholder guard counts the token that never came): vLLM 0.20.0 hangs on it.
    assert "post_resume_token_dropped" in kinds
    assert result["hung"], "the scenario no longer leaves a request hung on vLLM 0.20.0"
    phantom = [f for f in report.findings if f.kind == "phantom_placeholders"]
    assert sorted(r for f in phantom for r in f.request_ids) == result["hung"]
    assert all(f.severity == "error" and f.bug_class == "vllm#42043" for f in phantom)


@pytest.mark.parametrize("version", [_release(v) for v in RELEASES])
def test_speculative_decoding_with_resets_in_flight(recorded: Any, version: str | None) -> None:
    """Two drafts per step under async scheduling (the model accepts a seeded random number),
    resets of running requests with a step in flight. Every release's tape verifies under its
    own policy. Before #48245 the releases show the bugs of that code: a dropped stale frame's
    rejected drafts taken off the resumed request's placeholders (#46066, until 0.25 guarded
    it), and the counter set in tokens but drained per frame, which drops fresh frames (0.22 on)
    and leaves a request hung one token short. From #48245 on the tape is clean."""
    result = _run(recorded, version, "spec")
    checked = verify(result["tape"])
    assert checked.ok, checked.first_divergence.format() if checked.first_divergence else ""
    report = postmortem(result["tape"])
    steps = [e for _, e in load_tape(result["tape"]).events() if isinstance(e, ev.StepScheduled)]
    assert any(entry.num_spec_tokens == 2 for step in steps for entry in step.entries)
    expected = SPEC_FINDINGS.get(version)
    if expected is None:
        assert report.findings == [], [f.message for f in report.findings]
        assert report.summary.tokens["dropped_stale"] > 0
        return
    found: dict[str, set[str | None]] = {}
    for f in report.findings:
        if f.kind in ("negative_count", "fresh_frame_dropped", "phantom_placeholders"):
            found.setdefault(f.kind, set()).add(f.bug_class)
    assert found == expected, [f.message for f in report.findings]


@pytest.mark.parametrize("version", [_release(v) for v in RELEASES])
def test_an_rl_sleep_with_a_wake_up_of_the_weights_first(
    recorded: Any, work: Path, version: str | None
) -> None:
    """sleep(level=1, keep), wake_up(["weights"]), wake_up(["kv_cache"]) through each
    release's own EngineCore and Executor code: 0.20.0 resumes at the first wake-up and
    schedules onto the KV cache still asleep (#44395; the device fails on that step); the
    releases from #44483 on wait for the KV cache and give every client tokentape's stream."""
    result = _run(recorded, version, "wake")
    tape = result["tape"]
    assert verify(tape).ok
    report = postmortem(tape)
    if version == "0.20.0":
        assert load_tape(tape).config.faults == ["resume_on_partial_wake"]
        assert (result["error"] or "").startswith("DeviceFault: illegal memory access")
        kinds = {(f.kind, f.bug_class) for f in report.findings}
        assert ("step_on_sleeping_kv_cache", "vllm#44395") in kinds, kinds
        return
    assert report.findings == [] and result["error"] is None, [f.message for f in report.findings]
    slept = [e for _, e in load_tape(tape).events() if isinstance(e, ev.EngineSlept)]
    assert [(e.level, e.kept) for e in slept] == [(1, ["a", "b"])]
    name = f"wake-tokentape-{version or 'venv'}.tape"
    ours = run_tokentape(partial_wake_scenario(str(work / "tiny")), "oracle", work / name)
    assert {r: o["tokens"] for r, o in result["outputs"].items()} == ours


def test_a_release_the_recorder_was_not_taught_is_recorded_by_its_code(
    recorded: Any, work: Path, model: str
) -> None:
    """The next release, as the venv's vLLM under the version 0.35.0: its scheduler has
    #48245's preemption, so it is recorded under `deliver`, with the note on stderr and in
    the header, and the tape is the one a taught release gives."""
    reason = _skip_reason(None)
    if reason is not None:
        pytest.skip(reason)
    assert FOUND is not None and VENV is not None
    script = work / "untaught_driver.py"
    script.write_text(
        "import sys\nimport vllm\nvllm.__version__ = '0.35.0'\n"
        "from tokentape.integrations.vllm.scheduler_driver import main\nmain(sys.argv[1:])\n"
    )
    spec = pause_resume_scenario(model)
    result = run_vllm(FOUND.python, script, spec, work, "untaught", env=release_env(VENV, None))
    header = load_tape(result["tape"]).header
    assert (header.source_version, header.discard_policy) == ("0.35.0", "deliver")
    assert header.source_note.startswith("untaught release: vLLM 0.35.0 is outside")
    log = (work / "untaught.log").read_text()
    assert "tokentape recorder: untaught release: vLLM 0.35.0" in log
    assert verify(result["tape"]).ok
    assert postmortem(result["tape"]).findings == []
    taught = _run(recorded, None, "pause")
    assert result["outputs"] == taught["outputs"]
    shown = subprocess.run(
        [sys.executable, "-m", "tokentape.cli", "inspect", result["tape"]],
        capture_output=True,
        text=True,
    )
    assert "untaught release" in shown.stdout, shown.stdout + shown.stderr
