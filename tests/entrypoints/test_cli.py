"""The `tokentape` command line: generate, replay verify, inspect, and its error reporting."""

from __future__ import annotations

import io
import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import assert_one_line_error, run

from tokentape import LLM, SamplingParams
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.entrypoints.cli.generate import DEFAULT_PROMPTS
from tokentape.events import schema as ev
from tokentape.events.discard import discard_count
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.replay import load_tape, verify

# -- helpers -------------------------------------------------------------------------------


def expected_tokens(prompts: list[str], max_tokens: int, **engine_args: object) -> list[list[int]]:
    llm = LLM(model="oracle", tape=None, **engine_args)  # type: ignore[arg-type]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def busy_tape(tmp_path: Path) -> Path:
    """A recorded run with chunked prefill, KV-pressure preemptions and spec decoding."""
    path = tmp_path / "busy.tape"
    llm = LLM(
        model="oracle",
        tape=path,
        max_num_seqs=4,
        num_kv_blocks=24,
        block_size=4,
        max_num_batched_tokens=32,
        num_speculative_tokens=2,
    )
    llm.generate(
        [f"prompt number {i} " * (1 + i % 3) for i in range(8)], SamplingParams(max_tokens=12)
    )
    llm.close()
    return path


def tampered_copy(src: Path, dst: Path) -> int:
    """Copy a tape event by event into a new SQLite tape, changing the tokens of one
    FrameProduced; returns the position of the altered event."""
    tape = load_tape(src)
    out = SQLiteTape(dst, tape.header)
    altered = None
    for seq, event in tape.events():
        if altered is None and isinstance(event, ev.FrameProduced) and event.entries:
            first = event.entries[0]
            tokens = [(t - 3 + 1) % 256 + 3 for t in first.token_ids]  # still in the vocabulary
            entry = ev.FrameEntry(first.req_id, tokens, first.draft_token_ids, first.logprobs)
            event = ev.FrameProduced(event.step, [entry, *event.entries[1:]])
            altered = seq
        out.append(event)
    out.close()
    assert altered is not None
    return altered


def newer_version_copy(src: Path, dst: Path) -> None:
    src_conn = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    dst_conn = sqlite3.connect(dst)
    src_conn.backup(dst_conn)
    src_conn.close()
    dst_conn.execute("DROP TRIGGER meta_no_update")
    dst_conn.execute(
        "UPDATE meta SET value = ? WHERE key = 'format_version'", (ev.FORMAT_VERSION + 1,)
    )
    dst_conn.commit()
    dst_conn.close()


# -- help ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--help"], ["generate", "replay", "inspect"]),
        (
            ["generate", "--help"],
            [
                "--file",
                "--tape",
                "--no-tape",
                "--sync",
                "--pipeline-depth",
                "--num-speculative-tokens",
                "--discard-policy",
                "--json",
                "--num-kv-blocks",
                "--block-size",
                "--max-tokens",
            ],
        ),
        (["replay", "verify", "--help"], ["TAPE", "exit status"]),
        (["inspect", "--help"], ["--step", "--request", "--json"]),
    ],
)
def test_help(capsys: pytest.CaptureFixture[str], argv: list[str], fragments: list[str]) -> None:
    rc, out, _ = run(capsys, *argv)
    assert rc == 0
    for fragment in fragments:
        assert fragment in out


def test_every_command_and_option_has_a_help_line() -> None:
    """`tokentape --help` lists every command with a one-line description, and every option
    of every command (nested ones too) says what it does."""
    import argparse

    from tokentape.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                described = {a.dest for a in action._choices_actions if a.help}
                for name, sub in action.choices.items():
                    if name not in described:
                        missing.append(f"{path} {name}: no description")
                    missing += walk(sub, f"{path} {name}")
            elif action.option_strings and not action.help:
                missing.append(f"{path} {action.option_strings[0]}: no help")
        return missing

    assert walk(build_parser(), "tokentape") == []


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        [],
        ["replay"],
        ["frobnicate"],
        ["generate", "--max-tokens", "0"],
        ["generate", "--sync", "--pipeline-depth", "2"],
        ["generate", "--discard-policy", "bogus"],
        ["inspect"],
    ):
        rc, _, err = run(capsys, *argv)
        assert rc == 2, argv
        assert "Traceback" not in err
        assert "usage:" in err


# -- generate ------------------------------------------------------------------------------


def test_generate_prompts_plain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tape = tmp_path / "run.tape"
    rc, out, err = run(
        capsys,
        "generate",
        "--model",
        "oracle",
        "Hello",
        "The capital of France is",
        "--max-tokens",
        "5",
        "--tape",
        str(tape),
    )
    assert rc == 0
    expected = expected_tokens(["Hello", "The capital of France is"], 5)
    assert "request 0: finish_reason=length num_tokens=5" in out
    assert "request 1: finish_reason=length num_tokens=5" in out
    assert f"token_ids: {expected[0]}" in out and f"token_ids: {expected[1]}" in out
    assert "prompt:    'Hello'" in out
    assert repr(ByteTokenizer().decode(expected[0])) in out
    assert err.strip() == f"tape: {tape}"
    assert len(load_tape(tape)) > 0


def test_generate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tape = tmp_path / "run.tape"
    rc, out, err = run(
        capsys,
        "generate",
        "--model",
        "oracle",
        "one",
        "two",
        "three",
        "--max-tokens",
        "4",
        "--json",
        "--tape",
        str(tape),
    )
    assert rc == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["request_id"] for r in records] == ["0", "1", "2"]
    assert [r["prompt"] for r in records] == ["one", "two", "three"]
    assert [r["token_ids"] for r in records] == expected_tokens(["one", "two", "three"], 4)
    for r in records:
        assert r["finish_reason"] == "length" and r["finished"] is True
        assert r["text"] == ByteTokenizer().decode(r["token_ids"])
        assert r["prompt_token_ids"] == ByteTokenizer().encode(r["prompt"])
    assert err.strip() == f"tape: {tape}"


def test_generate_from_file_and_stdin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first line\n\n   \nsecond line\r\nthird line")
    rc, out, _ = run(
        capsys,
        "generate",
        "positional",
        "--file",
        str(prompts),
        "--json",
        "--max-tokens",
        "3",
        "--tape",
        str(tmp_path / "a.tape"),
    )
    assert rc == 0
    got = [json.loads(line)["prompt"] for line in out.splitlines()]
    assert got == ["positional", "first line", "second line", "third line"]

    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\nand again\n"))
    rc, out, _ = run(
        capsys,
        "generate",
        "--file",
        "-",
        "--json",
        "--max-tokens",
        "3",
        "--tape",
        str(tmp_path / "b.tape"),
    )
    assert rc == 0
    assert [json.loads(line)["prompt"] for line in out.splitlines()] == ["from stdin", "and again"]


def test_generate_file_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "generate", "--file", str(tmp_path / "missing.txt"), "--no-tape")
    assert_one_line_error(rc, err, "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    rc, _, err = run(capsys, "generate", "--file", str(empty), "--no-tape")
    assert_one_line_error(rc, err, "no prompts", "empty.txt")
    rc, _, err = run(capsys, "generate", "", "--no-tape")
    assert_one_line_error(rc, err, "empty")


def test_generate_default_prompts_and_default_tape_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "generate", "--json")
    assert rc == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == list(DEFAULT_PROMPTS)
    assert all(len(r["token_ids"]) == 16 for r in records)  # the engine's default max_tokens
    tapes = list(tmp_path.glob("*.tape"))
    assert len(tapes) == 1
    assert re.fullmatch(r"tokentape-\d{8}T\d{6}Z(-\d+)?\.tape", tapes[0].name)
    assert err.strip() == f"tape: {tapes[0].name}"
    # a second run in the same second gets a new name instead of failing
    rc, _, _ = run(capsys, "generate", "Hi", "--max-tokens", "2")
    assert rc == 0
    assert len(list(tmp_path.glob("*.tape"))) == 2


def test_generate_no_tape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "generate", "Hi", "--no-tape", "--max-tokens", "3")
    assert rc == 0 and "request 0" in out
    assert "none" in err
    assert list(tmp_path.iterdir()) == []


def test_generate_engine_options_reach_the_tape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tape = tmp_path / "opts.tape"
    rc, out, _ = run(
        capsys,
        "generate",
        "--model",
        "oracle",
        "abc abc abc abc",
        "xyz",
        "--max-tokens",
        "20",
        "--json",
        "--tape",
        str(tape),
        "--pipeline-depth",
        "3",
        "--num-speculative-tokens",
        "2",
        "--discard-policy",
        "counter",
        "--num-kv-blocks",
        "64",
        "--block-size",
        "8",
        "--seed",
        "7",
        "--temperature",
        "0.5",
        "--max-num-seqs",
        "1",
    )
    assert rc == 0
    header = load_tape(tape).header
    config = load_tape(tape).config
    assert header.discard_policy == "counter" and header.seed == 7
    assert (config.pipeline_depth, config.num_speculative_tokens) == (3, 2)
    assert (config.num_kv_blocks, config.block_size, config.max_num_seqs) == (64, 8, 1)
    added = [e for _, e in load_tape(tape).events() if isinstance(e, ev.RequestAdded)]
    assert all(e.params.temperature == 0.5 and e.params.max_tokens == 20 for e in added)
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["token_ids"] for r in records] == expected_tokens(
        ["abc abc abc abc", "xyz"], 20, seed=7, num_speculative_tokens=2
    )

    sync = tmp_path / "sync.tape"
    rc, _, _ = run(capsys, "generate", "Hi", "--sync", "--tape", str(sync), "--max-tokens", "2")
    assert rc == 0
    assert load_tape(sync).config.effective_pipeline_depth == 1


def test_generate_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tape = tmp_path / "exists.tape"
    assert run(capsys, "generate", "Hi", "--tape", str(tape), "--max-tokens", "2")[0] == 0
    before = tape.read_bytes()
    rc, out, err = run(capsys, "generate", "Hi", "--tape", str(tape))
    assert_one_line_error(rc, err, str(tape), "the file exists; pass --force to overwrite it")
    assert out == ""
    assert tape.read_bytes() == before
    # --force replaces it with the new run (a bad engine argument still fails first).
    rc, _, err = run(
        capsys, "generate", "Hi", "--tape", str(tape), "--force", "--pipeline-depth", "9"
    )
    assert_one_line_error(rc, err, "pipeline_depth")
    assert tape.read_bytes() == before
    rc, _, err = run(
        capsys, "generate", "Hi", "Ho", "--tape", str(tape), "--force", "--max-tokens", "3"
    )
    assert rc == 0, err
    assert len(load_tape(tape).fold().requests) == 2 and verify(tape).ok


def test_generate_bad_engine_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tape = tmp_path / "never.tape"
    rc, _, err = run(capsys, "generate", "Hi", "--pipeline-depth", "9", "--tape", str(tape))
    assert_one_line_error(rc, err, "pipeline_depth")
    rc, _, err = run(capsys, "generate", "Hi", "--model", "gpt-17", "--tape", str(tape))
    assert_one_line_error(rc, err, "gpt-17")
    assert not tape.exists()  # nothing was recorded for a run that never started
    rc, _, err = run(capsys, "generate", "Hi", "--tape", str(tmp_path / "no-dir" / "x.tape"))
    assert_one_line_error(rc, err, "does not exist")
    # a prompt longer than the KV cache holds: refused by the engine, the tape so far is named
    rc, _, err = run(
        capsys,
        "generate",
        "a much too long prompt",
        "--num-kv-blocks",
        "1",
        "--block-size",
        "4",
        "--tape",
        str(tape),
    )
    assert_one_line_error(rc, err, "prompt", str(tape))


# -- replay verify -------------------------------------------------------------------------


def test_replay_verify_ok(busy_tape: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "replay", "verify", str(busy_tape))
    assert rc == 0
    assert out == f"ok: {len(load_tape(busy_tape))} events reproduced\n"
    assert err == ""


def test_replay_verify_generated_tape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tape = tmp_path / "gen.tape"
    assert run(capsys, "generate", "--tape", str(tape), "--num-speculative-tokens", "3")[0] == 0
    rc, out, _ = run(capsys, "replay", "verify", str(tape))
    assert rc == 0 and out.startswith("ok: ")


def test_replay_verify_inconsistent_tape(
    busy_tape: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "tampered.tape"
    altered = tampered_copy(busy_tape, bad)
    assert len(load_tape(bad)) == len(load_tape(busy_tape))
    rc, out, err = run(capsys, "replay", "verify", str(bad))
    assert rc == 1
    assert "Traceback" not in out + err
    assert out.startswith("FAILED: ")
    match = re.search(r"first divergence at event (\d+): (.*)", out)
    assert match, out
    assert int(match.group(1)) > altered  # the altered frame is replayed as recorded; what
    assert "OutputsEmitted" in match.group(2)  # the client was given no longer matches
    assert "recorded: OutputsEmitted" in out and "replayed: OutputsEmitted" in out
    assert "FrameProduced" in out  # the context around the divergence


def test_tape_with_a_missing_event(
    busy_tape: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tape whose events cannot follow each other: fold refuses it, verify diverges."""
    bad = tmp_path / "gap.tape"
    tape = load_tape(busy_tape)
    out = SQLiteTape(bad, tape.header)
    dropped = False
    for _, event in tape.events():
        if not dropped and isinstance(event, ev.StepScheduled) and event.step == 2:
            dropped = True
            continue
        out.append(event)
    out.close()
    for argv in (
        ["inspect", str(bad)],
        ["inspect", str(bad), "--json"],
        ["inspect", str(bad), "--step", "5"],
    ):
        rc, stdout, err = run(capsys, *argv)
        assert_one_line_error(rc, err, str(bad), "the tape is inconsistent: event")
        assert " of step 3) cannot be applied to the state before it: " in err
        assert stdout == ""
    rc, stdout, err = run(capsys, "replay", "verify", str(bad))
    assert rc == 1 and "first divergence at event" in stdout and "Traceback" not in err


# -- inspect -------------------------------------------------------------------------------


def test_inspect_plain(busy_tape: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "inspect", str(busy_tape))
    assert rc == 0 and err == ""
    state = load_tape(busy_tape).fold()
    for fragment in (
        "format version",
        "model",
        "oracle",
        "discard policy",
        "epoch",
        "speculative tokens",
        "kv cache",
        "24 blocks x 4 tokens",
        "engine state at the end of the tape",
        f"steps scheduled      {state.step}",
        "prefix cache resets",
        "in-flight steps",
        "requests (8)",
    ):
        assert fragment in out, fragment
    header_line = next(line for line in out.splitlines() if line.strip().startswith("id "))
    for column in (
        "status",
        "prompt",
        "output",
        "computed",
        "placeholders",
        "epoch",
        "discard",
        "preemptions",
        "blocks",
        "dropped",
        "finish",
    ):
        assert column in header_line
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.strip() and line.split()[0] in state.requests
    }
    assert set(rows) == set(state.requests)
    for req_id, req in state.requests.items():
        cells = rows[req_id]
        assert cells[1] == req.status.value
        assert cells[2:11] == [
            str(v)
            for v in (
                req.num_prompt_tokens,
                len(req.output_token_ids),
                req.num_computed_tokens,
                req.num_output_placeholders,
                req.epoch,
                discard_count(state, req),
                req.num_preemptions,
                len(req.block_ids),
                req.num_frames_dropped,
            )
        ]
        assert cells[11] == req.finish_reason
    assert any(r.num_preemptions for r in state.requests.values())


def test_inspect_json_and_step(busy_tape: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "inspect", str(busy_tape), "--json")
    assert rc == 0
    final = json.loads(out)
    tape = load_tape(busy_tape)
    assert final["num_events"] == len(tape)
    assert final["header"]["format_version"] == ev.FORMAT_VERSION
    assert final["header"]["model_id"] == "oracle"
    assert final["engine"]["step"] == tape.fold().step
    assert len(final["requests"]) == 8
    assert all(r["status"].startswith("finished") for r in final["requests"])

    rc, out, _ = run(capsys, "inspect", str(busy_tape), "--json", "--step", "3")
    assert rc == 0
    at3 = json.loads(out)
    state = tape.at(3)
    assert at3["step"] == 3 and at3["engine"]["step"] == state.step == 4
    assert at3["engine"]["in_flight_steps"] == [s.step for s in state.in_flight_steps]
    assert {r["id"]: r["output"] for r in at3["requests"]} == {
        r.req_id: len(r.output_token_ids) for r in state.requests.values()
    }
    assert at3 != final

    rc, out, _ = run(capsys, "inspect", str(busy_tape), "--step", "3")
    assert rc == 0 and "engine state at step 3" in out


def test_inspect_step_past_the_end(busy_tape: Path, capsys: pytest.CaptureFixture[str]) -> None:
    last = load_tape(busy_tape).fold().step - 1
    rc, out, err = run(capsys, "inspect", str(busy_tape), "--step", "100000")
    assert_one_line_error(
        rc, err, str(busy_tape), f"step 100000 is out of range: the tape schedules steps 0..{last}"
    )
    assert out == ""
    rc, out, _ = run(capsys, "inspect", str(busy_tape), "--step", str(last))
    assert rc == 0 and f"engine state at step {last}" in out


def test_inspect_request(busy_tape: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = load_tape(busy_tape).fold()
    req = max(state.requests.values(), key=lambda r: r.num_preemptions)
    rc, out, _ = run(capsys, "inspect", str(busy_tape), "--request", req.req_id)
    assert rc == 0
    assert f"request {req.req_id!r} at the end of the tape" in out
    assert f"output_token_ids             {req.output_token_ids}" in out
    assert f"num_preemptions              {req.num_preemptions}" in out
    assert "finish_reason                length" in out

    rc, out, _ = run(capsys, "inspect", str(busy_tape), "--request", req.req_id, "--json")
    detail = json.loads(out)["request"]
    assert detail["output_token_ids"] == req.output_token_ids
    assert detail["prompt_token_ids"] == req.prompt_token_ids
    assert detail["epoch"] == req.epoch and detail["discard_count"] == 0
    assert detail["params"]["max_tokens"] == 12

    at = load_tape(busy_tape).at(2)
    some = next(iter(at.requests.values()))
    rc, out, _ = run(
        capsys, "inspect", str(busy_tape), "--request", some.req_id, "--step", "2", "--json"
    )
    detail = json.loads(out)["request"]
    assert detail["output_token_ids"] == some.output_token_ids
    assert detail["in_flight"] == [
        {
            "step": step,
            "epoch": e.epoch,
            "num_spec_tokens": e.num_spec_tokens,
            "stale": e.epoch != some.epoch,
        }
        for step, e in at.in_flight_entries(some.req_id)
    ]


def test_inspect_generated_output_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tape = tmp_path / "gen.tape"
    rc, out, _ = run(capsys, "generate", "Hello there", "--json", "--tape", str(tape))
    tokens = json.loads(out)["token_ids"]
    rc, out, _ = run(capsys, "inspect", str(tape), "--request", "0", "--json")
    assert rc == 0 and json.loads(out)["request"]["output_token_ids"] == tokens


def test_inspect_rich_tables_on_a_terminal(
    busy_tape: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tokentape.replay.render.is_terminal", lambda stream: True)
    rc, out, _ = run(capsys, "inspect", str(busy_tape))
    assert rc == 0
    assert "discard policy" in out and "requests (8)" in out
    assert "─" in out  # a rich table rule
    rc, out, _ = run(capsys, "inspect", str(busy_tape), "--request", "3")
    assert rc == 0 and "output_token_ids" in out


# -- errors --------------------------------------------------------------------------------


def _not_a_tape(tmp_path: Path) -> Path:
    p = tmp_path / "notes.txt"
    p.write_text("this is not a tape\n")
    return p


def _empty(tmp_path: Path) -> Path:
    p = tmp_path / "empty.tape"
    p.write_bytes(b"")
    return p


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "missing.tape"


def _sqlite_other(tmp_path: Path) -> Path:
    p = tmp_path / "other.db"
    conn = sqlite3.connect(p)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    return p


def _truncated(tmp_path: Path) -> Path:
    src = tmp_path / "whole.tape"
    llm = LLM(model="oracle", tape=src, max_num_seqs=2)
    llm.generate([f"prompt {i}" for i in range(16)], SamplingParams(max_tokens=64))
    llm.close()
    p = tmp_path / "truncated.tape"
    p.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    return p


def _newer(tmp_path: Path) -> Path:
    src = tmp_path / "v1.tape"
    llm = LLM(model="oracle", tape=src)
    llm.generate(["Hi"], SamplingParams(max_tokens=2))
    llm.close()
    p = tmp_path / "newer.tape"
    newer_version_copy(src, p)
    return p


BAD_TAPES = {
    "not-a-tape": (_not_a_tape, "not a tokentape tape"),
    "empty": (_empty, "not a tokentape tape"),
    "missing": (_missing, "no such tape file"),
    "other-sqlite": (_sqlite_other, "not a tokentape tape"),
    "truncated": (_truncated, ""),
    "newer-version": (_newer, f"version {ev.FORMAT_VERSION + 1}"),
}


@pytest.mark.parametrize("kind", sorted(BAD_TAPES))
@pytest.mark.parametrize("command", [["replay", "verify"], ["inspect"], ["inspect", "--json"]])
def test_bad_tape_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, command: list[str]
) -> None:
    make, fragment = BAD_TAPES[kind]
    path = make(tmp_path)
    rc, out, err = run(capsys, command[0], *command[1:2], str(path), *command[2:])
    assert_one_line_error(rc, err, str(path), fragment)
    assert out == ""


def test_unknown_request(busy_tape: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "inspect", str(busy_tape), "--request", "no-such-request")
    assert_one_line_error(rc, err, "no-such-request", str(busy_tape), "8 requests")
    assert out == ""
    rc, out, err = run(capsys, "inspect", str(busy_tape), "--request", "8", "--step", "0", "--json")
    assert_one_line_error(rc, err, "'8'", "at step 0")
    assert out == ""


# -- as a separate process -----------------------------------------------------------------


def test_subprocess_module(tmp_path: Path) -> None:
    tape = tmp_path / "proc.tape"
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokentape.cli",
            "generate",
            "Hi",
            "--model",
            "oracle",
            "--json",
            "--max-tokens",
            "3",
            "--tape",
            str(tape),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["token_ids"] == expected_tokens(["Hi"], 3)[0]
    assert gen.stderr.strip() == f"tape: {tape}"

    ok = subprocess.run(
        [sys.executable, "-m", "tokentape.cli", "replay", "verify", str(tape)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == f"ok: {len(load_tape(tape))} events reproduced\n"

    bogus = _not_a_tape(tmp_path)
    bad = subprocess.run(
        [sys.executable, "-m", "tokentape.cli", "inspect", str(bogus)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ")

    # A CLIError raised in another module (the postmortem's, for a tape it cannot read to its
    # end) is the same class when the CLI runs as __main__: one line, no traceback.
    truncated = _truncated(tmp_path)
    pm = subprocess.run(
        [sys.executable, "-m", "tokentape.cli", "postmortem", str(truncated)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert pm.returncode == 2 and "Traceback" not in pm.stderr, pm.stderr
    assert pm.stderr.count("\n") == 1 and pm.stderr.startswith(f"error: {truncated}")

    piped = subprocess.run(
        [sys.executable, "-m", "tokentape.cli", "inspect", str(tape)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert piped.returncode == 0 and "requests (1)" in piped.stdout
    assert "\x1b[" not in piped.stdout  # plain text when stdout is not a terminal


@pytest.mark.skipif(shutil.which("tokentape") is None, reason="console script not installed")
def test_console_script(tmp_path: Path) -> None:
    truncated = _truncated(tmp_path)
    proc = subprocess.run(
        ["tokentape", "replay", "verify", str(truncated)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: {truncated}")
    helped = subprocess.run(
        ["tokentape", "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert helped.returncode == 0 and "generate" in helped.stdout
