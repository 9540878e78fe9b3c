"""vLLM's own CI, recorded (marker vllm): `pytest -p tokentape --tokentape-record-vllm DIR` in a
vLLM source tree, with vLLM's test files unchanged.

- vLLM 0.32.0's tests/v1/core/test_scheduler.py and test_async_scheduler.py give the same
  outcome for every test with the recorder on as without it, and every tape they leave (all
  kept, --tokentape-keep-all) verifies; a test that changes vLLM's state by hand gets a tape
  that ends where the recording lost track, and still passes.
- A scheduler test in vLLM's style that pauses (keep, clear_cache) and resumes under async
  scheduling (tests/integrations/vllm_ci/pause_keep_resume_case.py) fails on vLLM 0.20.0 as
  #42043 did; its kept tape's postmortem names the bug. On 0.32.0 it passes.

Runs where benchmarks/setup_vllm_venv.sh has made the venv with vLLM's tests and the 0.20.0
overlay beside it (about 4 minutes: vLLM's test files run twice); skips, saying why, elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks")]

from baselines.locate import find_vllm  # noqa: E402
from baselines.vllm_releases import (  # noqa: E402
    overlay_dir,
    pytest_plugin_flag,
    recorder_missing,
    release_env,
    vllm_tests_dir,
)

from tokentape.replay import load_tape, verify  # noqa: E402

FOUND, WHERE = find_vllm()
VENV = Path(FOUND.python).parents[1] if FOUND is not None else None
CASE = Path(__file__).parent / "vllm_ci" / "pause_keep_resume_case.py"
VLLM_TESTS = ["tests/v1/core/test_scheduler.py", "tests/v1/core/test_async_scheduler.py"]


def _skip_reason() -> str | None:
    if FOUND is None or VENV is None:
        return WHERE
    return recorder_missing(
        FOUND,
        WHERE,
        vllm_tests_dir(VENV, FOUND.version),
        vllm_tests_dir(VENV, "0.20.0"),
        overlay_dir(VENV, "0.20.0"),
    )


REASON = _skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def _plugin_flag() -> str:
    assert FOUND is not None
    return pytest_plugin_flag(FOUND.python)


def _start_pytest(
    version: str, tree: Path, args: list[str], overlay: bool, log: Path
) -> subprocess.Popen[bytes]:
    """vLLM's pytest in a vLLM tests tree (`version` as an overlay when `overlay`), its output
    to `log`."""
    assert FOUND is not None and VENV is not None
    env = {**os.environ, **release_env(VENV, version if overlay else None)}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [FOUND.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
            cwd=tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _pytest(version: str, tree: Path, args: list[str], overlay: bool, log: Path) -> tuple[int, str]:
    proc = _start_pytest(version, tree, args, overlay, log)
    return proc.wait(timeout=1500), log.read_text(errors="replace")


def _outcomes(junit: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        out[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return out


def test_vllm_scheduler_tests_pass_as_without_the_recorder_and_every_tape_verifies(
    tmp_path: Path,
) -> None:
    assert FOUND is not None and VENV is not None
    tree = vllm_tests_dir(VENV, FOUND.version)
    tapes = tmp_path / "tapes"
    # Both at once, one core each (the test files run single-threaded): the outcomes are
    # compared; benchmarks/bench_vllm_ci_recording.py measures what recording costs.
    plain = _start_pytest(
        FOUND.version,
        tree,
        [*VLLM_TESTS, f"--junitxml={tmp_path / 'plain.xml'}"],
        False,
        tmp_path / "plain.log",
    )
    recorded = _start_pytest(
        FOUND.version,
        tree,
        [
            *VLLM_TESTS,
            f"--junitxml={tmp_path / 'recorded.xml'}",
            "-p",
            _plugin_flag(),
            "--tokentape-record-vllm",
            str(tapes),
            "--tokentape-keep-all",
        ],
        False,
        tmp_path / "recorded.log",
    )
    plain.wait(timeout=1500)
    recorded.wait(timeout=1500)
    output = (tmp_path / "recorded.log").read_text(errors="replace")
    assert "scheduler(s) recorded" in output, output[-3000:]
    plain_outcomes, recorded_outcomes = (
        _outcomes(tmp_path / "plain.xml"),
        _outcomes(tmp_path / "recorded.xml"),
    )
    assert len(plain_outcomes) > 200 and recorded_outcomes == plain_outcomes
    assert sum(o == "passed" for o in plain_outcomes.values()) > 150
    kept = sorted(tapes.glob("*.tape"))
    assert len(kept) > 100
    stopped = 0
    for path in kept:
        tape = load_tape(path)
        assert tape.header.source == "vllm"
        result = verify(tape)
        assert result.ok, (
            f"{path.name}: {result.first_divergence.format() if result.first_divergence else ''}"
        )
        stopped += result.recording_stopped is not None
    assert stopped < len(kept) // 4  # most of vLLM's tests stay within what a tape describes


@pytest.mark.parametrize("version", ["0.20.0", "venv"])
def test_a_vllm_test_that_pauses_fails_on_0_20_0_as_42043_did_and_its_tape_names_the_bug(
    tmp_path: Path, version: str
) -> None:
    assert FOUND is not None and VENV is not None
    release = "0.20.0" if version == "0.20.0" else FOUND.version
    tree = tmp_path / "vllm"
    shutil.copytree(vllm_tests_dir(VENV, release), tree, ignore=shutil.ignore_patterns(".complete"))
    shutil.copyfile(CASE, tree / "tests" / "v1" / "core" / "test_tokentape_pause_keep_resume.py")
    tapes = tmp_path / "tapes"
    returncode, output = _pytest(
        release,
        tree,
        [
            "tests/v1/core/test_tokentape_pause_keep_resume.py",
            f"--junitxml={tmp_path / 'junit.xml'}",
            "-p",
            _plugin_flag(),
            "--tokentape-record-vllm",
            str(tapes),
        ],
        version == "0.20.0",
        tmp_path / "pytest.log",
    )
    outcomes = _outcomes(tmp_path / "junit.xml")
    assert len(outcomes) == 2, output[-3000:]
    if version != "0.20.0":
        assert returncode == 0 and set(outcomes.values()) == {"passed"}
        assert not tapes.exists() or not list(tapes.glob("*.tape"))  # only failing tests' tapes
        return
    assert returncode == 1 and set(outcomes.values()) == {"failure"}
    reports = sorted(tapes.glob("*.txt"))
    assert len(reports) == 2 and len(list(tapes.glob("*.html"))) == 2
    for report in reports:
        text = report.read_text()
        assert "post_resume_token_dropped" in text and "matches vLLM #42043" in text
        assert verify(report.with_suffix(".tape")).ok
    assert "matches vLLM #42043" in output  # the terminal summary names it too
    junit = (tmp_path / "junit.xml").read_text()
    assert "tokentape_tape" in junit and "tokentape_report" in junit
