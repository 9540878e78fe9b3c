"""Every read command on tapes it cannot read or that contradict themselves: one `error:` line
and exit 2 (never a traceback), consistency checks before diff and in the postmortem, where a
truncated tape ends, and text output safe for a terminal whatever the tape holds."""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from tokentape import LLM, SamplingParams, cli
from tokentape.events import schema as ev
from tokentape.events.sqlite_store import make_self_contained
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape, verify
from tokentape.replay.render import safe_text

_TRIGGERS = (
    "events_no_update",
    "events_no_delete",
    "events_append_only",
    "meta_no_update",
    "meta_no_delete",
    "meta_append_only",
)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with chunked prefill, KV-pressure preemptions, spec decoding and async steps."""
    path = tmp_path_factory.mktemp("readers") / "good.tape"
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
    make_self_contained(path)
    return path


def edited(src: Path, dst: Path, *sql: str | tuple[str, tuple[object, ...]]) -> Path:
    """A copy of a tape changed by SQL, its append-only triggers dropped first."""
    shutil.copy(src, dst)
    conn = sqlite3.connect(dst)
    for name in _TRIGGERS:
        conn.execute(f"DROP TRIGGER IF EXISTS {name}")
    for statement in sql:
        text, params = (statement, ()) if isinstance(statement, str) else statement
        conn.execute(text, params)
    conn.commit()
    conn.close()
    return dst


def nth_seq(tape: Path, kind: str, n: int) -> int:
    conn = sqlite3.connect(f"file:{tape}?mode=ro", uri=True)
    try:
        (seq,) = conn.execute(
            "SELECT seq FROM events WHERE kind = ? ORDER BY seq LIMIT 1 OFFSET ?", (kind, n)
        ).fetchone()
    finally:
        conn.close()
    return int(seq)


def reencoded(
    tape: Path, seq: int, change: Callable[[ev.Event], ev.Event]
) -> tuple[str, tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{tape}?mode=ro", uri=True)
    (data,) = conn.execute("SELECT data FROM events WHERE seq = ?", (seq,)).fetchone()
    conn.close()
    return "UPDATE events SET data = ? WHERE seq = ?", (ev.encode(change(ev.decode(data))), seq)


def header_edit(tape: Path, **changes: object) -> tuple[str, tuple[object, ...]]:
    header = load_tape(tape).header
    return "UPDATE meta SET value = ? WHERE key = 'header'", (
        ev.encode_header(msgspec.structs.replace(header, **changes)),
    )


# Each read command, as argv with TAPE for the damaged tape (diff compares it with the good one).
READERS: dict[str, list[str]] = {
    "inspect": ["inspect", "TAPE"],
    "debug": ["debug", "TAPE"],
    "diff": ["diff", "TAPE", "GOOD"],
    "export": ["export", "TAPE", "--format", "jsonl"],
    "postmortem --json": ["postmortem", "TAPE", "--json"],
    "postmortem --html": ["postmortem", "TAPE", "--html", "HTML"],
    "replay verify": ["replay", "verify", "TAPE"],
}


def run_reader(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reader: str,
    tape: Path,
    good: Path,
    tmp_path: Path,
) -> tuple[int, str, str]:
    subs = {"TAPE": str(tape), "GOOD": str(good), "HTML": str(tmp_path / f"{tape.stem}.html")}
    monkeypatch.setattr("sys.stdin", io.StringIO("continue\nrequests\n"))
    rc = cli.main([subs.get(a, a) for a in READERS[reader]])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_error_line(rc: int, err: str, *fragments: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)


# -- unreadable tapes: exit 2, one line ------------------------------------------------------


UNREADABLE = {
    "NULL payload": (
        lambda good: ("UPDATE events SET data = NULL WHERE seq = 20",),
        "event data is NULL, not an encoded event",
    ),
    "text payload": (
        lambda good: ("UPDATE events SET data = 'hello' WHERE seq = 20",),
        "event data is str 'hello'",
    ),
    "number payload": (
        lambda good: ("UPDATE events SET data = 42 WHERE seq = 20",),
        "event data is int '42'",
    ),
    "garbage payload": (
        lambda good: (("UPDATE events SET data = ? WHERE seq = 20", (b"\xc1\x00",)),),
        "event cannot be decoded",
    ),
    "events missing": (lambda good: ("DELETE FROM events WHERE seq = 20",), "events are missing"),
    "newer format in the header": (
        lambda good: (header_edit(good, format_version=99),),
        "tape format version 99 is newer",
    ),
    "newer format in meta": (
        lambda good: ("UPDATE meta SET value = 99 WHERE key = 'format_version'",),
        "tape format version 99 is newer",
    ),
    "absurd KV pool in the header": (
        lambda good: (
            header_edit(good, config={**load_tape(good).header.config, "num_kv_blocks": 10**12}),
        ),
        "num_kv_blocks 1000000000000 is not in 1..",
    ),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("damage", list(UNREADABLE))
def test_an_unreadable_tape_is_one_error_line_and_exit_2(
    monkeypatch,
    capsys,
    tmp_path,
    good,  # type: ignore[no-untyped-def]
    reader: str,
    damage: str,
) -> None:
    sql, message = UNREADABLE[damage]
    bad = edited(good, tmp_path / "bad.tape", *sql(good))
    rc, out, err = run_reader(monkeypatch, capsys, reader, bad, good, tmp_path)
    assert_one_error_line(rc, err, message)


@pytest.mark.parametrize("reader", list(READERS))
def test_a_truncated_file_and_a_file_that_is_not_a_tape(
    monkeypatch,
    capsys,
    tmp_path,
    good,  # type: ignore[no-untyped-def]
    reader: str,
) -> None:
    cut = tmp_path / "cut.tape"
    cut.write_bytes(good.read_bytes()[:20_000])
    rc, _, err = run_reader(monkeypatch, capsys, reader, cut, good, tmp_path)
    assert_one_error_line(rc, err, str(cut))
    junk = tmp_path / "junk.tape"
    junk.write_text("not a tape\n")
    rc, _, err = run_reader(monkeypatch, capsys, reader, junk, good, tmp_path)
    assert_one_error_line(rc, err, "not a tokentape tape")


def test_a_damaged_tape_still_gets_the_postmortem_of_its_readable_part(
    monkeypatch, capsys, tmp_path, good
) -> None:  # type: ignore[no-untyped-def]
    bad = edited(good, tmp_path / "bad.tape", "UPDATE events SET data = NULL WHERE seq = 20")
    rc, out, err = run_reader(monkeypatch, capsys, "postmortem --json", bad, good, tmp_path)
    assert_one_error_line(rc, err, "the tape cannot be read from event 20 on")
    doc = json.loads(out)
    assert doc["summary"]["num_events"] == 20 and not doc["summary"]["complete"]
    assert [f["kind"] for f in doc["findings"]] == ["tape_damaged"]


# -- tapes that contradict themselves ----------------------------------------------------------


def inconsistent(good: Path, tmp_path: Path, how: str) -> Path:
    bad = tmp_path / f"{how}.tape"
    if how == "frame deleted, rows renumbered":
        seq = nth_seq(good, "FrameProduced", 3)
        return edited(
            good,
            bad,
            f"DELETE FROM events WHERE seq = {seq}",
            f"UPDATE events SET seq = seq - 1 WHERE seq > {seq}",
        )
    if how == "two frames swapped":
        a, b = nth_seq(good, "FrameProduced", 4), nth_seq(good, "FrameProduced", 5)
        return edited(
            good,
            bad,
            f"UPDATE events SET seq = -1 WHERE seq = {a}",
            f"UPDATE events SET seq = {a} WHERE seq = {b}",
            f"UPDATE events SET seq = {b} WHERE seq = -1",
        )
    if how == "an entry claims 10^12 tokens":
        seq = nth_seq(good, "StepScheduled", 5)

        def claim(e: ev.Event) -> ev.Event:
            assert isinstance(e, ev.StepScheduled)
            first = msgspec.structs.replace(e.entries[0], num_new_tokens=10**12)
            return ev.StepScheduled(e.step, [first, *e.entries[1:]])

        return edited(good, bad, reencoded(good, seq, claim))
    if how == "header policy disagrees with its config":
        return edited(good, bad, header_edit(good, discard_policy="flag"))
    raise AssertionError(how)


INCONSISTENT = (
    "frame deleted, rows renumbered",
    "two frames swapped",
    "an entry claims 10^12 tokens",
    "header policy disagrees with its config",
)


@pytest.mark.parametrize("how", INCONSISTENT)
def test_diff_checks_each_tape_first(monkeypatch, capsys, tmp_path, good, how: str) -> None:  # type: ignore[no-untyped-def]
    bad = inconsistent(good, tmp_path, how)
    # The client-visible outputs are untouched: without the check, diff said "identical".
    for args in (["diff", str(bad), str(good)], ["diff", str(good), str(bad)]):
        rc = cli.main(args)
        assert_one_error_line(rc, capsys.readouterr().err, f"{bad} is not internally consistent")
    assert cli.main(["diff", str(good), str(good)]) == 0


@pytest.mark.parametrize("how", INCONSISTENT)
def test_postmortem_runs_verify_and_reports_where_it_fails(
    capsys, tmp_path, good, how: str
) -> None:  # type: ignore[no-untyped-def]
    bad = inconsistent(good, tmp_path, how)
    result = verify(bad)
    assert not result.ok and result.first_divergence is not None
    report = postmortem(bad)
    assert not report.ok
    kinds = {f.kind for f in report.findings}
    # Each case is named: the fold refuses the event, or the replay shows what it should be.
    assert kinds & {"tape_inconsistent", "replay_diverged", "output_mismatch"}, report.findings
    if how in ("an entry claims 10^12 tokens", "header policy disagrees with its config"):
        # The fold accepts these: only verify's checks see them.
        (f,) = report.findings
        assert f.kind == "replay_diverged" and f.severity == "error"
        assert "the tape does not replay" in f.message
        if how.startswith("an entry"):
            assert "+1000000000000@" in f.message and f.seq == result.first_divergence.seq
        else:
            assert "its discard policy is 'flag' but its engine config's is 'epoch'" in f.message
    assert cli.main(["postmortem", str(bad)]) == 1
    assert cli.main(["replay", "verify", str(bad)]) == 1
    capsys.readouterr()


def test_events_after_an_engine_error_do_not_verify(tmp_path: Path, good: Path) -> None:
    tape = load_tape(good)
    from tokentape.events.store import MemoryTape

    out = MemoryTape(tape.header)
    events = [e for _, e in tape.events()]
    for event in events[:30]:
        out.append(event)
    out.append(ev.EngineError(events[29].step, "RuntimeError", "device lost"))
    assert verify(out).ok and verify(out).ended_with_error == "RuntimeError: device lost"
    out.append(events[30])
    result = verify(out)
    assert not result.ok and result.first_divergence is not None
    assert "follows the EngineError" in result.first_divergence.message


# -- where a truncated tape ends ---------------------------------------------------------------


_KILLED_RUN = """
import os, signal, sys
from tokentape import LLM, SamplingParams
llm = LLM(model="oracle", tape=sys.argv[1], pipeline_depth=3, block_size=4, num_kv_blocks=64)
for i in range(4):
    llm.llm_engine.add_request(f"r{i}", list(range(5 + i, 20 + i)), SamplingParams(max_tokens=40))
for _ in range(12):
    llm.llm_engine.step()
# what was committed is in the file (the writer would finish it anyway)
llm.llm_engine.engine_core.tape.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_postmortem_says_where_a_killed_run_ends(tmp_path: Path) -> None:
    path = tmp_path / "killed.tape"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(path)], capture_output=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr
    tape = load_tape(path)
    last_seq, last = list(tape.events())[-1]
    assert verify(path).ok  # what was committed replays
    report = postmortem(path)
    # A warning (the tape alone cannot say who died); read to its end, the run incomplete.
    assert report.summary.read_to_end and not report.summary.complete and report.ok
    (f,) = report.findings
    assert f.kind == "tape_truncated" and f.severity == "warning"
    assert sorted(f.request_ids) == ["r0", "r1", "r2", "r3"]
    assert f.seq == last_seq and f.message.startswith(
        f"the tape ends at event {last_seq} ({ev.kind_of(last)} of step {last.step}) after step 11 "
        "was scheduled, with 4 request(s) unfinished; the frames of step(s) 10, 11 never recorded"
    )
    assert "the engine process or its tape writer was killed" in f.message


def test_a_run_that_finished_is_not_truncated(good: Path) -> None:
    assert postmortem(good).findings == []


# -- text safe for a terminal ------------------------------------------------------------------


EVIL = "r\x1b[2J\x1b]0;owned\x07\u202egnp.exe\x9b31m"


@pytest.fixture(scope="module")
def evil(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tape whose request id holds terminal escape sequences and a bidi override, recorded
    under the flag policy so that the postmortem has findings naming it."""
    path = tmp_path_factory.mktemp("evil") / "evil.tape"
    llm = LLM(
        model="oracle-random",
        tape=path,
        pipeline_depth=2,
        discard_policy="flag",
        block_size=4,
        num_kv_blocks=64,
    )
    llm.llm_engine.add_request(
        EVIL, list(range(10, 30)), SamplingParams(max_tokens=20, ignore_eos=True)
    )
    for _ in range(10):
        llm.llm_engine.step()
    llm.llm_engine.pause_generation("keep", clear_cache=True)
    llm.llm_engine.resume_generation()
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    llm.close()
    return path


def test_safe_text_escapes_what_drives_a_terminal() -> None:
    assert safe_text(EVIL) == "r\\x1b[2J\\x1b]0;owned\\x07\\u202egnp.exe\\x9b31m"
    assert (
        safe_text("tabs\tand\nnewlines stay, é and 中 too")
        == "tabs\tand\nnewlines stay, é and 中 too"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "TAPE"],
        ["inspect", "TAPE", "--request", EVIL],
        ["postmortem", "TAPE"],
        ["debug", "TAPE"],
        ["diff", "TAPE", "OTHER"],
        ["replay", "verify", "EDITED"],
    ],
)
def test_text_output_never_passes_escapes_through(
    monkeypatch, capsys, tmp_path, evil, argv
) -> None:  # type: ignore[no-untyped-def]
    other = tmp_path / "other.tape"
    if "OTHER" in argv:  # the same request under epoch: the outputs differ, the report names it
        from tokentape.replay import whatif

        whatif(evil, discard_policy="epoch", out=str(other))
    if "EDITED" in argv:  # verify prints the events around its divergence

        def more(e: ev.Event) -> ev.Event:
            assert isinstance(e, ev.StepScheduled)
            return ev.StepScheduled(
                e.step, [msgspec.structs.replace(e.entries[0], num_new_tokens=99)]
            )

        edited(
            evil, tmp_path / "edited.tape", reencoded(evil, nth_seq(evil, "StepScheduled", 3), more)
        )
    monkeypatch.setattr(
        "sys.stdin",
        io.StringIO(
            "requests\nevents 0-12\nnext FrameProduced\nprint req "
            + EVIL
            + "\nwhere\ndiff\nbreak req=nope\n"
        ),
    )
    paths = {"TAPE": str(evil), "OTHER": str(other), "EDITED": str(tmp_path / "edited.tape")}
    rc = cli.main([paths.get(a, a) for a in argv])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert rc in (0, 1, 2) and "Traceback" not in text
    for bad in ("\x1b", "\x07", "\u202e", "\x9b"):
        assert bad not in text, (argv, bad)
    assert "r\\x1b[2J" in text  # shown, escaped


def test_json_output_keeps_the_exact_request_id(capsys, evil) -> None:  # type: ignore[no-untyped-def]
    assert cli.main(["inspect", str(evil), "--json"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)["requests"]] == [EVIL]
    assert cli.main(["postmortem", str(evil), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert {r for f in doc["findings"] for r in f["request_ids"]} == {EVIL}


def test_an_error_message_from_the_tape_is_made_safe(capsys, tmp_path, evil) -> None:  # type: ignore[no-untyped-def]
    tape = load_tape(evil)
    from tokentape.events.sqlite_store import SQLiteTape

    bad = tmp_path / "bad.tape"
    out = SQLiteTape(bad, tape.header)
    for seq, event in tape.events():
        out.append(event)
        if seq == 3:
            out.append(ev.RequestFinished(event.step, EVIL + "-gone", "stop"))
    out.close()
    assert cli.main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err and "r\\x1b[2J" in err
    assert os.path.exists(bad)
