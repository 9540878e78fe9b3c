"""`tokentape chaos --engine vllm`: seeded storms against vLLM's own scheduler, recorded, with
the oracle as the model (marker vllm; tokentape/chaos/vllm_storms.py).

Storms on vLLM 0.20.0 find the #42043 class (and, with sleeps, #44395) and storms on 0.24.0
the #46066 class within 60 seeds (each test stops at the first seed that does); a slice of
seeds on the releases that fixed them (the venv's 0.32.0, 0.33.0 and 0.34.0) finds nothing;
the release matrix names the first release with a class and the first without; a finding
shrinks to a spec of at most 4 requests, kept beside the original, whose tape `tokentape why`
reads to the step that broke; a run that hangs vLLM stops and is a finding with its tape; the
same seed on the same release replays the same run. One driver process per release, shared
by the tests (vLLM is imported once: ~10 s each on 2 cores); the seeds themselves take a
fraction of a second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(Path(__file__).parent)]

from baselines.locate import find_vllm as find_for_tests  # noqa: E402
from baselines.vllm_releases import overlay_dir, recorder_missing  # noqa: E402
from cli_run import assert_one_line_error, run  # noqa: E402

from tokentape.chaos.vllm_storms import (  # noqa: E402
    HANG,
    Signature,
    VLLMChaos,
    run_vllm_campaign,
    storm_spec,
)
from tokentape.events.sqlite_store import remove_tape_files  # noqa: E402
from tokentape.integrations.vllm.driver_process import FoundVLLM, find_vllm  # noqa: E402
from tokentape.postmortem import postmortem  # noqa: E402
from tokentape.replay import load_tape  # noqa: E402

FOUND, WHERE = find_for_tests()
VENV = Path(FOUND.python).parents[1] if FOUND is not None else None
WITHIN = 60  # seeds within which each release's storms must find its bug class
FIXED_SLICE = range(0, 20)  # seeds of the fixed releases run in CI


def _skip(version: str | None) -> pytest.MarkDecorator:
    folders = [overlay_dir(VENV, version)] if VENV is not None and version is not None else []
    reason = recorder_missing(FOUND, WHERE, *folders)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def found() -> FoundVLLM:
    assert FOUND is not None
    return find_vllm(FOUND.python)


@pytest.fixture(scope="module")
def chaos(
    found: FoundVLLM, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str | None, VLLMChaos]]:
    """One VLLMChaos (one driver process) per release, started when a test first asks."""
    opened: dict[str | None, VLLMChaos] = {}

    class Releases(dict[str | None, VLLMChaos]):
        def __missing__(self, release: str | None) -> VLLMChaos:
            out = tmp_path_factory.mktemp(f"chaos-{release or 'venv'}")
            opened[release] = self[release] = VLLMChaos(found, release, str(out), shrink=False)
            return opened[release]

    yield Releases()
    for c in opened.values():
        c.close()


def _first_seed_with(c: VLLMChaos, bug_class: str) -> int:
    for seed in range(WITHIN):
        outcome = c.run_seed(seed)
        if bug_class in outcome.bug_classes:
            # What the campaign kept is a real tape whose postmortem names the class.
            assert outcome.tape is not None and outcome.spec is not None
            classes = {f.bug_class for f in postmortem(outcome.tape).findings}
            assert bug_class in classes
            return seed
    pytest.fail(f"no storm on vLLM {c.release_name} found {bug_class} within {WITHIN} seeds")


@_skip("0.20.0")
def test_storms_on_0_20_0_find_the_42043_class(chaos: dict[str | None, VLLMChaos]) -> None:
    assert _first_seed_with(chaos["0.20.0"], "vllm#42043") < WITHIN


@_skip("0.20.0")
def test_storms_with_sleeps_on_0_20_0_find_the_44395_class(
    chaos: dict[str | None, VLLMChaos],
) -> None:
    """A wake-up of the weights alone, in the storms' RL order, resumes scheduling on 0.20."""
    assert _first_seed_with(chaos["0.20.0"], "vllm#44395") < WITHIN


@_skip("0.24.0")
def test_storms_on_0_24_0_find_the_46066_class(chaos: dict[str | None, VLLMChaos]) -> None:
    assert _first_seed_with(chaos["0.24.0"], "vllm#46066") < WITHIN


@pytest.mark.parametrize(
    "release",
    [
        pytest.param(None, id="venv", marks=_skip(None)),
        pytest.param("0.33.0", marks=_skip("0.33.0")),
        pytest.param("0.34.0", marks=_skip("0.34.0")),
    ],
)
def test_storms_on_a_fixed_release_find_nothing(
    chaos: dict[str | None, VLLMChaos], release: str | None
) -> None:
    c = chaos[release]
    steps = 0
    for seed in FIXED_SLICE:
        outcome = c.run_seed(seed)
        assert not outcome.has_finding, (seed, outcome.primary, outcome.report)
        steps += outcome.scheduled_steps
    assert steps > 50 * len(FIXED_SLICE)  # the storms did run the scheduler


@_skip("0.20.0")
def test_a_storm_that_hangs_vllm_stops_and_is_a_finding_with_its_tape(
    chaos: dict[str | None, VLLMChaos],
) -> None:
    """#42043's hang, as a shrink reached it: one request, pause(keep, clear_cache) at step 1.
    The dropped token's placeholder never comes back and vLLM's async max_tokens guard counts
    it: the request is never scheduled again. The driver stops after its idle-step limit."""
    c = chaos["0.20.0"]
    spec = {
        "async": True,
        "num_speculative_tokens": 0,
        "num_blocks": 24,
        "block_size": 16,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "max_model_len": 256,
        "seed": 27,
        "requests": [{"id": "r5", "prompt": [133], "max_tokens": 2, "add_at": 0}],
        "pause_at": [[1, "keep", True]],
    }
    tape = os.path.join(c.out_dir, "hang.tape")
    start = time.perf_counter()
    checked = c.run_spec(spec, tape)
    assert time.perf_counter() - start < 30
    assert checked.result["stopped"] == "idle" and checked.result["hung"] == ["r5"]
    assert Signature(HANG) in checked.signatures
    assert Signature("post_resume_token_dropped", "vllm#42043") == checked.primary
    kinds = {f.kind for f in postmortem(tape).findings}
    assert {"phantom_placeholders", "post_resume_token_dropped"} <= kinds


@_skip("0.20.0")
def test_the_same_seed_on_the_same_release_replays_the_same_run(
    chaos: dict[str | None, VLLMChaos],
) -> None:
    c = chaos["0.20.0"]
    runs = []
    for n in range(2):
        tape = os.path.join(c.out_dir, f"again{n}.tape")
        checked = c.run_spec(storm_spec(3), tape)
        runs.append(([e for _, e in load_tape(tape).events()], checked.signatures))
        remove_tape_files(tape)
    assert runs[0] == runs[1] and len(runs[0][0]) > 50


@_skip("0.20.0")
def test_a_campaign_with_two_jobs_gives_each_seed_its_own_run(
    chaos: dict[str | None, VLLMChaos], found: FoundVLLM, tmp_path: Path
) -> None:
    seeds = range(5, 9)
    summary = run_vllm_campaign(seeds, found, "0.20.0", str(tmp_path), jobs=2, shrink=False)
    assert summary.num_seeds == 4 and summary.jobs == 2
    alone = [chaos["0.20.0"].run_seed(seed) for seed in seeds]
    kept = {o.seed: o for o in summary.found}
    for o in alone:  # the same findings, seed by seed, as one driver running them in turn
        assert (kept[o.seed].finding_kinds if o.seed in kept else {}) == o.finding_kinds
    assert summary.steps == sum(o.steps for o in alone)


@_skip("0.20.0")
def test_a_finding_shrinks_to_a_small_spec_whose_tape_shows_the_step_that_broke(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    start = time.perf_counter()
    # Seeds 8 and 9: #42043's dropped token among 11 requests, and vLLM's own assert on the
    # placeholders going below zero (#46066's class) among 5.
    rc, stdout, _ = run(
        capsys, "chaos", "--engine", "vllm", "--vllm-release", "0.20.0", "--seeds", "2",
        "--first-seed", "8", "--out", str(out), "--json",
    )  # fmt: skip
    assert rc == 1
    record = json.loads(stdout)
    assert record["vllm_release"] == "0.20.0" and record["runs_with_findings"] == 2
    assert json.loads((out / "chaos.json").read_text())["seeds"] == 2
    for found in record["found"]:
        shrunk = found["shrunk"]
        assert shrunk is not None and shrunk["seconds"] < 60
        spec = json.loads(Path(shrunk["spec"]).read_text())  # what the driver reads
        assert 1 <= len(spec["requests"]) <= 4 and shrunk["requests"] == len(spec["requests"])
        assert len(spec["requests"]) <= found["num_requests"]
        assert Path(found["spec"]).exists() and Path(found["tape"]).exists()
        # The minimal tape gives the original's first finding, and `why` reads to its step.
        report = postmortem(shrunk["tape"])
        first = next(f for f in report.findings if f.severity == "error")
        rid, position = shrunk["why"]
        why = subprocess.run(
            [sys.executable, "-m", "tokentape.cli", "why", shrunk["tape"], rid, str(position)],
            capture_output=True,
            text=True,
        )
        assert why.returncode == 0, why.stderr
        assert f"step {first.steps[0]}" in why.stdout, (first, why.stdout)
    assert time.perf_counter() - start < 180


@_skip(None)
def test_a_release_without_an_overlay_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert FOUND is not None
    monkeypatch.setenv("TOKENTAPE_VLLM_PYTHON", FOUND.python)
    out = str(tmp_path / "out")
    rc, _, err = run(capsys, "chaos", "--engine", "vllm", "--vllm-release", "0.99.0",
                     "--seeds", "1", "--out", out)  # fmt: skip
    assert_one_line_error(rc, err, "vLLM 0.99.0", "setup_vllm_venv.sh")
    rc, _, err = run(capsys, "chaos", "--engine", "vllm", "--vllm-release", "x.y",
                     "--seeds", "1", "--out", out)  # fmt: skip
    assert_one_line_error(rc, err, "not a vLLM version")
    assert not os.path.exists(out)


@_skip("0.20.0")
def test_the_release_matrix_names_where_a_class_starts_and_stops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seed 5 on 0.20.0 (which shipped #42043) and on the venv's release (which fixed it):
    the matrix says 0.20.0 has the class and the venv's release is the first without it,
    in its table and in DIR/matrix.json, beside each release's own campaign."""
    assert FOUND is not None
    monkeypatch.setenv("TOKENTAPE_VLLM_PYTHON", FOUND.python)
    venv = FOUND.version.split("+")[0]
    out = tmp_path / "matrix"
    rc, stdout, _ = run(capsys, "chaos", "--engine", "vllm", "--vllm-releases",
                        f"{venv},0.20.0", "--first-seed", "5", "--seeds", "1", "--no-shrink",
                        "--out", str(out))  # fmt: skip
    assert rc == 1  # 0.20.0 has findings
    matrix = json.loads((out / "matrix.json").read_text())
    assert matrix["releases"] == ["0.20.0", venv]  # in version order, whatever the order asked
    row = next(c for c in matrix["classes"] if c["class"] == "vllm#42043")
    assert (row["first_with"], row["first_without"]) == ("0.20.0", venv)
    assert row["seeds"] == {"0.20.0": 1, venv: 0} and row["first_seed"] == {"0.20.0": 5}
    assert all(c["first_with"] == "0.20.0" for c in matrix["classes"])
    line = next(ln for ln in stdout.splitlines() if ln.startswith("vllm#42043"))
    assert line.split()[-2:] == ["0.20.0", venv]
    for release in ("0.20.0", venv):
        assert json.loads((out / release / "chaos.json").read_text())["seeds"] == 1
    assert list((out / "0.20.0").glob("vllm-0.20.0-seed5.tape"))
    rc, _, err = run(capsys, "chaos", "--engine", "vllm", "--vllm-releases", "0.20.0,0.99.0",
                     "--seeds", "1", "--out", str(tmp_path / "bad"))  # fmt: skip
    assert_one_line_error(rc, err, "vLLM 0.99.0", "setup_vllm_venv.sh")
    assert not (tmp_path / "bad").exists()  # refused before any seed ran
