"""tools/check_imports.py over the package: no module or package cycle, no import that runs
up the layers, no facade imported below the front ends; and the check does catch each kind
(on a small package made for it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "check_imports.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120
    )


def test_the_package_imports_only_point_down() -> None:
    result = run()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no cycle, no upward import" in result.stdout


def test_the_check_names_each_kind_of_bad_edge(tmp_path: Path) -> None:
    pkg = tmp_path / "tokentape"
    for d in ("events", "engine", "replay"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from tokentape.engine.llm import LLM\n")
    (pkg / "engine" / "llm.py").write_text("LLM = 1\n")
    # A cycle through a lazy import, an upward import, a facade imported below the front ends.
    (pkg / "engine" / "a.py").write_text("def f():\n    from tokentape.engine import b\n")
    (pkg / "engine" / "b.py").write_text("from tokentape.engine.a import f\n")
    (pkg / "events" / "state.py").write_text("from tokentape.replay import tape\n")
    (pkg / "replay" / "tape.py").write_text("")
    (pkg / "events" / "schema.py").write_text("from tokentape import LLM\n")
    (pkg / "engine" / "core.py").write_text("from tokentape.engine.llm import LLM\n")
    result = run(str(pkg))
    assert result.returncode == 1
    out = result.stdout
    assert "module cycle: tokentape.engine.a -> tokentape.engine.b" in out
    assert "upward import: tokentape.events.state -> tokentape.replay.tape" in out
    assert "upward import: tokentape.events.schema -> tokentape " in out
    assert "facade import: tokentape.engine.core -> tokentape.engine.llm" in out
