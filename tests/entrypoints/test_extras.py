"""Without the `serve` extra, `tokentape serve` and AsyncLLM's engine core process stop with
one line naming the extra to install (exit 2, no traceback). The extra's modules are made
missing for real: a sitecustomize in the child process puts a finder first on the import
path that refuses them, so `import uvicorn` fails as it does where it is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, os, sys

class _Missing(importlib.abc.MetaPathFinder):
    names = set(os.environ["BLOCKED_MODULES"].split(","))

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None

sys.meta_path.insert(0, _Missing())
"""


def run_without(tmp_path: Path, blocked: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {
        **os.environ,
        "BLOCKED_MODULES": blocked,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_the_blocker_makes_the_import_fail(tmp_path: Path) -> None:
    out = run_without(tmp_path, "uvicorn,zmq", ["-c", "import uvicorn"])
    assert out.returncode == 1 and "ModuleNotFoundError: No module named 'uvicorn'" in out.stderr


@pytest.mark.parametrize("missing", ["uvicorn", "fastapi", "zmq"])
def test_serve_names_the_extra_in_one_line(tmp_path: Path, missing: str) -> None:
    out = run_without(
        tmp_path, missing, ["-m", "tokentape.cli", "serve", "--model", "tiny", "--port", "0"]
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"error: tokentape serve needs the 'serve' extra ({missing} is not installed): "
        "pip install 'tokentape[serve]'"
    ]
    assert out.stdout == ""


def test_async_llm_names_the_extra_and_runs_in_process_without_it(tmp_path: Path) -> None:
    code = "from tokentape import AsyncLLM\nAsyncLLM('tiny', tape=False)\nprint('built')"
    out = run_without(tmp_path, "zmq", ["-c", code])
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.splitlines() == [
        "error: AsyncLLM's engine core process needs the 'serve' extra (zmq is not "
        "installed): pip install 'tokentape[serve]'"
    ]
    # Caught, it is a SystemExit like any other; in-process, AsyncLLM needs no ZMQ at all.
    code = (
        "import asyncio\n"
        "from tokentape import AsyncLLM, SamplingParams\n"
        "from tokentape.extras import MissingExtra\n"
        "try:\n"
        "    AsyncLLM('oracle', tape=False)\n"
        "except MissingExtra as exc:\n"
        "    print('caught', exc.code)\n"
        "engine = AsyncLLM('oracle', tape=False, multiprocess_mode=False)\n"
        "async def main():\n"
        "    async for out in engine.generate([5, 6], SamplingParams(max_tokens=3), 'r'):\n"
        "        last = out\n"
        "    print(len(last.outputs[0].token_ids))\n"
        "asyncio.run(main())\n"
        "engine.shutdown()\n"
    )
    out = run_without(tmp_path, "zmq,uvicorn,fastapi", ["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["caught", "2", "3"]
