"""The style the project enforces, checked with the suite (so CI runs it): ruff's lint rules
and formatting (pyproject.toml, [tool.ruff]) over every Python file, and mypy over the event
core and the engine ([tool.mypy]). Both come with the test extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON_DIRS = ["tokentape", "tests", "benchmarks", "examples", "tools"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_finds_nothing() -> None:
    lint = run("ruff", "check", *PYTHON_DIRS)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    formatted = run("ruff", "format", "--check", *PYTHON_DIRS)
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr


def test_mypy_finds_nothing_in_the_events_and_the_engine() -> None:
    checked = run("mypy")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Success: no issues found" in checked.stdout
