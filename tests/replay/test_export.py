"""export: Perfetto trace-event JSON checked against the format, JSON lines, CSV."""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from pathlib import Path

import pytest
from tape_scenarios import busy, double_reset, pause_resume

from tokentape import cli
from tokentape.events import schema as ev
from tokentape.replay import load_tape
from tokentape.replay.export import CSV_COLUMNS, export, perfetto_trace

PHASES = {"X", "i", "M"}


def check_trace_event_format(trace: dict) -> None:  # type: ignore[type-arg]
    """The JSON object form of Chrome's trace-event format, as Perfetto reads it."""
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    last_ts: dict[tuple[int, int], float] = defaultdict(lambda: -1.0)
    for e in trace["traceEvents"]:
        for key in ("name", "ph", "pid", "tid", "ts"):
            assert key in e, (key, e)
        assert isinstance(e["name"], str) and e["ph"] in PHASES
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] > 0
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t")
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index") and "args" in e
            continue
        track = (e["pid"], e["tid"])
        assert e["ts"] >= last_ts[track], ("timestamps go backwards on a track", e)
        last_ts[track] = e["ts"]
    json.dumps(trace)  # serialisable as it is


@pytest.mark.parametrize(
    "make", [lambda: pause_resume("flag"), lambda: double_reset("counter"), busy]
)
def test_perfetto_trace_follows_the_trace_event_format(make) -> None:  # type: ignore[no-untyped-def]
    tape = load_tape(make())
    trace = perfetto_trace(tape)
    check_trace_event_format(trace)
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    requests = list(tape.fold().requests)
    assert names == {"engine"} | {f"request {r}" for r in requests}
    # Slices on each request's track never overlap: one phase at a time.
    ends: dict[int, int] = {}
    for e in events:
        if e["ph"] == "X":
            assert e["ts"] >= ends.get(e["tid"], 0)
            ends[e["tid"]] = e["ts"] + e["dur"]
    assert max(ends.values()) <= len(tape)


def test_perfetto_shows_the_flag_bug_as_fresh_discards_after_resume() -> None:
    events = perfetto_trace(load_tape(pause_resume("flag")))["traceEvents"]
    instants = [e for e in events if e["ph"] == "i"]
    engine = [e["name"] for e in instants if e["tid"] == 0]
    assert engine == ["pause", "reset", "resume"]
    discards = [e for e in instants if e["name"].startswith("discarded")]
    assert {e["name"] for e in discards} == {"discarded (fresh)"} and len(discards) == 2
    resume_ts = next(e["ts"] for e in instants if e["name"] == "resume")
    assert all(e["ts"] > resume_ts for e in discards)
    slices = {e["name"] for e in events if e["ph"] == "X"}
    assert {"prefill", "decode", "preempted", "paused"} <= slices


def test_jsonl_is_one_event_per_line_with_field_names() -> None:
    tape = load_tape(busy())
    out = io.StringIO()
    export(tape, "jsonl", out)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(tape)
    records = [json.loads(line) for line in lines]
    assert [r["seq"] for r in records] == list(range(len(tape)))
    for record, (_, event) in zip(records, tape.events()):
        assert record["kind"] == ev.kind_of(event) and record["step"] == event.step
    added = next(r for r in records if r["kind"] == "RequestAdded")
    assert set(added) == {
        "seq",
        "kind",
        "step",
        "req_id",
        "prompt_token_ids",
        "params",
        "lora_int_id",
    }
    assert added["params"]["max_tokens"] == 20
    scheduled = next(r for r in records if r["kind"] == "StepScheduled")
    assert set(scheduled["entries"][0]) == {
        "req_id",
        "epoch",
        "num_computed_before",
        "num_new_tokens",
        "num_spec_tokens",
        "new_block_ids",
    }


def test_csv_has_one_row_per_step_that_adds_up() -> None:
    tape = load_tape(busy())
    out = io.StringIO()
    export(tape, "csv", out)
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    state = tape.fold()
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert [int(r["step"]) for r in rows] == list(range(state.step))
    assert sum(int(r["tokens_delivered"]) for r in rows) == sum(
        len(r.output_token_ids) for r in state.requests.values()
    )
    assert sum(int(r["added"]) for r in rows) == len(state.requests)
    assert sum(int(r["preemptions"]) for r in rows) == sum(
        r.num_preemptions for r in state.requests.values()
    )
    assert sum(int(r["frames_dropped"]) for r in rows) == sum(
        r.num_frames_dropped for r in state.requests.values()
    )
    assert sum(int(r["aborted"]) + int(r["finished"]) for r in rows) == len(state.requests)
    for r in rows[::5]:  # the queues are the state Tape.at(step) gives
        at = tape.at(int(r["step"]))
        assert (int(r["waiting"]), int(r["running"])) == (len(at.waiting), len(at.running))


def test_export_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "flag.tape"
    pause_resume("flag", path)
    rc = cli.main(["export", str(path), "--format", "perfetto", "-o", str(tmp_path / "t.json")])
    assert rc == 0 and "wrote" in capsys.readouterr().err
    check_trace_event_format(json.loads((tmp_path / "t.json").read_text()))
    rc = cli.main(["export", str(path), "--format", "perfetto", "-o", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "the file exists; pass --force" in err
    rc = cli.main(
        ["export", str(path), "--format", "csv", "-o", str(tmp_path / "t.json"), "--force"]
    )
    assert rc == 0 and (tmp_path / "t.json").read_text().startswith("step,seq,")
    rc = cli.main(["export", str(path), "--format", "jsonl", "-o", str(path), "--force"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--output names the input {path}" in err and load_tape(path).fold().requests
    rc = cli.main(["export", str(path), "--format", "csv"])
    assert rc == 0 and capsys.readouterr().out.startswith("step,seq,")
    rc = cli.main(["export", str(path), "--format", "xml"])
    assert rc == 2 and "invalid choice: 'xml'" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["csv", "perfetto"])
def test_export_of_an_inconsistent_tape_is_one_line_and_leaves_no_file(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokentape.events.sqlite_store import SQLiteTape

    recorded = load_tape(pause_resume("epoch"))
    bad = tmp_path / "bad.tape"
    writer = SQLiteTape(bad, recorded.header)
    for _, event in recorded.events():
        writer.append(event)
        if isinstance(event, ev.StepScheduled):  # a frame for a request the tape never added
            writer.append(ev.FrameProduced(event.step, [ev.FrameEntry("zz", [5])]))
            break
    writer.close()
    out = tmp_path / f"bad.{fmt}"
    rc = cli.main(["export", str(bad), "--format", fmt, "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert not out.exists()


def test_export_sqlite_cli_copies_a_tape_into_one_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokentape.events.sqlite_store import tape_file_status
    from tokentape.replay import verify

    path = tmp_path / "flag.tape"
    pause_resume("flag", path)
    out = tmp_path / "out"
    out.mkdir()
    copy = out / "copy.tape"
    rc = cli.main(["export", str(path), "--format", "sqlite", "-o", str(copy)])
    n = len(load_tape(path))
    assert rc == 0 and f"wrote {copy} ({n} events)" in capsys.readouterr().err
    assert (
        sorted(p.name for p in out.iterdir()) == ["copy.tape"] and tape_file_status(copy).finished
    )
    assert [ev.encode(e) for _, e in load_tape(copy).events()] == [
        ev.encode(e) for _, e in load_tape(path).events()
    ]
    assert verify(copy).ok
    rc = cli.main(["export", str(path), "--format", "sqlite", "-o", str(copy)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "the file exists; pass --force" in err
    rc = cli.main(["export", str(path), "--format", "sqlite", "-o", str(copy), "--force"])
    assert rc == 0 and f"wrote {copy} ({n} events)" in capsys.readouterr().err and verify(copy).ok
    rc = cli.main(["export", str(path), "--format", "sqlite"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "--output" in err
    (tmp_path / "junk.tape").write_bytes(b"junk" * 100)
    rc = cli.main(
        ["export", str(tmp_path / "junk.tape"), "--format", "sqlite", "-o", str(out / "j.tape")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["copy.tape"]


def test_export_to_a_stream_refuses_sqlite() -> None:
    with pytest.raises(ValueError, match="writes a file"):
        export(load_tape(busy()), "sqlite", io.StringIO())
