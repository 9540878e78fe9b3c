"""diff on known pairs of recorded tapes, and what-if replay of the recorded commands."""

from __future__ import annotations

from pathlib import Path

import pytest
from tape_scenarios import busy, double_reset, pause_resume

from tokentape import LLM, SamplingParams, cli
from tokentape.events import schema as ev
from tokentape.replay import AlignmentError, WhatIfError, diff, load_tape, verify, whatif
from tokentape.replay.diff import client_streams
from tokentape.replay.whatif import recorded_commands


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# -- diff --------------------------------------------------------------------------------------


def test_the_same_run_twice_is_identical() -> None:
    result = diff(pause_resume("epoch"), pause_resume("epoch"))
    assert result.identical and result.first is None and result.num_requests == 2
    assert result.format().startswith("identical: 2 requests")


def test_flag_against_epoch_is_shifted_by_one_token() -> None:
    epoch, flag = pause_resume("epoch"), pause_resume("flag")
    result = diff(epoch, flag)
    assert not result.identical and len(result.divergences) == 2  # both requests lost a token
    first = result.first
    assert first is not None and first.req_id == "r" and first.what == "token"
    a, b = (
        client_streams(load_tape(epoch))["r"].token_ids,
        client_streams(load_tape(flag))["r"].token_ids,
    )
    p = first.position
    assert a[:p] == b[:p] and b[p : len(a) - 1] == a[p + 1 :]
    assert first.a_token == a[p] and first.b_token == b[p]
    assert (
        "B's stream from position" in first.explanation and "moved up by one" in first.explanation
    )
    # The context shows the resume before the divergence, on both tapes.
    for context, seq in ((result.a_context, first.a_seq), (result.b_context, first.b_seq)):
        kinds = [ev.kind_of(e) for _, e in context]
        assert "GenerationResumed" in kinds and seq in [s for s, _ in context]


def test_counter_double_reset_applies_a_stale_token() -> None:
    result = diff(double_reset("epoch"), double_reset("counter"))
    first = result.first
    assert first is not None and first.what == "token"
    assert "B repeats the token before position" in first.explanation
    assert "stale token was applied" in first.explanation


def test_tapes_of_different_requests_cannot_be_aligned() -> None:
    with pytest.raises(AlignmentError, match="cannot be aligned: they hold different requests"):
        diff(pause_resume("epoch"), double_reset("epoch"))
    with pytest.raises(AlignmentError, match="request 'r' has a different prompt"):
        diff(pause_resume("epoch", second=False), _one_request("r", [1, 2, 3]))


def _one_request(req_id: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    llm = LLM(model="oracle-random", tape=None)
    llm.llm_engine.add_request(req_id, prompt, SamplingParams(max_tokens=4))
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    return llm.llm_engine.engine_core.tape


def test_a_shorter_stream_is_a_length_divergence() -> None:
    short = LLM(model="oracle", tape=None)
    short.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    long = LLM(model="oracle", tape=None)
    long.generate([[5, 6, 7]], SamplingParams(max_tokens=6))
    first = diff(short.llm_engine.engine_core.tape, long.llm_engine.engine_core.tape).first
    assert first is not None and first.what == "length" and first.position == 4
    assert "A delivered 4 tokens and finished (length); B delivered 6" == first.explanation


def test_diff_cli_exit_status_and_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, c = tmp_path / "epoch.tape", tmp_path / "flag.tape", tmp_path / "other.tape"
    pause_resume("epoch", a)
    pause_resume("flag", b)
    double_reset("epoch", c)
    rc, out, err = run(capsys, "diff", str(a), str(a))
    assert rc == 0 and out.startswith("identical: 2 requests") and not err
    rc, out, err = run(capsys, "diff", str(a), str(b))
    lines = out.splitlines()
    assert rc == 1 and lines[0].startswith("DIFFERENT: 2 of 2 requests differ")
    assert lines[1].startswith("first divergence: request r, output position")
    assert lines[2].startswith("  A: ") and lines[3].startswith("  B: ")
    assert any(line.startswith("tape A around event") for line in lines)
    assert any(line.startswith("tape B around event") for line in lines)
    assert lines[-1].startswith("also differs: request s")
    rc, out, err = run(capsys, "diff", str(a), str(c))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: the tapes cannot be aligned")
    rc, _, err = run(capsys, "diff", str(a), str(tmp_path / "missing.tape"))
    assert rc == 2 and "no such tape file" in err


# -- what-if -----------------------------------------------------------------------------------


def test_whatif_with_the_same_configuration_reproduces_the_recording() -> None:
    original = load_tape(busy())
    result = whatif(original)
    assert result.diff.identical
    assert [e for _, e in result.tape.events()] == [e for _, e in original.events()]


def test_whatif_epoch_fixes_the_flag_recording() -> None:
    flag = pause_resume("flag")
    result = whatif(flag, discard_policy="epoch")
    assert result.config.discard_policy == "epoch" and not result.diff.identical
    assert "A's stream from position" in result.diff.first.explanation  # type: ignore[union-attr]
    # The epoch run equals an epoch recording of the same scenario.
    assert diff(result.tape, pause_resume("epoch")).identical
    assert verify(result.tape).ok


def test_whatif_sync_and_deeper_pipelines_give_the_same_streams_under_epoch() -> None:
    recording = double_reset("epoch")
    for depth in (1, 2, 4):
        result = whatif(recording, pipeline_depth=depth)
        assert result.config.effective_pipeline_depth == depth
        assert result.diff.identical, result.diff.format()


def test_recorded_commands_leave_out_what_a_pause_caused() -> None:
    llm = LLM(model="oracle", tape=None, pipeline_depth=2)
    for i in range(3):
        llm.llm_engine.add_request(f"q{i}", [3, 4, 5, 6], SamplingParams(max_tokens=20))
    for _ in range(4):
        llm.llm_engine.step()
    llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
    llm.llm_engine.resume_generation()
    llm.llm_engine.reset_prefix_cache()
    llm.llm_engine.pause_generation(mode="abort", clear_cache=False)
    llm.llm_engine.resume_generation()
    llm.llm_engine.abort_request("q0")  # already aborted by the pause: records nothing
    kinds = [ev.kind_of(e) for e in recorded_commands(load_tape(llm.llm_engine.engine_core.tape))]
    assert kinds == ["RequestAdded"] * 3 + [
        "GenerationPaused",
        "GenerationResumed",
        "PrefixCacheReset",
        "GenerationPaused",
        "GenerationResumed",
    ]
    assert whatif(llm.llm_engine.engine_core.tape).diff.identical


def test_whatif_errors_are_clear() -> None:
    tape = pause_resume("epoch")
    with pytest.raises(WhatIfError, match="unknown runner 'gpu': choose one of oracle, model"):
        whatif(tape, runner="gpu")
    with pytest.raises(WhatIfError, match="pipeline_depth must be in 1..4"):
        whatif(tape, pipeline_depth=7)


def test_whatif_cli_writes_a_new_tape_and_prints_the_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flag = tmp_path / "flag.tape"
    pause_resume("flag", flag)
    rc, out, err = run(capsys, "replay", "whatif", str(flag), "--discard-policy", "epoch")
    new = tmp_path / "flag-whatif.tape"
    assert rc == 1 and new.exists()
    lines = out.splitlines()
    assert lines[0].startswith(
        f"what-if: discard policy epoch, pipeline depth 2, model oracle-random; new tape {new}"
    )
    assert lines[1].startswith("DIFFERENT: 2 of 2 requests differ")
    rc, out, _ = run(capsys, "replay", "whatif", str(flag), "--out", str(tmp_path / "same.tape"))
    assert rc == 0 and "identical: 2 requests" in out
    # The real model samples other tokens than the oracle the tape was recorded with.
    rc, out, _ = run(
        capsys,
        "replay",
        "whatif",
        str(flag),
        "--runner",
        "model",
        "--out",
        str(tmp_path / "model.tape"),
    )
    assert rc == 1 and (tmp_path / "model.tape").exists()
    assert out.splitlines()[0].startswith(
        "what-if: discard policy flag, pipeline depth 2, model tiny"
    )
    rc, _, err = run(capsys, "replay", "whatif", str(flag), "--out", str(new))
    assert rc == 2 and "the file exists; pass --force to overwrite it" in err
    rc, _, err = run(capsys, "replay", "whatif", str(flag), "--out", str(flag), "--force")
    assert rc == 2 and f"--out names the input {flag}" in err and verify(flag).ok
    rc, out, _ = run(capsys, "replay", "whatif", str(flag), "--out", str(new), "--force")
    assert rc == 0 and "identical: 2 requests" in out and verify(new).ok


def test_whatif_skips_a_weight_update_under_the_oracle() -> None:
    """The RLHF loop: pause, update the weights, resume. The tape names the weights only."""
    from tokentape.events.store import MemoryTape

    recording = load_tape(pause_resume("epoch"))
    with_update = MemoryTape(recording.header)
    for _, event in recording.events():
        if isinstance(event, ev.GenerationResumed):  # paused and drained: where RL loads weights
            with_update.append(ev.WeightsUpdated(event.step, "sha256:abc"))
        with_update.append(event)
    assert load_tape(with_update).fold().weights_id == "sha256:abc"
    assert verify(with_update).ok  # as the engine records it
    result = whatif(with_update)
    assert result.diff.identical
    step = next(e.step for _, e in recording.events() if isinstance(e, ev.GenerationResumed))
    note = (
        f"weight update to 'sha256:abc' at step {step} skipped: "
        "the oracle's tokens do not depend on weights"
    )
    assert result.notes == [note]
    assert [ev.kind_of(e) for e in recorded_commands(load_tape(with_update))].count(
        "WeightsUpdated"
    ) == 1
    # The real model would need the weights themselves, which the tape does not hold.
    with pytest.raises(WhatIfError, match="the weights are not on the tape"):
        whatif(with_update, runner="model")


def test_sync_against_async_runs_of_the_same_requests_are_identical() -> None:
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7], list(range(20, 60))]
    tapes = []
    for kwargs in ({"async_scheduling": False}, {"pipeline_depth": 3, "num_speculative_tokens": 2}):
        llm = LLM(model="oracle", tape=None, block_size=4, num_kv_blocks=32, **kwargs)  # type: ignore[arg-type]
        llm.generate(prompts, SamplingParams(max_tokens=12))
        tapes.append(llm.llm_engine.engine_core.tape)
    assert len(tapes[0]) != len(tapes[1])  # different schedules, different tapes
    assert diff(tapes[0], tapes[1]).identical


def test_whatif_replays_with_the_runner_that_recorded_the_tape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tape of the real model replays with that model by default: the same tokens, so a
    change that cannot alter them (a synchronous schedule) is identical, not 'position 0'."""
    tape = tmp_path / "tiny.tape"
    llm = LLM(model="tiny", tape=tape, pipeline_depth=2)
    llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=6))
    llm.close()
    rc, out, _ = run(
        capsys, "replay", "whatif", str(tape), "--discard-policy", "epoch", "--pipeline-depth", "1"
    )
    assert rc == 0, out
    assert out.splitlines()[0].startswith(
        "what-if: discard policy epoch, pipeline depth 1, model tiny"
    )
    assert "identical: 2 requests" in out
    # --runner oracle still asks for the fake model, whose tokens differ from the start.
    rc, out, _ = run(
        capsys,
        "replay",
        "whatif",
        str(tape),
        "--runner",
        "oracle",
        "--out",
        str(tmp_path / "oracle.tape"),
    )
    assert rc == 1 and "model oracle;" in out.splitlines()[0] and "position 0" in out
    # An oracle tape replays with the oracle (the recorded runner) by default.
    assert whatif(pause_resume("epoch")).config.model == "oracle-random"


def test_whatif_replays_a_tape_whose_requests_stop_on_stop_strings(tmp_path: Path) -> None:
    """What-if engines are built by the engine factory with the recording model's tokenizer,
    so a tape of requests with stop strings (most of a server's) replays; before, its engine
    had no tokenizer and refused them."""
    tape = tmp_path / "stops.tape"
    llm = LLM(model="tiny", tape=tape)
    probe = llm.generate(["Hello"], SamplingParams(max_tokens=12))[0].outputs[0].text
    stop = probe[3:5]  # a string the greedy stream reaches
    params = SamplingParams(max_tokens=12, stop=[stop])
    outs = llm.generate(["Hello", "Bonjour"], [params, SamplingParams(max_tokens=6)])
    llm.close()
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].stop_reason == stop
    result = whatif(load_tape(tape), pipeline_depth=2)
    assert result.diff.identical, result.diff.format()
    stopped = [
        e
        for _, e in result.tape.events()
        if isinstance(e, ev.RequestFinished) and e.reason == "stop"
    ]
    assert [e.req_id for e in stopped] == ["1"]
    # The oracle runs the same requests' stop strings with the recording model's tokenizer.
    assert whatif(load_tape(tape), runner="oracle").config.model == "oracle"


def test_diff_counts_read_as_english() -> None:
    one_epoch, one_flag = pause_resume("epoch", second=False), pause_resume("flag", second=False)
    assert (
        diff(one_epoch, pause_resume("epoch", second=False))
        .format()
        .startswith("identical: 1 request, ")
    )
    assert diff(one_epoch, one_flag).format().startswith("DIFFERENT: 1 of 1 request differs ")
