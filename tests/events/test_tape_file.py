"""The tape file: one self-contained file once closed, read-only commands that leave nothing
beside it, a WAL bounded while a reader holds a snapshot, consistent copies of a live tape,
and a writer process killed on its own, which must name the events it lost."""

from __future__ import annotations

import io
import os
import shutil
import signal
import site
import sqlite3
import subprocess
import sys
import textwrap
import time
import venv
import warnings
from pathlib import Path

import pytest

from tokentape import LLM, SamplingParams, cli
from tokentape.events import schema as ev
from tokentape.events import sqlite_store, sqlite_writer
from tokentape.events.sqlite_store import (
    SQLiteTape,
    SQLiteTapeReader,
    TapeWarning,
    TapeWriterError,
    copy_tape,
    tape_file_status,
)
from tokentape.events.store import TapeError
from tokentape.replay import load_tape, verify

# -- helpers -------------------------------------------------------------------------------


def record(path: Path, n_requests: int = 6, max_tokens: int = 24) -> LLM:
    """A finished run on an open tape (the caller closes it)."""
    llm = LLM(
        model="oracle",
        tape=path,
        max_num_seqs=4,
        num_kv_blocks=24,
        block_size=4,
        num_speculative_tokens=1,
    )
    llm.generate(
        [f"prompt {i} " * (1 + i % 3) for i in range(n_requests)],
        SamplingParams(max_tokens=max_tokens),
    )
    return llm


def encoded_events(path: Path) -> list[bytes]:
    reader = SQLiteTapeReader(path)
    try:
        return [ev.encode(e) for _, e in reader.iter_events()]
    finally:
        reader.close()


def files(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def copied_alone(path: Path, folder: Path) -> Path:
    """The .tape file copied by itself, as a CI job that uploads it would."""
    folder.mkdir()
    return Path(shutil.copy(path, folder / path.name))


def wal_mode_copy(src: Path, dst: Path) -> None:
    """A closed tape in WAL mode with no -wal beside it: what tokentape wrote before closed
    tapes went back to a rollback journal (and what copying a WAL-mode tape alone gives)."""
    shutil.copy(src, dst)
    conn = sqlite3.connect(dst)
    assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    conn.close()  # the last connection: SQLite checkpoints and removes the -wal
    assert tape_file_status(dst).journal_mode == "wal" and files(dst.parent) == [dst.name]


# -- 1. a closed tape is one file ------------------------------------------------------------


def test_a_closed_tape_is_one_self_contained_file(tmp_path: Path) -> None:
    path = tmp_path / "run" / "run.tape"
    path.parent.mkdir()
    llm = record(path)
    n = len(llm.llm_engine.engine_core.tape)
    llm.close()
    assert files(path.parent) == ["run.tape"]
    status = tape_file_status(path)
    assert status.finished and status.self_contained and status.journal_mode == "rollback"
    alone = copied_alone(path, tmp_path / "elsewhere")
    assert encoded_events(alone) == encoded_events(path) and len(encoded_events(alone)) == n
    assert verify(alone).ok


COMMANDS = {
    "reader": None,
    "inspect": ["inspect", "{tape}"],
    "inspect-step": ["inspect", "{tape}", "--step", "3", "--json"],
    "verify": ["replay", "verify", "{tape}"],
    "postmortem-json": ["postmortem", "{tape}", "--json"],
    "postmortem-html": ["postmortem", "{tape}", "--html", "{out}/report.html"],
    "debug": ["debug", "{tape}"],
    "diff": ["diff", "{tape}", "{tape}"],
    "export-jsonl": ["export", "{tape}", "--format", "jsonl"],
    "export-perfetto": ["export", "{tape}", "--format", "perfetto", "-o", "{out}/t.json"],
    "export-sqlite": ["export", "{tape}", "--format", "sqlite", "-o", "{out}/copy.tape"],
}


@pytest.fixture(scope="module")
def closed_tape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("closed") / "run.tape"
    record(path).close()
    return path


@pytest.mark.parametrize("kind", ["rollback", "wal-without-wal-file"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_read_only_commands_leave_nothing_beside_a_closed_tape(
    command: str,
    kind: str,
    closed_tape: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder, out = tmp_path / "tape", tmp_path / "out"
    folder.mkdir()
    out.mkdir()
    tape = folder / "run.tape"
    if kind == "rollback":
        shutil.copy(closed_tape, tape)
    else:
        wal_mode_copy(closed_tape, tape)
    before = files(folder)
    argv = COMMANDS[command]
    if argv is None:
        reader = SQLiteTapeReader(tape)
        assert sum(1 for _ in reader.iter_events()) == len(reader) > 0
        reader.close()
    else:
        monkeypatch.setattr(
            sys, "stdin", io.StringIO("step 5\nprint req 0\ngoto end\nback 2\nquit\n")
        )
        rc = cli.main([a.format(tape=tape, out=out) for a in argv])
        capsys.readouterr()
        assert rc == 0, command
    assert files(folder) == before == ["run.tape"]


# -- 2. readers and the WAL ------------------------------------------------------------------


def test_the_reader_holds_no_snapshot_between_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokentape.events import sqlite_reader

    monkeypatch.setattr(sqlite_reader, "_READ_BATCH", 16)
    path = tmp_path / "live.tape"
    llm = LLM(model="oracle", tape=path, max_num_seqs=2)
    engine = llm.llm_engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(20):
        engine.step()
    engine.engine_core.tape.flush()
    reader = SQLiteTapeReader(path)
    events = reader.iter_events()
    for _ in range(20):  # into the second batch: the generator is suspended between two reads
        next(events)
    while engine.has_unfinished_requests():
        engine.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TapeWarning)  # the writer got everything into the file
        llm.close()
    rest = sum(1 for _ in events)  # the reader goes on where it was
    reader.close()
    assert 20 + rest == len(engine.engine_core.tape)
    assert tape_file_status(path).self_contained
    alone = copied_alone(path, tmp_path / "elsewhere")
    assert len(encoded_events(alone)) == len(engine.engine_core.tape)


def _run_with_a_pinned_reader(path: Path, release_before_close: bool) -> tuple[int, int, float]:
    """A run of ~30k events while another connection holds a read transaction opened at
    its start (and is closed before the tape, or after). Returns (events, WAL bytes at the
    end of the run, close() seconds)."""
    llm = LLM(model="oracle", tape=path, max_num_seqs=1)
    llm.llm_engine.engine_core.tape.flush()
    pin = sqlite3.connect(path, isolation_level=None)
    pin.execute("BEGIN")
    assert pin.execute("SELECT COUNT(*) FROM events").fetchone() == (0,)
    llm.generate(
        [[3 + i, 5, 7] for i in range(96)], SamplingParams(max_tokens=100, ignore_eos=True)
    )
    wal = os.path.getsize(f"{path}-wal")  # only grows while pinned: this is its peak
    n = len(llm.llm_engine.engine_core.tape)
    if release_before_close:
        pin.execute("COMMIT")
        pin.close()
    t0 = time.monotonic()
    try:
        llm.close()
    finally:
        close_s = time.monotonic() - t0
        pin.close()
    return n, wal, close_s


def test_a_reader_holding_a_snapshot_bounds_the_wal_and_close(tmp_path: Path) -> None:
    path = tmp_path / "pinned.tape"
    with pytest.warns(TapeWarning, match=r"reader held a snapshot .* only in .*pinned\.tape-wal"):
        n, wal, close_s = _run_with_a_pinned_reader(path, release_before_close=False)
    assert n > 25_000
    data = sum(len(e) for e in encoded_events(path))  # the WAL holds the run: read through it
    # Commits come at most every COMMIT_INTERVAL_S, so the WAL stays near the data's size
    # (one transaction per step wrote ~27x the data here: 150 MB for 100k events).
    assert wal < 4 * data + (1 << 20), (wal, data)
    assert close_s < sqlite_writer.FINISH_WAIT_S + 3.0
    # The pinning reader was the last connection: closing it checkpointed the WAL.
    assert tape_file_status(path).self_contained
    sqlite_store.make_self_contained(path)
    assert files(tmp_path) == ["pinned.tape"] and len(encoded_events(path)) == n


def test_a_reader_gone_before_close_leaves_one_file(tmp_path: Path) -> None:
    path = tmp_path / "released.tape"
    with warnings.catch_warnings():
        warnings.simplefilter("error", TapeWarning)
        n, _, close_s = _run_with_a_pinned_reader(path, release_before_close=True)
    assert files(tmp_path) == ["released.tape"] and tape_file_status(path).finished
    assert close_s < sqlite_writer.FINISH_WAIT_S
    assert len(encoded_events(copied_alone(path, tmp_path / "elsewhere"))) == n


def test_an_idle_reader_connected_at_close_gets_the_events_into_the_file(tmp_path: Path) -> None:
    """A reader connected but not reading (a debugger left open on the live tape) lets the
    checkpoint finish; only the switch back to a rollback journal needs it gone, and close()
    waits FINISH_WAIT_S for that, then leaves the tape in WAL mode, complete in its file."""
    path = tmp_path / "watched.tape"
    llm = record(path)
    reader = SQLiteTapeReader(path)
    assert len(reader) == len(llm.llm_engine.engine_core.tape)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TapeWarning)
        llm.close()
    assert time.monotonic() - t0 < sqlite_writer.FINISH_WAIT_S + 3.0
    status = tape_file_status(path)
    assert status.journal_mode == "wal" and status.self_contained and status.wal_bytes == 0
    assert len(encoded_events(copied_alone(path, tmp_path / "elsewhere"))) == len(reader)
    reader.close()


# -- 3. copies of a live tape ----------------------------------------------------------------


def test_copy_a_live_tape_into_one_file(tmp_path: Path) -> None:
    path, out = tmp_path / "live.tape", tmp_path / "copies"
    out.mkdir()
    llm = LLM(
        model="oracle",
        tape=path,
        max_num_seqs=4,
        num_kv_blocks=16,
        block_size=4,
        num_speculative_tokens=2,
    )
    engine = llm.llm_engine
    for i in range(8):
        engine.add_request(f"r{i}", [3 + i, 4, 5, 6], SamplingParams(max_tokens=40))
    for _ in range(30):
        engine.step()
    engine.engine_core.tape.flush()
    committed = len(engine.engine_core.tape)
    for _ in range(5):
        engine.step()  # more, perhaps committed: the copy is a snapshot at some commit
    n = copy_tape(path, out / "copy.tape")
    assert committed <= n <= len(engine.engine_core.tape)
    assert files(out) == ["copy.tape"] and tape_file_status(out / "copy.tape").finished
    assert encoded_events(out / "copy.tape") == encoded_events(path)[:n]
    result = verify(out / "copy.tape")
    assert result.ok and result.num_events == n
    assert load_tape(out / "copy.tape").fold().num_events == n
    conn = sqlite3.connect(out / "copy.tape")
    triggers = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
    assert triggers == {
        f"{t}_{k}" for t in ("events", "meta") for k in ("no_update", "no_delete", "append_only")
    }
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute("UPDATE events SET step = 0")
    conn.close()
    with pytest.raises(FileExistsError):
        copy_tape(path, out / "copy.tape")
    llm.close()
    (tmp_path / "junk.tape").write_bytes(b"not a tape at all" * 10)
    with pytest.raises(TapeError, match="not an SQLite file"):
        copy_tape(tmp_path / "junk.tape", out / "junk-copy.tape")
    assert files(out) == ["copy.tape"]


# -- 4. the writer process killed on its own -------------------------------------------------


def _recording_appends(tape: SQLiteTape, monkeypatch: pytest.MonkeyPatch) -> list[ev.Event]:
    log: list[ev.Event] = []
    append = tape.append

    def recording(event: ev.Event) -> None:
        log.append(event)
        append(event)

    monkeypatch.setattr(tape, "append", recording)
    return log


def test_a_killed_writer_names_the_lost_events_and_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "lost.tape"
    llm = LLM(model="oracle", tape=path, max_num_seqs=4)
    engine = llm.llm_engine
    tape = engine.engine_core.tape
    assert isinstance(tape, SQLiteTape)
    log = _recording_appends(tape, monkeypatch)
    for i in range(4):
        engine.add_request(f"r{i}", [3 + i, 4, 5], SamplingParams(max_tokens=500, ignore_eos=True))
    for _ in range(10):
        engine.step()
    tape.flush()
    committed_before = len(tape)
    os.kill(
        tape.writer_pid, signal.SIGSTOP
    )  # it reads nothing more: what follows stays in the pipe
    for _ in range(12):
        engine.step()
    os.kill(tape.writer_pid, signal.SIGKILL)
    with pytest.raises(TapeWriterError) as info:
        for _ in range(500):  # the kill lands asynchronously; a write after it fails
            engine.step()
            time.sleep(0.005)
    err = info.value
    assert err.committed is not None and committed_before <= err.committed < len(log)
    assert err.lost == range(err.committed, err.lost.stop) and len(err.lost) > 0
    lost_events = log[err.lost.start : err.lost.stop]
    assert err.lost_steps == tuple(sorted({e.step for e in lost_events}))
    first, last = err.lost_steps[0], err.lost_steps[-1]
    assert (
        f"events {err.lost.start}-{err.lost.stop - 1} ({len(err.lost)} of {err.lost.stop})"
        in str(err)
    )
    assert f"of steps {first}-{last}" in str(err) and "exit code -9" in str(err)
    llm.close()
    # The file: one file, every committed event as appended, then the error that ended it.
    assert files(tmp_path) == ["lost.tape"] and tape_file_status(path).finished
    on_file = encoded_events(path)
    assert on_file[:-1] == [ev.encode(e) for e in log[: err.committed]]
    last_event = ev.decode(on_file[-1])
    assert isinstance(last_event, ev.EngineError) and last_event.error_type == "TapeWriterError"
    assert last_event.message == err.message
    result = verify(path)
    assert result.ok and result.num_events == err.committed + 1
    assert result.ended_with_error is not None and "never committed" in result.ended_with_error


def test_a_writer_killed_with_nothing_pending_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "nothing-lost.tape"
    llm = record(path)
    n = len(llm.llm_engine.engine_core.tape)
    os.kill(
        llm.llm_engine.engine_core.tape.writer_pid, signal.SIGKILL
    )  # everything was flushed by generate
    with pytest.raises(
        TapeWriterError, match=rf"no event was lost: the tape holds all {n}"
    ) as info:
        llm.close()
    assert info.value.committed == n and not info.value.lost
    assert files(tmp_path) == ["nothing-lost.tape"] and tape_file_status(path).finished
    result = verify(path)
    assert result.ok and result.num_events == n and result.ended_with_error is None


def test_the_engine_keeps_only_what_the_writer_has_not_confirmed(tmp_path: Path) -> None:
    tape = SQLiteTape(tmp_path / "trim.tape", load_tape(_small_tape(tmp_path)).header)
    every = sqlite_store._TRIM_EVERY
    for i in range(3 * every):
        tape.append(ev.GenerationResumed(i))
        tape.commit()
    deadline = time.monotonic() + 30
    while sqlite_writer.read_ack(tape._ack) < len(tape) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sqlite_writer.read_ack(tape._ack) == len(tape)  # the writer confirmed every commit
    for i in range(every):
        tape.append(ev.GenerationResumed(i))
        tape.commit()
    assert len(tape._unconfirmed) <= every  # not the 4 * every commits made
    tape.close()


def _small_tape(tmp_path: Path) -> Path:
    path = tmp_path / "small.tape"
    record(path, n_requests=1, max_tokens=2).close()
    return path


def test_the_writer_finds_a_msgspec_that_only_pythonpath_reaches(tmp_path: Path) -> None:
    # A Python whose own site-packages is empty (a bare venv) reaches msgspec, sqlite-utils
    # and tokentape through PYTHONPATH alone, as with `pip install --target`: the writer,
    # started isolated (-I, which ignores PYTHONPATH), must still find msgspec.
    venv.create(tmp_path / "bare", with_pip=False)
    python = tmp_path / "bare" / "bin" / "python"
    reached = [str(Path(__file__).resolve().parents[2]), *site.getsitepackages()]
    small, copy = _small_tape(tmp_path), tmp_path / "copy.tape"
    script = textwrap.dedent(
        f"""
        from tokentape.events import schema as ev
        from tokentape.events.sqlite_store import SQLiteTape
        from tokentape.replay import load_tape
        tape = SQLiteTape({str(copy)!r}, load_tape({str(small)!r}).header)
        tape.append(ev.GenerationResumed(0))
        tape.commit()
        tape.close()
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(reached)}
    run = subprocess.run(
        [str(python), "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert encoded_events(copy) == [ev.encode(ev.GenerationResumed(0))]
