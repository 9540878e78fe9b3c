"""The install switch between compiled (mypyc) and pure-Python core modules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_pure_install_removes_every_earlier_compiled_module(tmp_path: Path) -> None:
    # A copy of the source tree, with a compiled build of every core module beside its source
    # (as an editable compiled install leaves them); the pure build must remove all of them,
    # or they would shadow the source (kv_cache_manager's once survived, and every command
    # then failed with ModuleNotFoundError: ...__mypyc).
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(
        ROOT / "tokentape",
        tmp_path / "tokentape",
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    from tokentape.events._compiled import COMPILED_MODULES

    builds = [
        tmp_path / (m.replace(".", "/") + ".cpython-311-x86_64-linux-gnu.so")
        for m in COMPILED_MODULES
    ]
    builds.append(tmp_path / "0123abcd__mypyc.cpython-311-x86_64-linux-gnu.so")
    for so in builds:
        so.write_bytes(b"")
    env = {**os.environ, "TOKENTAPE_PURE_PYTHON": "1"}
    subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
    )
    assert [so.name for so in builds if so.exists()] == []
    assert (tmp_path / "tokentape/events/reducer.py").exists()
