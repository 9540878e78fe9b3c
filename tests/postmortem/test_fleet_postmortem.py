"""`tokentape postmortem DIR`: the postmortem of a fleet of tapes (one per engine), in worker
processes, with a row per engine. The Ray path (--ray) is in
tests/entrypoints/test_rlhf_ray.py, on the tapes of a real fleet."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from tokentape import LLM, SamplingParams
from tokentape.cli import main
from tokentape.postmortem import postmortem
from tokentape.postmortem.fleet import FleetReport, find_tapes, fleet_postmortem
from tokentape.postmortem.fleet_report import render_fleet_report
from tokentape.replay import load_tape, verify

TAPES = Path(__file__).resolve().parents[1] / "tapes"


def closed_mid_run(path: Path) -> None:
    """An engine closed with its requests running: the tape stops mid-run (tape_truncated)."""
    llm = LLM(model="oracle", tape=str(path), pipeline_depth=2)
    for i in range(3):
        llm.llm_engine.add_request(
            f"r{i}", list(range(5 + i, 20 + i)), SamplingParams(max_tokens=40, ignore_eos=True)
        )
    for _ in range(8):
        llm.llm_engine.step()
    llm.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fleet")
    shutil.copy(TAPES / "clean_epoch_storm.tape", d / "engine-0.tape")
    shutil.copy(TAPES / "flag_42043.tape", d / "engine-1.tape")
    closed_mid_run(d / "engine-2.tape")
    shutil.copy(TAPES / "counter_spec_units.tape", d / "engine-10.tape")
    (d / "notes.txt").write_text("not a tape: ignored")
    (d / "old").mkdir()
    shutil.copy(TAPES / "flag_42043.tape", d / "old" / "engine-9.tape")  # subdirectories: ignored
    return d


def comparable(report: FleetReport) -> list[object]:
    return [(r.engine, r.findings, r.summary, r.error) for r in report.tapes]


def test_tapes_in_natural_order_and_one_row_per_engine(fleet: Path) -> None:
    assert [Path(p).name for p in find_tapes(fleet)] == [
        "engine-0.tape",
        "engine-1.tape",
        "engine-2.tape",
        "engine-10.tape",
    ]
    report = fleet_postmortem(fleet, jobs=1)
    s = report.summary
    assert (s.tapes, s.ok, s.failed, s.unreadable) == (4, 2, 2, 0)
    assert list(s.engines) == ["engine-0", "engine-1", "engine-2", "engine-10"]
    # Each row's counts are that tape's own postmortem.
    for name, row in s.engines.items():
        alone = postmortem(fleet / f"{name}.tape").summary
        assert (row.errors, row.warnings, row.counts, row.num_events) == (
            alone.errors,
            alone.warnings,
            alone.counts,
            alone.num_events,
        )
    assert s.errors == sum(r.errors for r in s.engines.values()) == 4
    assert s.counts["post_resume_token_dropped"] == 1 and s.counts["fresh_frame_dropped"] == 1
    assert s.ended == {"complete": 3, "truncated": 1}
    assert s.engines["engine-1"].first_error.startswith("post_resume_token_dropped: ")  # type: ignore[union-attr]
    assert not report.ok


def test_a_tape_that_stops_mid_run_says_where(fleet: Path) -> None:
    row = fleet_postmortem(fleet, jobs=1).summary.engines["engine-2"]
    tape = load_tape(fleet / "engine-2.tape")
    last_seq = len(tape) - 1
    assert verify(tape).ok  # what it holds replays
    assert row.ended == "truncated" and row.errors == 0 and row.warnings == 1
    assert row.last_seq == last_seq
    assert row.where.startswith(f"stopped mid-run at event {last_seq} after step ")
    assert "3 request(s) unfinished" in row.where


def test_worker_processes_give_the_same_report(fleet: Path) -> None:
    serial = fleet_postmortem(fleet, jobs=1)
    pooled = fleet_postmortem(fleet, jobs=2)
    assert comparable(pooled) == comparable(serial)
    assert pooled.summary == serial.summary
    assert all(r.cpu_s > 0 for r in pooled.tapes)


def test_progress_counts_the_tapes(fleet: Path) -> None:
    seen: list[int] = []
    fleet_postmortem(fleet, jobs=2, progress=seen.append)
    assert seen == [1, 2, 3, 4]


def test_a_tape_that_cannot_be_opened_is_a_row_too(fleet: Path, tmp_path: Path) -> None:
    shutil.copy(fleet / "engine-0.tape", tmp_path / "a.tape")
    (tmp_path / "b.tape").write_text("not a tape")
    report = fleet_postmortem(tmp_path, jobs=2)
    row = report.summary.engines["b"]
    assert row.ended == "unreadable" and "not a tokentape tape" in row.where
    assert (report.summary.failed, report.summary.unreadable) == (1, 1) and not report.ok
    assert report.tapes[1].error is not None and report.tapes[1].summary is None


def test_an_empty_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tapes here"):
        fleet_postmortem(tmp_path)


# -- the CLI ---------------------------------------------------------------------------------


def test_cli_json_has_the_tapes_and_a_summary_per_engine(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["postmortem", str(fleet), "--json", "--jobs", "2"]) == 1  # error findings
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"tapes", "summary"}
    assert doc["summary"]["tapes"] == 4 and doc["summary"]["failed"] == 2
    assert [t["engine"] for t in doc["tapes"]] == ["engine-0", "engine-1", "engine-2", "engine-10"]
    engines = doc["summary"]["engines"]
    assert engines["engine-1"]["counts"] == {
        "post_resume_token_dropped": 1,
        "token_shifted": 1,
        "count_nonzero_at_finish": 1,
        "placeholders_left_over": 1,
    }
    assert engines["engine-2"]["ended"] == "truncated" and engines["engine-0"]["errors"] == 0
    assert doc["tapes"][1]["findings"][0]["bug_class"] == "vllm#42043"
    # The same document as the library's.
    report = msgspec.convert(doc, FleetReport)
    assert comparable(report) == comparable(fleet_postmortem(fleet, jobs=1))


def test_cli_text_and_a_clean_fleet_exits_0(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["postmortem", str(fleet), "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"fleet {fleet}: 4 tapes, 2 without errors, 2 with errors, 0 unreadable")
    lines: dict[str, str] = {}
    for line in out.splitlines():
        if line.startswith("engine-"):
            lines.setdefault(line.split()[0], line)  # the engine's row, before its findings
    assert "truncated" in lines["engine-2"] and "stopped mid-run at event" in lines["engine-2"]
    assert "[error] post_resume_token_dropped" in out
    clean = tmp_path / "clean"
    clean.mkdir()
    for i, name in enumerate(["clean_epoch_storm", "clean_epoch_pause_resume"]):
        shutil.copy(TAPES / f"{name}.tape", clean / f"engine-{i}.tape")
    assert main(["postmortem", str(clean)]) == 0
    assert "2 without errors, 0 with errors" in capsys.readouterr().out


def test_cli_unreadable_tape_exits_2_after_the_report(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(fleet / "engine-0.tape", tmp_path / "engine-0.tape")
    (tmp_path / "engine-1.tape").write_bytes(b"junk")
    assert main(["postmortem", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["summary"]["unreadable"] == 1  # the report came first
    (line,) = captured.err.splitlines()
    assert line.startswith(f"error: {tmp_path / 'engine-1.tape'}: cannot be opened")


def test_cli_refusals(fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["postmortem", str(tmp_path)]) == 2  # no tapes
    assert "no tapes here" in capsys.readouterr().err
    assert main(["postmortem", str(fleet / "engine-0.tape"), "--jobs", "2"]) == 2
    assert "apply to a directory" in capsys.readouterr().err
    assert main(["postmortem", str(fleet), "--jobs", "0"]) == 2
    assert "--jobs: must be >= 1" in capsys.readouterr().err
    assert main(["postmortem", "--help"]) == 0
    out = capsys.readouterr().out
    for fragment in ("TAPE|DIR", "--jobs", "--ray", "a row per", "engine"):
        assert fragment in out


def test_html_has_a_row_per_engine_and_escapes_names(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("engine-0", "engine-1"):
        shutil.copy(fleet / f"{name}.tape", tmp_path / f"{name}.tape")
    shutil.copy(fleet / "engine-2.tape", tmp_path / '<img src=x onerror="alert(1)">.tape')
    page_path = tmp_path / "fleet.html"
    assert main(["postmortem", str(tmp_path), "--html", str(page_path)]) == 1
    assert f"report: {page_path}" in capsys.readouterr().out
    page = page_path.read_text()
    assert page.count("<tr class=") == 3  # a row per engine
    assert "<img src=x" not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page
    assert 'data-engine="engine-1"' in page and "post_resume_token_dropped" in page
    assert "truncated" in page and "stopped mid-run at event" in page
    assert "<script" not in page and "http://" not in page and "https://" not in page
    report = fleet_postmortem(tmp_path, jobs=1)
    assert render_fleet_report(report) == page


def test_cli_ray_starts_and_stops_its_own_instance(fleet: Path) -> None:
    """Without a Ray instance at hand (a fresh process, no RAY_ADDRESS), --ray starts a local
    one of --jobs CPUs, and stops it."""
    pytest.importorskip("ray")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokentape.cli",
            "postmortem",
            str(fleet),
            "--ray",
            "--jobs",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = msgspec.json.decode(proc.stdout, type=FleetReport)
    assert comparable(report) == comparable(fleet_postmortem(fleet, jobs=1))
