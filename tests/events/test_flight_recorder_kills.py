"""The flight recorder under SIGKILL, a few points of tools/flight_recorder_kills.py: an engine
writing a segmented tape with tiny segments under a random storm, killed at a random moment
(the engine itself, the open segment's tape writer, a closing segment's writer, the writer of
the next segment's file made ahead, and one drawn at random); every segment file must verify
alone, the directory and a run of its segments as one tape, and the postmortem find nothing
but the truncation or the engine's error. `python tools/flight_recorder_kills.py --points 50`
is the long run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "flight_recorder_kills.py"


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("flight_recorder_kills", _TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


@pytest.mark.parametrize(
    ("seed", "victim"),
    [*enumerate(tool.VICTIMS), (len(tool.VICTIMS), None)],
    ids=[*tool.VICTIMS, "random"],
)
def test_a_kill_leaves_segments_that_verify(seed: int, victim: str | None, tmp_path: Path) -> None:
    """One kill point: `victim` killed (None: one drawn at random), everything left checked."""
    failures = tool.run_kill_points(1, seed, tmp_path, victims=[victim] if victim else None)
    assert failures == [], "\n".join(failures)
