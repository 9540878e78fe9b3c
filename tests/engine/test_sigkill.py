"""The SIGKILL loop of the chaos suite, a few iterations: a real engine run in a child process,
killed at a random moment; once its tape writer has drained, the tape must be one
self-contained file that verifies. `python benchmarks/chaos_sigkill.py --iterations 100` is
the long run (docs/tape-format.md has its figures)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_sigkill.py"


@pytest.fixture(scope="module")
def chaos():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("chaos_sigkill", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("seed", "model", "max_kill_s"),
    [
        (1, "oracle", 0.6),
        (2, "oracle", 0.6),
        (3, "oracle", 0.6),
        (4, "tiny", 0.6),
    ],
)
def test_a_sigkilled_engine_leaves_one_file_that_verifies(
    chaos,
    seed: int,
    model: str,
    max_kill_s: float,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    it = chaos.run_iteration(tmp_path, seed, model, max_kill_s)
    assert it.ok, it.problem
    assert it.events >= it.flushed and it.events > 0


def test_the_check_fails_on_a_tape_left_in_wal_mode(chaos, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The loop's check can fail: a tape whose writer did not finish is caught."""
    import sqlite3

    from tokentape import LLM, SamplingParams
    from tokentape.events.sqlite_store import SQLiteTapeReader, tape_file_status
    from tokentape.replay import verify

    (tmp_path / "run").mkdir()
    tape = tmp_path / "run" / "run.tape"
    llm = LLM(model="oracle", tape=tape)
    llm.generate(["hello"], SamplingParams(max_tokens=8))
    llm.close()
    it = chaos.Iteration(seed=0, model="oracle", kill_after_s=0.0, ok=False)
    assert chaos._check(tape, it, SQLiteTapeReader, tape_file_status, verify) == ""
    (tmp_path / "run" / "run.tape-wal").write_bytes(b"")
    assert "beside the tape" in chaos._check(tape, it, SQLiteTapeReader, tape_file_status, verify)
    (tmp_path / "run" / "run.tape-wal").unlink()
    conn = sqlite3.connect(tape)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()  # the file stays in WAL mode, as when a writer did not finish
    assert "WAL mode" in chaos._check(tape, it, SQLiteTapeReader, tape_file_status, verify)
