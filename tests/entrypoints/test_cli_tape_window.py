"""The reading commands on a segmented tape's directory, and its time window --since/--until
(tokentape/entrypoints/cli/tape_source.py)."""

from __future__ import annotations

import argparse
import datetime
import io
import json
import sys
import time
from pathlib import Path

import pytest
from cli_run import assert_one_line_error, run

from tokentape import LLM, SamplingParams
from tokentape.engine.config import EngineConfig
from tokentape.engine.factory import build_engine_core
from tokentape.entrypoints.cli.tape_source import parse_time_point
from tokentape.events import schema as ev
from tokentape.events.segment_dir import SegmentedTapeSpec
from tokentape.events.segmented_reader import SegmentedTapeReader
from tokentape.postmortem.fleet import find_tapes
from tokentape.replay import load_tape, verify


def record_segmented(directory: Path) -> Path:
    spec = SegmentedTapeSpec(str(directory), segment_seconds=0.02, retention_bytes=None)
    engine = build_engine_core(EngineConfig(model="oracle", num_kv_blocks=64, block_size=4), spec)
    for i in range(6):
        engine.add_request(f"r{i}", [1, 2, 3, 4, 5], ev.SamplingParams(max_tokens=12))
    while engine.has_unfinished_requests():
        engine.step()
        time.sleep(0.005)
    engine.close()
    return directory


@pytest.fixture(scope="module")
def segmented(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = record_segmented(tmp_path_factory.mktemp("segmented") / "run")
    reader = SegmentedTapeReader(run_dir)
    try:
        assert len(reader.segments) >= 3  # the windows below select some of them
    finally:
        reader.close()
    return run_dir


def segments(run_dir: Path) -> list[tuple[float, int]]:
    """(start time, events) of each segment."""
    reader = SegmentedTapeReader(run_dir)
    try:
        return [(s.starts_at, s.num_events) for s in reader.segments]
    finally:
        reader.close()


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()


# -- parse_time_point ----------------------------------------------------------------------


def test_parse_time_point() -> None:
    assert parse_time_point("10m") == datetime.timedelta(minutes=10)
    assert parse_time_point("2h") == datetime.timedelta(hours=2)
    assert parse_time_point("90s") == datetime.timedelta(seconds=90)
    assert parse_time_point("7d") == datetime.timedelta(days=7)
    assert parse_time_point("2025-01-31T14:00:00+00:00") == 1738332000.0
    naive = datetime.datetime(2025, 1, 31, 14, 0)  # local time
    assert parse_time_point("2025-01-31T14:00") == naive.timestamp()
    for bad in ("soon", "10x", "", "2025-13-01"):
        with pytest.raises(argparse.ArgumentTypeError) as info:
            parse_time_point(bad)
        message = str(info.value)
        assert "\n" not in message
        assert "duration" in message and "ISO date-time" in message


def test_bad_time_is_a_usage_error(capsys: pytest.CaptureFixture[str], segmented: Path) -> None:
    rc, _, err = run(capsys, "replay", "verify", str(segmented), "--since", "yesterday")
    assert rc == 2
    assert "argument --since: 'yesterday' is not a time" in err


# -- the whole directory -------------------------------------------------------------------


def test_verify_inspect_postmortem_on_a_directory(
    capsys: pytest.CaptureFixture[str], segmented: Path
) -> None:
    total = sum(n for _, n in segments(segmented))
    rc, out, err = run(capsys, "replay", "verify", str(segmented))
    assert (rc, out.strip(), err) == (0, f"ok: {total} events reproduced", "")
    # --since longer ago than the tape's start: every segment
    rc, out, _ = run(capsys, "replay", "verify", str(segmented), "--since", "10m")
    assert (rc, out.strip()) == (0, f"ok: {total} events reproduced")

    rc, out, _ = run(capsys, "inspect", str(segmented), "--json")
    assert rc == 0
    record = json.loads(out)
    assert record["num_events"] == total
    assert sorted(r["id"] for r in record["requests"]) == [f"r{i}" for i in range(6)]
    assert all(r["status"].startswith("finished") for r in record["requests"])

    rc, out, _ = run(capsys, "postmortem", str(segmented), "--json")
    assert rc == 0
    report = json.loads(out)
    assert report["summary"]["num_events"] == total
    assert report["summary"]["num_requests"] == 6
    assert [f for f in report["findings"] if f["severity"] == "error"] == []


def test_export_a_directory(
    capsys: pytest.CaptureFixture[str], segmented: Path, tmp_path: Path
) -> None:
    total = sum(n for _, n in segments(segmented))
    rc, out, _ = run(capsys, "export", str(segmented), "--format", "jsonl")
    assert rc == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["seq"] for r in records] == list(range(total))
    assert records[0]["kind"] == "EngineSnapshot"

    copy = tmp_path / "copy.tape"
    rc, _, err = run(capsys, "export", str(segmented), "--format", "sqlite", "-o", str(copy))
    assert (rc, err.strip()) == (0, f"wrote {copy} ({total} events)")
    assert verify(copy).ok  # one file, the directory's events
    assert len(load_tape(copy)) == total


def test_debug_why_diff_on_a_directory(
    capsys: pytest.CaptureFixture[str], segmented: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("goto 3\nwhere\n"))
    rc, out, _ = run(capsys, "debug", str(segmented))
    assert rc == 0 and "StepScheduled(step=3)" in out
    rc, out, _ = run(capsys, "why", str(segmented), "r0", "3", "--json")
    assert rc == 0
    assert json.loads(out)["tape"] == str(segmented)
    rc, out, _ = run(capsys, "diff", str(segmented), str(segmented))
    assert rc == 0 and out.startswith("identical: 6 requests")


# -- windows -------------------------------------------------------------------------------


def test_a_window_of_the_last_segment_verifies(
    capsys: pytest.CaptureFixture[str], segmented: Path
) -> None:
    last_events = segments(segmented)[-1][1]
    rc, out, _ = run(capsys, "replay", "verify", str(segmented), "--since", "0s")
    assert (rc, out.strip()) == (0, f"ok: {last_events} events reproduced")


def test_a_window_from_the_middle_verifies_and_postmortems(
    capsys: pytest.CaptureFixture[str], segmented: Path
) -> None:
    segs = segments(segmented)
    since = iso(segs[1][0] + 1e-3)  # inside segment 1: segment 1 onwards
    expected = sum(n for _, n in segs[1:])
    rc, out, _ = run(capsys, "replay", "verify", str(segmented), "--since", since)
    assert (rc, out.strip()) == (0, f"ok: {expected} events reproduced")
    rc, out, _ = run(capsys, "postmortem", str(segmented), "--since", since, "--json")
    assert rc == 0
    assert json.loads(out)["summary"]["num_events"] == expected
    # --until inside segment 0: that segment alone
    until = iso(segs[0][0] + 1e-3)
    rc, out, _ = run(capsys, "replay", "verify", str(segmented), "--until", until)
    assert (rc, out.strip()) == (0, f"ok: {segs[0][1]} events reproduced")


def test_window_on_a_tape_file_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], segmented: Path, tmp_path: Path
) -> None:
    plain = tmp_path / "plain.tape"
    assert run(capsys, "export", str(segmented), "--format", "sqlite", "-o", str(plain))[0] == 0
    for argv in (
        ["replay", "verify", str(plain), "--since", "10m"],
        ["inspect", str(plain), "--until", "1m"],
        ["postmortem", str(plain), "--since", "10m"],
        ["export", str(plain), "--format", "jsonl", "--since", "10m"],
    ):
        rc, out, err = run(capsys, *argv)
        assert_one_line_error(rc, err, str(plain), "needs a segmented tape's directory")
        assert out == ""


def test_directory_without_manifest_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    empty = tmp_path / "not-a-tape"
    empty.mkdir()
    rc, out, err = run(capsys, "replay", "verify", str(empty))
    assert_one_line_error(rc, err, str(empty), "tokentape-tape.json")
    assert out == ""


# -- a fleet with a segmented tape ---------------------------------------------------------


def test_fleet_with_a_segmented_engine(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    record_segmented(fleet / "engine-0")
    llm = LLM(model="oracle", tape=fleet / "engine-1.tape")
    llm.generate(["hello", "world"], SamplingParams(max_tokens=6))
    llm.close()
    (fleet / "other").mkdir()  # a directory that is not a segmented tape: ignored
    assert [Path(p).name for p in find_tapes(fleet)] == ["engine-0", "engine-1.tape"]

    rc, out, _ = run(capsys, "postmortem", str(fleet), "--json", "--jobs", "1")
    assert rc == 0
    summary = json.loads(out)["summary"]
    assert summary["tapes"] == 2
    assert list(summary["engines"]) == ["engine-0", "engine-1"]
    assert summary["engines"]["engine-0"]["num_requests"] == 6
    assert summary["engines"]["engine-0"]["ended"] == "complete"
    assert summary["engines"]["engine-1"]["num_requests"] == 2

    rc, _, err = run(capsys, "postmortem", str(fleet), "--since", "10m")
    assert_one_line_error(rc, err, "--since and --until apply to a segmented tape's directory")


def test_diff_takes_a_window_of_both_and_why_names_a_request_added_before_it(
    capsys: pytest.CaptureFixture[str], segmented: Path
) -> None:
    starts = segments(segmented)
    since = iso(starts[1][0] + 1e-6)
    rc, out, _ = run(capsys, "diff", str(segmented), str(segmented), "--since", since)
    assert rc == 0 and "identical" in out
    # A request the window's first snapshot holds was added before it: why says so.
    reader = SegmentedTapeReader(segmented, since=starts[1][0] + 1e-6)
    try:
        first = reader.segments[0]
        held = [r.req_id for r in first.snapshot.requests]
        path = first.path
    finally:
        reader.close()
    assert held
    rc, _, err = run(capsys, "why", path, held[0], "0")
    assert_one_line_error(rc, err, "was added before this segment")
