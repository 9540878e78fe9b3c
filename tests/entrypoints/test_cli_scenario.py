"""`tokentape generate` scripts the RL loop's engine calls (--pause-at, --reset-at,
--abort-at), so the README's three commands record vLLM #42043 on the built-in model, name it
in the postmortem and stop on it in the debugger."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tokentape import LLM, SamplingParams, cli
from tokentape.engine.scenario import Abort, Pause, Reset, Scenario
from tokentape.events import schema as ev
from tokentape.replay import load_tape, verify


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def kinds(path: Path) -> list[str]:
    return [ev.kind_of(e) for _, e in load_tape(path).events()]


def test_the_readme_three_commands_record_name_and_open_vllm_42043(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bug = tmp_path / "bug.tape"
    rc, out, err = run(
        capsys,
        "generate",
        "--discard-policy",
        "flag",
        "--pipeline-depth",
        "2",
        "--pause-at",
        "4",
        "--tape",
        str(bug),
    )
    assert rc == 0, err
    assert err.strip().splitlines()[-1] == f"tape: {bug}"
    recorded = kinds(bug)
    assert recorded.count("GenerationPaused") == 1 and recorded.count("GenerationResumed") == 1
    assert "RequestPreempted" in recorded  # the reset of the pause preempted the running requests
    pause = next(e for _, e in load_tape(bug).events() if isinstance(e, ev.GenerationPaused))
    assert (pause.step, pause.mode, pause.clear_cache) == (4, "keep", True)
    assert verify(bug).ok

    rc, out, _ = run(capsys, "postmortem", str(bug))
    assert rc == 1
    assert "[error] post_resume_token_dropped" in out
    assert "  matches vLLM #42043: a preemption flag drops the first token after resume\n" in out

    monkeypatch.setattr("sys.stdin", io.StringIO("break discard > 0\ncontinue\nprint discard\n"))
    rc, out, err = run(capsys, "debug", str(bug))
    assert rc == 0 and err == ""
    assert "breakpoint 1 hit: when discard > 0 becomes true" in out
    assert "RequestPreempted" in out.split("breakpoint 1 hit", 1)[1].splitlines()[1]

    # The README's jq example has something to print, and the exact policy shows nothing wrong.
    rc, out, _ = run(capsys, "export", str(bug), "--format", "jsonl")
    assert any(json.loads(line)["kind"] == "RequestPreempted" for line in out.splitlines())
    good = tmp_path / "good.tape"
    rc, _, err = run(
        capsys, "generate", "--pipeline-depth", "2", "--pause-at", "4", "--tape", str(good)
    )
    assert rc == 0, err
    rc, out, _ = run(capsys, "postmortem", str(good))
    assert rc == 0 and "no findings" in out


def test_resets_aborts_and_pause_modes_are_made_at_their_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tape = tmp_path / "script.tape"
    rc, out, err = run(
        capsys,
        "generate",
        "a",
        "b",
        "c",
        "--model",
        "oracle",
        "--json",
        "--max-tokens",
        "12",
        "--reset-at",
        "3",
        "--abort-at",
        "5:1",
        "--pause-at",
        "7:wait",
        "--pause-at",
        "20:abort",
        "--tape",
        str(tape),
    )
    assert rc == 0, err
    records = {r["request_id"]: r for r in map(json.loads, out.splitlines())}
    assert records["1"]["finish_reason"] == "abort" and len(records["1"]["token_ids"]) < 12
    assert records["0"]["finish_reason"] == records["2"]["finish_reason"] == "length"
    events = [e for _, e in load_tape(tape).events()]
    reset = next(e for e in events if isinstance(e, ev.PrefixCacheReset))
    assert (reset.step, reset.reset_running_requests, reset.ok) == (3, True, True)
    abort = next(e for e in events if isinstance(e, ev.RequestAborted))
    assert (abort.step, abort.req_id) == (5, "1")
    pauses = [(e.step, e.mode) for e in events if isinstance(e, ev.GenerationPaused)]
    assert pauses == [(7, "wait")]  # the run ended before step 20
    assert "warning: no pause (abort) at step 20: the run ended after" in err
    assert verify(tape).ok


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--pause-at", "x"], "--pause-at: expected a step number, got 'x'"),
        (["--pause-at", "3:hold"], "MODE must be one of abort, wait, keep, got 'hold'"),
        (["--reset-at", "-1"], "--reset-at: the step must be >= 0, got -1"),
        (["--abort-at", "4"], "--abort-at 4: expected STEP:ID"),
    ],
)
def test_bad_scripted_calls_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    rc, out, err = run(
        capsys, "generate", "--model", "oracle", "--tape", str(tmp_path / "t.tape"), *argv
    )
    assert rc == 2 and fragment in err and out == ""
    assert not (tmp_path / "t.tape").exists()


def test_an_abort_of_an_unknown_request_is_refused_before_anything_is_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tape = tmp_path / "t.tape"
    rc, out, err = run(
        capsys, "generate", "a", "b", "--model", "oracle", "--abort-at", "3:7", "--tape", str(tape)
    )
    assert rc == 2 and out == ""
    assert err == "error: abort of request '7' at step 3: no such request (the requests are 0, 1)\n"
    assert not tape.exists()


def test_a_scenario_drives_llm_generate() -> None:
    llm = LLM(model="oracle", tape=None, pipeline_depth=3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    scenario = Scenario([Reset(2), Pause(4, "keep"), Abort(6, "0"), Pause(500)])
    outs = llm.generate([[5, 6, 7], [8, 9]], params, scenario=scenario)
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "length"]
    assert [c.describe() for c in scenario.pending] == ["pause (keep) at step 500"]
    # The untouched request gets the oracle's stream: the exact policy loses nothing.
    alone = LLM(model="oracle", tape=None).generate([[8, 9]], params)[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == alone
    with pytest.raises(ValueError, match="mode must be one of abort, wait, keep, got 'hold'"):
        Scenario([Pause(1, "hold")])
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        Scenario([Reset(-2)])
    with pytest.raises(ValueError, match=r"no such request \(the requests are 2\)"):
        llm.generate([[5]], params, scenario=Scenario([Abort(1, "x")]))
    assert "2" not in llm.llm_engine.engine_core.state.requests  # refused before anything was added


def test_the_overwrite_rule_for_odd_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory is never an output; a dangling link is an existing name (refused without
    --force, replaced with it)."""
    rc, _, err = run(capsys, "generate", "a", "--model", "oracle", "--tape", str(tmp_path))
    assert rc == 2 and "--tape names a directory" in err
    link = tmp_path / "link.tape"
    link.symlink_to(tmp_path / "nowhere.tape")
    rc, _, err = run(capsys, "generate", "a", "--model", "oracle", "--tape", str(link))
    assert rc == 2 and "the file exists; pass --force" in err
    rc, _, err = run(capsys, "generate", "a", "--model", "oracle", "--tape", str(link), "--force")
    assert rc == 0, err
    assert not link.is_symlink() and verify(link).ok
