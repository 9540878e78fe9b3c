"""examples/rlhf_ray.py on a local Ray instance (2 CPUs, the tiny model, 2 engines): the loop
holds under the epoch policy with either weight sync, fails under `flag` as vLLM #42043 did,
and an engine killed with ray.kill leaves a tape that verifies and a fleet postmortem that
says where it ended. Skipped without Ray (the `ray` extra)."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("zmq")  # AsyncLLM's engine core (the serve extra)

from tokentape.cli import main as cli  # noqa: E402
from tokentape.events import schema as ev  # noqa: E402
from tokentape.postmortem.fleet import fleet_postmortem  # noqa: E402
from tokentape.replay import load_tape, verify  # noqa: E402

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    """The example's module, on a Ray instance shared by this file's tests. Its workers import
    the actors' module by name: examples/ goes on their PYTHONPATH."""
    import logging

    path = os.pathsep.join(p for p in (EXAMPLES, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    sys.path.insert(0, EXAMPLES)
    try:
        import rlhf_ray

        yield rlhf_ray
    finally:
        sys.path.remove(EXAMPLES)
        ray.shutdown()


def weight_updates(tape: Path) -> int:
    return sum(isinstance(e, ev.WeightsUpdated) for _, e in load_tape(tape).events())


def test_the_loop_holds_and_the_fleet_is_clean(
    example: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Weights by a torch.distributed broadcast (gloo); the object store in the tests below."""
    tapes = tmp_path / "tapes"
    argv = [
        "--engines",
        "2",
        "--iterations",
        "2",
        "--weight-sync",
        "broadcast",
        "--tape-dir",
        str(tapes),
    ]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("via broadcast: check held") == 2  # with requests paused mid-generation
    for i in range(2):
        tape = tapes / f"engine-{i}.tape"
        assert weight_updates(tape) == 2 and verify(tape).ok
    # The fleet postmortem as Ray tasks, on the Ray instance this process has.
    assert cli(["postmortem", str(tapes), "--ray", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["tapes"] == 2 and summary["errors"] == 0
    assert {e["ended"] for e in summary["engines"].values()} == {"complete"}
    assert ray.is_initialized()  # the instance it found is left running


def test_weights_through_a_worker_extension_and_a_lora_rollout_step(
    example: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As OpenRLHF and verl: the trainer's broadcast received in each engine's worker by the
    extension collective_rpc calls; then rollouts with the iteration's LoRA adapter."""
    tapes = tmp_path / "tapes"
    argv = ["--iterations", "1", "--weight-sync", "collective-rpc", "--tape-dir", str(tapes)]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "via collective-rpc: check held" in out
    assert "LoRA rollouts with lora-it0 on 2 engines: check held" in out
    for i in range(2):
        tape = tapes / f"engine-{i}.tape"
        events = [e for _, e in load_tape(tape).events()]
        rpcs = [e for e in events if isinstance(e, ev.CollectiveRPC)]
        assert [r.method for r in rpcs] == [
            "init_weight_update_group",
            "update_weights_from_trainer",
        ]
        assert rpcs[0].weights_id is None and rpcs[1].weights_id is not None
        assert [e.lora_name for e in events if isinstance(e, ev.LoRAAdded)] == ["policy-it0"]
        assert verify(tape).ok
    report = fleet_postmortem(tapes, jobs=1)
    assert report.summary.failed == 0 and all(not r.findings for r in report.tapes)


def test_the_flag_policy_fails_as_vllm_did(
    example: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tapes = tmp_path / "tapes"
    assert (
        example.main(["--iterations", "1", "--discard-policy", "flag", "--tape-dir", str(tapes)])
        == 1
    )
    out = capsys.readouterr().out
    # Each engine pauses once all its rollouts have tokens; the shorter ones may still end
    # first if the machine stalls the actor while its core runs on, but every engine must have
    # some paused mid-generation (the example says so otherwise), or nothing was tested.
    paused = re.search(r"8 requests \((\d+) paused mid-generation\)", out)
    assert paused and int(paused.group(1)) >= 2 and "no request was mid-generation" not in out, out
    assert "via object-store: CHECK FAILED" in out and "where a fresh engine gives" in out
    report = fleet_postmortem(tapes, jobs=1)
    assert report.summary.failed == 2
    for result in report.tapes:
        dropped = [f for f in result.findings if f.kind == "post_resume_token_dropped"]
        assert dropped and {f.bug_class for f in dropped} == {"vllm#42043"}


@pytest.mark.parametrize("how", ["ray.kill", "sigkill"])
def test_a_killed_engine_leaves_a_tape_that_says_where_it_ended(
    example: ModuleType, tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """ray.kill takes the engine core process with the actor: the tape stops mid-run. A SIGKILL
    of the actor's process alone (a crash, the OOM killer) leaves the core, which records it."""
    tapes = tmp_path / "tapes"
    argv = ["--iterations", "1", "--kill-engine", "1", "--kill-how", how, "--tape-dir", str(tapes)]
    assert example.main(argv) == 0  # the loop went on with engine 0, and its check held
    assert f"engine 1 killed ({how}) mid-rollout" in capsys.readouterr().out
    killed = tapes / "engine-1.tape"
    tape_files = sorted(p for p in os.listdir(tapes) if p.startswith("engine-"))
    assert tape_files == ["engine-0.tape", "engine-1.tape"]  # one file each, no -wal
    result = verify(killed)
    last_seq = len(load_tape(killed)) - 1
    assert result.ok and result.num_events == last_seq + 1  # it verifies up to its last step
    assert weight_updates(killed) == 0 and weight_updates(tapes / "engine-0.tape") == 1
    s = fleet_postmortem(tapes, jobs=2).summary
    row = s.engines["engine-1"]
    assert s.engines["engine-0"].ended == "complete" and row.last_seq == last_seq
    # How many rollouts a busy machine leaves unfinished when the kill lands varies; the report
    # must say what the tape holds (the requests unfinished where it ends), and at least one.
    unfinished = len(load_tape(killed).fold().unfinished)
    assert unfinished >= 1
    if how == "ray.kill":
        assert (row.ended, row.errors, s.errors) == ("truncated", 0, 0)
        assert row.where.startswith(
            f"stopped mid-run at event {last_seq} after step {row.last_step} was "
            f"scheduled, {unfinished} request(s) unfinished"
        )
    else:
        assert (row.ended, row.errors, s.errors) == ("engine_error", 1, 1)
        assert row.where.startswith(
            f"the engine failed at step {row.last_step + 1}: FrontendDied: "
        )
        assert f"{unfinished} request(s) unfinished" in row.where
