"""Tape stores: the SQLite tape (default) and the memory tape.

Round trips, append-only enforcement, the header, format versions, files that are not tapes,
truncated tapes, a reader in another process while the engine writes (WAL), a writer killed
with SIGKILL, and engine failures recorded on the tape.
"""

from __future__ import annotations

import hashlib
import os
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from terminal import run_in_terminal

from tokentape import LLM, SamplingParams
from tokentape.engine.config import EngineConfig, resolve_config
from tokentape.engine.factory import make_header
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.errors import EngineDeadError
from tokentape.events import schema as ev
from tokentape.events import sqlite_reader
from tokentape.events.fold_errors import ReducerError
from tokentape.events.sqlite_store import SQLiteTape, SQLiteTapeReader, tape_file_status
from tokentape.events.store import MemoryTape, TapeError, TapeFormatError
from tokentape.postmortem import postmortem
from tokentape.replay import fold, load_tape, verify

# -- helpers -------------------------------------------------------------------------------


def make_test_header(**config: object) -> ev.TapeHeader:
    cfg = EngineConfig(**config)  # type: ignore[arg-type]
    runner = OracleRunner(seed=cfg.seed)
    return make_header(resolve_config(cfg, runner), runner)


def synthetic_events(n: int) -> list[ev.Event]:
    """A mix of every kind of event (not a consistent run: the store does not care)."""
    params = SamplingParams(max_tokens=7, seed=3, stop_token_ids=(5, 6))
    out: list[ev.Event] = []
    for i in range(n):
        step = i // 7
        rid = f"req-{i % 13}"
        match i % 12:
            case 0:
                prompt = [3 + (i + j) % 200 for j in range(i % 9 + 1)]
                out.append(ev.RequestAdded(step, rid, prompt, params))
            case 1:
                entry = ev.ScheduledEntry(rid, i % 3, i, 1 + i % 4, i % 2, [i % 50])
                out.append(ev.StepScheduled(step, [entry]))
            case 2:
                out.append(ev.FrameProduced(step, [ev.FrameEntry(rid, [3 + i % 250], [4], [-0.5])]))
            case 3:
                emitted = ev.EmittedOutput(rid, [3 + i % 250], i % 5 == 0, "length")
                out.append(ev.OutputsEmitted(step, [emitted]))
            case 4:
                out.append(ev.RequestPreempted(step, rid, "kv_pressure", i % 3))
            case 5:
                out.append(ev.RequestFinished(step, rid, "stop"))
            case 6:
                out.append(ev.RequestAborted(step, rid))
            case 7:
                out.append(ev.GenerationPaused(step, "keep", True))
            case 8:
                out.append(ev.GenerationResumed(step))
            case 9:
                out.append(ev.PrefixCacheReset(step, True, i % 2 == 0))
            case 10:
                out.append(ev.WeightsUpdated(step, f"w{i}"))
            case _:
                out.append(ev.EngineError(step, "RuntimeError", f"message {i}"))
    return out


def write_tape(
    path: Path, events: list[ev.Event], header: ev.TapeHeader, commit_every: int = 50
) -> None:
    tape = SQLiteTape(path, header)
    for i, event in enumerate(events, 1):
        tape.append(event)
        if i % commit_every == 0:
            tape.commit()
    tape.close()


def record_run(tape: object, **engine_args: object) -> LLM:
    """A small but busy run: chunked prefill, preemptions under KV pressure, spec decoding."""
    args: dict[str, object] = {
        "max_num_seqs": 4,
        "num_kv_blocks": 24,
        "block_size": 4,
        "max_num_batched_tokens": 32,
        "num_speculative_tokens": 2,
    }
    args.update(engine_args)
    llm = LLM(model="oracle", tape=tape, **args)  # type: ignore[arg-type]
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(10)]
    llm.generate(prompts, SamplingParams(max_tokens=12))
    return llm


def write_big_tape(path: Path) -> int:
    llm = LLM(model="oracle", tape=path, max_num_seqs=2)
    llm.generate([f"prompt {i}" for i in range(48)], SamplingParams(max_tokens=150))
    llm.close()
    n = len(load_tape(path))
    assert n > sqlite_reader._READ_BATCH  # the reader must cross batch boundaries
    return n


def copy_with_format_version(src: Path, dst: Path, version: int) -> None:
    """A copy of a tape whose meta.format_version is `version` (the trigger is dropped in
    the copy only: the original stays append-only)."""
    src_conn = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    dst_conn = sqlite3.connect(dst)
    src_conn.backup(dst_conn)
    src_conn.close()
    dst_conn.execute("DROP TRIGGER meta_no_update")
    dst_conn.execute("UPDATE meta SET value = ? WHERE key = 'format_version'", (version,))
    dst_conn.commit()
    dst_conn.close()


def read_all(path: Path) -> list[tuple[int, ev.Event]]:
    reader = SQLiteTapeReader(path)
    try:
        return list(reader.iter_events())
    finally:
        reader.close()


# -- round trips ---------------------------------------------------------------------------


def test_sqlite_round_trip_in_order(tmp_path: Path) -> None:
    path = tmp_path / "synthetic.tape"
    events = synthetic_events(9_000)  # more than one read batch
    write_tape(path, events, make_test_header())
    reader = SQLiteTapeReader(path)
    assert len(reader) == len(events)
    pairs = list(reader.iter_events())
    assert [seq for seq, _ in pairs] == list(range(len(events)))
    assert [e for _, e in pairs] == events
    # from the middle, across a batch boundary
    start = sqlite_reader._READ_BATCH - 3
    assert [e for _, e in reader.iter_events(start)] == events[start:]
    assert list(reader.iter_events(len(events))) == []
    reader.close()


def test_sqlite_reader_streams_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "batches.tape"
    events = synthetic_events(1_000)
    write_tape(path, events, make_test_header())
    monkeypatch.setattr(sqlite_reader, "_READ_BATCH", 64)
    reader = SQLiteTapeReader(path)

    class CountingConnection:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn
            self.queries = 0

        def execute(self, *args: object) -> sqlite3.Cursor:
            self.queries += 1
            return self.conn.execute(*args)  # type: ignore[arg-type]

        def close(self) -> None:
            self.conn.close()

    counting = CountingConnection(reader._conn)
    reader._conn = counting  # type: ignore[assignment]
    it = reader.iter_events()
    first = [next(it) for _ in range(100)]
    assert [s for s, _ in first] == list(range(100))
    assert counting.queries == 2  # lazily: two batches of 64 for the first 100 events
    rest = list(it)
    assert [e for _, e in first + rest] == events
    assert counting.queries == -(-len(events) // 64) + 1  # every batch, then the empty one
    reader.close()


def test_uncommitted_events_are_invisible_to_readers(tmp_path: Path) -> None:
    path = tmp_path / "commit.tape"
    events = synthetic_events(5)
    tape = SQLiteTape(path, make_test_header())
    for e in events[:3]:
        tape.append(e)
    assert len(SQLiteTapeReader(path)) == 0
    tape.commit()  # hands the transaction to the writer process
    tape.flush()  # returns once the writer has it in the file
    assert [e for _, e in read_all(path)] == events[:3]
    tape.commit()  # nothing buffered: a no-op
    for e in events[3:]:
        tape.append(e)
    assert [e for _, e in read_all(path)] == events[:3]  # not committed: still in this process
    tape.close()  # close commits what is buffered and waits for the writer
    assert [e for _, e in read_all(path)] == events
    tape.flush()  # closed, nothing pending: a no-op
    tape.append(events[0])
    with pytest.raises(TapeError, match="the tape is closed"):
        tape.commit()


def test_header_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "header.tape"
    header = make_test_header(
        discard_policy="counter",
        pipeline_depth=3,
        num_speculative_tokens=2,
        seed=1234,
        max_model_len=77,
        block_size=8,
        num_kv_blocks=16,
    )
    SQLiteTape(path, header).close()
    reader = SQLiteTapeReader(path)
    assert reader.header == header
    assert reader.header.format_version == ev.FORMAT_VERSION
    assert len(reader) == 0 and list(reader.iter_events()) == []
    tape = load_tape(path)
    assert tape.config == EngineConfig(  # as the header holds it: resolved for the runner
        async_scheduling=True,
        discard_policy="counter",
        pipeline_depth=3,
        num_speculative_tokens=2,
        seed=1234,
        max_model_len=77,
        block_size=8,
        num_kv_blocks=16,
    )
    assert tape.header.discard_policy == "counter" and tape.header.seed == 1234


def test_engine_run_round_trips_and_verifies(tmp_path: Path) -> None:
    path = tmp_path / "run.tape"
    llm = record_run(path)
    llm.close()
    tape = load_tape(path)
    events = [e for _, e in tape.events()]
    kinds = {ev.kind_of(e) for e in events}
    assert {
        "RequestAdded",
        "StepScheduled",
        "FrameProduced",
        "OutputsEmitted",
        "RequestFinished",
        "RequestPreempted",
    } <= kinds
    assert tape.fold().num_events == len(events) == len(tape)
    result = verify(path)
    assert result.ok, result.first_divergence and result.first_divergence.format()
    assert result.num_events == len(events)


def test_sqlite_tape_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "exists.tape"
    write_tape(path, synthetic_events(20), make_test_header())
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="exists"):
        SQLiteTape(path, make_test_header())
    with pytest.raises(FileExistsError):
        LLM(model="oracle", tape=path)
    assert path.read_bytes() == before
    assert len(read_all(path)) == 20


# -- append-only ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE events SET data = x'00' WHERE seq = 1",
        "UPDATE events SET step = step + 1",
        "DELETE FROM events WHERE seq = 2",
        "DELETE FROM events",
        "UPDATE meta SET value = 99 WHERE key = 'format_version'",
        "DELETE FROM meta WHERE key = 'header'",
    ],
)
def test_append_only_enforced(tmp_path: Path, sql: str) -> None:
    path = tmp_path / "append-only.tape"
    events = synthetic_events(30)
    header = make_test_header()
    write_tape(path, events, header)
    conn = sqlite3.connect(path)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute(sql)
    conn.commit()
    conn.close()
    reader = SQLiteTapeReader(path)
    assert reader.header == header
    assert [e for _, e in reader.iter_events()] == events
    reader.close()


def test_append_only_rejects_duplicate_seq(tmp_path: Path) -> None:
    path = tmp_path / "dup.tape"
    write_tape(path, synthetic_events(5), make_test_header())
    conn = sqlite3.connect(path)
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("INSERT INTO events(seq, step, kind, data) VALUES (1, 0, 'X', x'00')")
    conn.close()


def test_append_only_rejects_insert_or_replace(tmp_path: Path) -> None:
    path = tmp_path / "replace.tape"
    events = synthetic_events(5)
    write_tape(path, events, make_test_header())
    conn = sqlite3.connect(path)
    try:
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(
                "INSERT OR REPLACE INTO events(seq, step, kind, data) VALUES (1, 0, 'X', x'00')"
            )
        conn.commit()
    finally:
        conn.close()
    assert [e for _, e in read_all(path)] == events


# -- format versions and files that are not tapes --------------------------------------------


def test_newer_format_version_refused(tmp_path: Path) -> None:
    original = tmp_path / "v1.tape"
    write_tape(original, synthetic_events(10), make_test_header())
    newer = tmp_path / "v-next.tape"
    copy_with_format_version(original, newer, ev.FORMAT_VERSION + 1)
    for open_it in (SQLiteTapeReader, load_tape, fold, verify):
        with pytest.raises(TapeFormatError) as info:
            open_it(newer)
        message = str(info.value)
        assert str(newer) in message
        assert f"version {ev.FORMAT_VERSION + 1}" in message
        assert "upgrade" in message
        assert info.value.path == str(newer)
    # the original is untouched and still reads
    assert len(read_all(original)) == 10
    # the current version and older ones are accepted
    same = tmp_path / "v-same.tape"
    copy_with_format_version(original, same, ev.FORMAT_VERSION)
    assert len(read_all(same)) == 10


def _sqlite_without_tables(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE something_else (x INTEGER)")
    conn.commit()
    conn.close()


def _sqlite_meta_without_version(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value BLOB)")
    conn.execute("INSERT INTO meta VALUES ('hello', 'world')")
    conn.commit()
    conn.close()


def _sqlite_with_bad_header(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value BLOB)")
    conn.execute("INSERT INTO meta VALUES ('format_version', 1), ('header', x'c1c1c1')")
    conn.commit()
    conn.close()


NOT_TAPES = {
    "random-bytes": lambda p: p.write_bytes(os.urandom(8192)),
    "empty-file": lambda p: p.write_bytes(b""),
    "text-file": lambda p: p.write_text("prompt one\nprompt two\n"),
    "sqlite-magic-then-garbage": lambda p: p.write_bytes(b"SQLite format 3\x00" + os.urandom(4096)),
    "sqlite-without-tables": _sqlite_without_tables,
    "sqlite-meta-without-version": _sqlite_meta_without_version,
    "sqlite-bad-header": _sqlite_with_bad_header,
}


@pytest.mark.parametrize("kind", sorted(NOT_TAPES))
def test_not_a_tape(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.tape"
    NOT_TAPES[kind](path)
    with pytest.raises(TapeError) as info:
        list(load_tape(path).events())
    assert str(path) in str(info.value)
    assert info.value.path == str(path)
    assert not isinstance(info.value, sqlite3.Error)


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_no_tape_file(tmp_path: Path, make: str) -> None:
    path = tmp_path / "nothing-here.tape"
    if make == "directory":
        path.mkdir()
    expected = (
        "not a tape: it has no segmented tape's manifest"
        if make == "directory"
        else ("no such tape file")
    )
    with pytest.raises(TapeError, match=expected) as info:
        load_tape(path)
    assert str(path) in str(info.value)


# -- truncated tapes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_tape(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("big") / "big.tape"
    return path, write_big_tape(path)


def _truncated_copy(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


@pytest.mark.parametrize("fraction", [0.5, 0.75, 0.95])
def test_truncated_tape_raises_tape_error(
    tmp_path: Path, big_tape: tuple[Path, int], fraction: float
) -> None:
    src, _ = big_tape
    path = _truncated_copy(src, tmp_path / "cut.tape", int(src.stat().st_size * fraction))
    for read in (lambda: list(load_tape(path).events()), lambda: fold(path), lambda: verify(path)):
        with pytest.raises(TapeError) as info:
            read()
        assert str(path) in str(info.value)
        assert not isinstance(info.value, sqlite3.Error)


def test_truncated_inside_the_sqlite_header(tmp_path: Path, big_tape: tuple[Path, int]) -> None:
    src, _ = big_tape
    path = _truncated_copy(src, tmp_path / "stub.tape", 50)
    with pytest.raises(TapeError) as info:
        list(load_tape(path).events())
    assert str(path) in str(info.value)


def test_truncated_tape_reads_prefix_and_names_position(
    tmp_path: Path, big_tape: tuple[Path, int]
) -> None:
    src, n = big_tape
    path = _truncated_copy(src, tmp_path / "half.tape", src.stat().st_size // 2)
    original = [e for _, e in read_all(src)]
    tape = load_tape(path)  # the header survives: the tape opens
    got = []
    with pytest.raises(TapeError) as info:
        for _seq, event in tape.events():
            got.append(event)
    assert str(path) in str(info.value)
    assert info.value.position == len(got)
    assert f"at event {len(got)}" in str(info.value)
    assert 0 < len(got) < n
    assert got == original[: len(got)]


# -- inconsistent tapes ----------------------------------------------------------------------


def _copy_without(src: Path, dst: Path, drop: ev.Event) -> None:
    tape = load_tape(src)
    out = SQLiteTape(dst, tape.header)
    dropped = 0
    for _, event in tape.events():
        if not dropped and event == drop:
            dropped += 1
            continue
        out.append(event)
    out.close()
    assert dropped == 1


def _admitting_step_of_a_preempted_request(events: list[ev.Event]) -> ev.Event:
    """The StepScheduled that put a later-preempted request in the running list."""
    preempted = next(e for e in events if isinstance(e, ev.RequestPreempted))
    return [
        e
        for e in events[: events.index(preempted)]
        if isinstance(e, ev.StepScheduled) and any(x.req_id == preempted.req_id for x in e.entries)
    ][-1]


_MISSING = {
    "second-StepScheduled": lambda evs: [e for e in evs if isinstance(e, ev.StepScheduled)][1],
    "second-FrameProduced": lambda evs: [e for e in evs if isinstance(e, ev.FrameProduced)][1],
    "last-RequestAdded": lambda evs: [e for e in evs if isinstance(e, ev.RequestAdded)][-1],
    "admission-of-a-preempted-request": _admitting_step_of_a_preempted_request,
}


@pytest.mark.parametrize(
    "missing",
    [
        "second-StepScheduled",
        "second-FrameProduced",
        "last-RequestAdded",
        "admission-of-a-preempted-request",
    ],
)
def test_tape_missing_an_event_is_refused_by_the_reducer(tmp_path: Path, missing: str) -> None:
    src = tmp_path / "whole.tape"
    record_run(src).close()
    events = [e for _, e in load_tape(src).events()]
    bad = tmp_path / "gap.tape"
    _copy_without(src, bad, _MISSING[missing](events))
    assert len(load_tape(bad)) == len(events) - 1
    result = verify(bad)
    assert not result.ok and result.first_divergence is not None
    with pytest.raises(ReducerError):
        fold(bad)


# -- concurrent reader (WAL) and a killed writer ---------------------------------------------

_READER_SCRIPT = textwrap.dedent(
    """
    import hashlib, os, sys
    from tokentape.events import schema as ev
    from tokentape.events.reducer import evolve
    from tokentape.replay import load_tape

    path, done, out = sys.argv[1:4]
    with open(out, "w") as f:
        while True:
            finished = os.path.exists(done)
            tape = load_tape(path)
            state = tape.initial_state()
            digest, n = hashlib.sha256(), 0
            for seq, event in tape.events():
                assert seq == n, (seq, n)
                evolve(state, event)  # a consistent prefix folds without ReducerError
                digest.update(ev.encode(event))
                n += 1
            tape.reader.close()
            f.write(f"{n} {digest.hexdigest()}\\n")
            f.flush()
            if finished:
                break
    """
)


def _wait_for(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)


def test_reader_in_another_process_sees_consistent_prefix(tmp_path: Path) -> None:
    path, done, out = tmp_path / "live.tape", tmp_path / "done", tmp_path / "reads.txt"
    script = tmp_path / "reader.py"
    script.write_text(_READER_SCRIPT)
    llm = LLM(
        model="oracle",
        tape=path,
        max_num_seqs=4,
        num_speculative_tokens=1,
        num_kv_blocks=64,
        block_size=4,
    )
    engine = llm.llm_engine
    boundaries = [len(engine.engine_core.tape)]  # what is committed after each engine call
    for i in range(8):
        engine.add_request(
            f"r{i}", [3 + (i * 7 + j) % 200 for j in range(5 + i)], SamplingParams(max_tokens=150)
        )
        boundaries.append(len(engine.engine_core.tape))
    reader = subprocess.Popen([sys.executable, str(script), str(path), str(done), str(out)])
    try:
        _wait_for(lambda: out.exists() and out.read_text().count("\n") >= 1)
        t0 = time.monotonic()
        while engine.has_unfinished_requests():
            engine.step()
            boundaries.append(len(engine.engine_core.tape))
            time.sleep(0.002)
        assert time.monotonic() - t0 > 0.5  # enough time for the reader to overlap
        # A commit reaches the file up to COMMIT_INTERVAL_S later (the writer process groups
        # them; longer on a busy machine): flush, and the reader's read after `done` sees all.
        engine.engine_core.tape.flush()
        done.touch()
        assert reader.wait(timeout=120) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
        llm.close()

    final = [e for _, e in read_all(path)]
    assert len(final) == boundaries[-1]
    prefix_digests = {}
    digest = hashlib.sha256()
    wanted = set(boundaries)
    for n in range(len(final) + 1):
        if n in wanted:
            prefix_digests[n] = digest.hexdigest()
        if n < len(final):
            digest.update(ev.encode(final[n]))
    reads = [line.split() for line in out.read_text().splitlines()]
    counts = [int(n) for n, _ in reads]
    for n, h in reads:
        assert int(n) in prefix_digests, f"reader saw {n} events: not a commit boundary"
        assert prefix_digests[int(n)] == h, f"reader's first {n} events differ from the tape's"
    assert counts == sorted(counts)  # the tape only grows
    assert counts[-1] == len(final)
    assert len(set(counts)) >= 3, f"the reader never saw the tape grow: {sorted(set(counts))}"


_KILLED_WRITER_SCRIPT = textwrap.dedent(
    """
    import sys
    from tokentape import LLM, SamplingParams

    llm = LLM(model="oracle", tape=sys.argv[1], max_num_seqs=4, num_kv_blocks=16,
              block_size=4, num_speculative_tokens=2, max_num_batched_tokens=24)
    engine = llm.llm_engine
    n = 0
    while True:
        if engine.get_num_unfinished_requests() < 4:
            engine.add_request(f"r{n}", [3 + (n * 5 + j) % 250 for j in range(3 + n % 11)],
                               SamplingParams(max_tokens=40))
        engine.step()
        n += 1
        print(n, len(engine.engine_core.tape), flush=True)  # everything counted here is committed
    """
)


def test_a_message_cut_short_by_an_interrupt_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C can stop the engine's write of a message halfway (the pipe full, os.write
    returns part of it and the KeyboardInterrupt lands before the rest). The writer would
    read the next message as the torn one's rest; the tape ends its input there instead and
    writes what it did not commit from this process."""
    path = tmp_path / "torn.tape"
    events = synthetic_events(60)
    tape = SQLiteTape(path, make_test_header())
    for e in events[:20]:
        tape.append(e)
    tape.commit()
    real_write = os.write

    def write_half_then_interrupt(fd: int, data: bytes) -> int:
        monkeypatch.setattr(os, "write", real_write)
        real_write(fd, bytes(data[: len(data) // 2]))
        raise KeyboardInterrupt

    for e in events[20:40]:
        tape.append(e)
    monkeypatch.setattr(os, "write", write_half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        tape.commit()
    for e in events[40:]:  # what the engine records next: the interrupt, as an EngineError
        tape.append(e)
    tape.flush()
    assert [e for _, e in load_tape(path).events()] == events  # readable, while still open
    tape.close()
    assert tape_file_status(path).finished and not os.path.exists(f"{path}-wal")
    assert [e for _, e in load_tape(path).events()] == events


def test_a_flush_interrupted_while_waiting_leaves_the_next_one_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while flush waits for the writer's answer leaves that answer in the pipe.
    The next flush read it as its own and returned before the file held its rows."""
    path = tmp_path / "flush.tape"
    events = synthetic_events(40)
    tape = SQLiteTape(path, make_test_header())
    for e in events[:20]:
        tape.append(e)
    answers = tape._from_writer

    def interrupted(size: int) -> bytes:
        raise KeyboardInterrupt

    monkeypatch.setattr(answers, "read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tape.flush()
    monkeypatch.undo()
    assert select.select([answers], [], [], 30)[0]  # that flush's answer, unread
    os.kill(tape.writer_pid, signal.SIGSTOP)  # the next flush has to wait for the writer
    threading.Timer(0.5, os.kill, (tape.writer_pid, signal.SIGCONT)).start()
    for e in events[20:]:
        tape.append(e)
    tape.flush()
    reader = SQLiteTapeReader(path)
    try:
        assert len(reader) == len(events)
    finally:
        reader.close()
    tape.close()


def test_killed_writer_leaves_a_verifiable_tape(tmp_path: Path) -> None:
    path = tmp_path / "killed.tape"
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True
    )
    committed = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            steps, committed = map(int, line.split())
            if steps >= 400:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert committed > 0

    # The engine's tape writer process outlives it: it commits everything the engine handed
    # over, checkpoints, switches the file out of WAL mode and exits, which removes the -wal
    # and -shm files (one after the other: wait for all of it, not for the -wal alone).
    def one_file() -> bool:
        return (
            tape_file_status(path).finished
            and not os.path.exists(f"{path}-wal")
            and not os.path.exists(f"{path}-shm")
        )

    deadline = time.monotonic() + 30
    while not one_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert one_file(), (
        f"the tape writer did not finish after the engine died: {tape_file_status(path)}"
    )
    tape = load_tape(path)
    assert len(tape) >= committed
    state = tape.fold()
    assert state.num_events == len(tape)
    assert state.step >= 100
    result = verify(path)
    assert result.ok, result.first_divergence and result.first_divergence.format()
    assert result.num_events == len(tape)
    kinds = {ev.kind_of(e) for _, e in tape.events()}
    assert "RequestPreempted" in kinds and "RequestFinished" in kinds


_CTRL_C_SCRIPT = """
import sys
from tokentape import LLM, SamplingParams
llm = LLM(model="tiny", tape=sys.argv[1])  # runs for a minute unless interrupted
print("generating", flush=True)
try:
    llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=10**6, ignore_eos=True), use_tqdm=False)
except KeyboardInterrupt:
    llm.close()
    print("closed", flush=True)
"""


def test_ctrl_c_at_a_terminal_interrupts_the_run_but_not_its_tape_writer(tmp_path: Path) -> None:
    """The writer was in the terminal's foreground process group: a Ctrl-C killed it with the
    engine's last steps unwritten (a TapeWriterError). It has a group of its own now."""
    path = tmp_path / "interrupted.tape"
    out, code = run_in_terminal(_CTRL_C_SCRIPT, str(path), keys_after=(b"generating", b"\x03", 1.0))
    assert "closed" in out and code == 0, out  # Ctrl-C: SIGINT to the foreground group
    assert tape_file_status(path).finished and not os.path.exists(f"{path}-wal")
    errors = [e for _, e in load_tape(path).events() if isinstance(e, ev.EngineError)]
    assert [e.error_type for e in errors] == ["KeyboardInterrupt"]  # the run's, recorded
    result = verify(path)
    assert result.ok, result.first_divergence and result.first_divergence.format()
    assert [f.kind for f in postmortem(path).findings] == ["interrupted"]  # not a failure


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux-only")
def test_the_writer_process_never_preempts_the_engine(tmp_path: Path) -> None:
    tape = SQLiteTape(tmp_path / "batch.tape", make_test_header())
    tape.flush()  # the writer is up and has set its policy
    assert os.sched_getscheduler(tape.writer_pid) == os.SCHED_BATCH
    tape.close()


def test_a_dead_writer_process_is_reported_and_stops_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "dead-writer.tape"
    llm = LLM(model="oracle", tape=path)
    engine = llm.llm_engine
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    engine.engine_core.tape.flush()
    os.kill(engine.engine_core.tape.writer_pid, signal.SIGKILL)
    with pytest.raises(
        TapeError, match=r"dead-writer\.tape: the tape writer process stopped \(exit code -9"
    ):
        for _ in range(200):  # the kill lands asynchronously; the next write after it fails
            engine.step()
            time.sleep(0.01)
    with pytest.raises(EngineDeadError, match="tape writer process stopped"):
        engine.step()
    llm.close()  # the failure was reported once; closing does not raise it again
    result = verify(path)  # what the writer committed before it died is a valid tape
    assert result.ok and result.num_events >= 2  # the request and the first step, flushed


# -- engine failures -------------------------------------------------------------------------


def _fail_on_third_collect(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = llm.llm_engine.engine_core.runner
    original = runner.collect
    calls = 0

    def collect(step: int) -> list[ev.FrameEntry]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected runner failure")
        return original(step)

    monkeypatch.setattr(runner, "collect", collect)


@pytest.mark.parametrize("store", ["sqlite", "memory"])
def test_engine_error_recorded_before_it_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    llm = LLM(model="oracle", tape=tmp_path / "error.tape" if store == "sqlite" else None)
    _fail_on_third_collect(llm, monkeypatch)
    with pytest.raises(RuntimeError, match="injected runner failure"):
        llm.generate(["first prompt", "second prompt"], SamplingParams(max_tokens=10))

    def recorded() -> list[ev.Event]:
        # The file is read while the engine still holds it open: the error is committed.
        source = llm.tape_path if store == "sqlite" else llm.llm_engine.engine_core.tape
        return [e for _, e in load_tape(source).events()]

    events = recorded()
    last = events[-1]
    assert isinstance(last, ev.EngineError)
    assert last.error_type == "RuntimeError" and last.message == "injected runner failure"
    assert sum(isinstance(e, ev.EngineError) for e in events) == 1
    assert fold(
        load_tape(llm.tape_path) if store == "sqlite" else llm.llm_engine.engine_core.tape
    ).error == ("RuntimeError: injected runner failure")

    with pytest.raises(EngineDeadError, match="injected runner failure"):
        llm.llm_engine.step()
    with pytest.raises(EngineDeadError):
        llm.llm_engine.add_request("late", [5, 6, 7])
    with pytest.raises(EngineDeadError):
        llm.generate(["again"])
    with pytest.raises(EngineDeadError):
        llm.llm_engine.pause_generation("keep")
    with pytest.raises(EngineDeadError):
        llm.llm_engine.reset_prefix_cache()
    assert recorded() == events  # a dead engine appends nothing more
    llm.close()


def test_verify_tape_that_ended_with_engine_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "error.tape"
    llm = LLM(model="oracle", tape=path)
    _fail_on_third_collect(llm, monkeypatch)
    with pytest.raises(RuntimeError):
        llm.generate(["first prompt", "second prompt"], SamplingParams(max_tokens=10))
    llm.close()
    result = verify(path)
    assert result.ok, result.first_divergence and result.first_divergence.format()
    assert result.ended_with_error == "RuntimeError: injected runner failure"
    assert result.num_events == len(load_tape(path))


def test_client_errors_are_not_engine_errors(tmp_path: Path) -> None:
    """Bad arguments from the client are refused before anything reaches the tape."""
    llm = LLM(model="oracle", tape=tmp_path / "client.tape")
    with pytest.raises(ValueError, match="empty"):
        llm.llm_engine.add_request("a", [])
    with pytest.raises(ValueError, match="vocabulary"):
        llm.llm_engine.add_request("b", [10_000])
    outs = llm.generate(["still fine"], SamplingParams(max_tokens=3))
    assert len(outs[0].outputs[0].token_ids) == 3
    llm.close()
    assert not any(isinstance(e, ev.EngineError) for _, e in read_all(tmp_path / "client.tape"))


# -- the memory tape behaves like the SQLite tape ---------------------------------------------


def test_memory_tape_matches_sqlite_tape(tmp_path: Path) -> None:
    path = tmp_path / "twin.tape"
    on_disk = record_run(path)
    in_memory = record_run(None)
    mem = in_memory.llm_engine.engine_core.tape
    assert isinstance(mem, MemoryTape) and mem.path is None
    on_disk.close()
    disk_tape, mem_tape = load_tape(path), load_tape(mem)
    disk_events = list(disk_tape.events())
    mem_events = list(mem_tape.events())
    assert mem_events == disk_events
    assert len(mem) == len(disk_tape) == len(disk_events)
    assert list(mem.iter_events(5)) == disk_events[5:]

    def without_time(h: ev.TapeHeader) -> dict[str, object]:
        d = {f: getattr(h, f) for f in h.__struct_fields__}
        d.pop("created_at")
        return d

    assert without_time(mem.header) == without_time(disk_tape.header)
    assert mem_tape.config == disk_tape.config
    fd, fm = disk_tape.fold(), mem_tape.fold()
    assert {r: s.output_token_ids for r, s in fd.requests.items()} == {
        r: s.output_token_ids for r, s in fm.requests.items()
    }
    assert fd.step == fm.step and fd.num_events == fm.num_events
    for step in (0, 3, fd.step // 2):
        a, b = disk_tape.at(step), mem_tape.at(step)
        assert a.num_events == b.num_events
        assert {r: s.output_token_ids for r, s in a.requests.items()} == {
            r: s.output_token_ids for r, s in b.requests.items()
        }
    assert verify(mem).ok and verify(path).ok
    assert verify(mem).num_events == verify(path).num_events


def test_memory_tape_round_trip_and_damage() -> None:
    header = make_test_header()
    mem = MemoryTape(header)
    events = synthetic_events(300)
    for e in events:
        mem.append(e)
    mem.commit()
    assert mem.header is header and len(mem) == len(events)
    assert [s for s, _ in mem.iter_events()] == list(range(len(events)))
    assert [e for _, e in mem.iter_events()] == events
    mem._rows.append(b"\xc1 not msgpack")  # damage, as a truncated file would be
    got = []
    with pytest.raises(TapeError) as info:
        for _, e in mem.iter_events():
            got.append(e)
    assert got == events
    assert info.value.position == len(events)
    assert "<memory tape>" in str(info.value) and f"at event {len(events)}" in str(info.value)


def test_damaged_event_row_in_sqlite_tape_names_position(tmp_path: Path) -> None:
    """A row whose bytes do not decode is reported with its position, like the memory tape."""
    good = tmp_path / "good.tape"
    events = synthetic_events(40)
    write_tape(good, events, make_test_header())
    bad = tmp_path / "bad.tape"
    src = sqlite3.connect(f"file:{good}?mode=ro", uri=True)
    dst = sqlite3.connect(bad)
    src.backup(dst)
    src.close()
    dst.execute("DROP TRIGGER events_no_update")
    dst.execute("UPDATE events SET data = x'c1c1' WHERE seq = 17")
    dst.commit()
    dst.close()
    got = []
    with pytest.raises(TapeError) as info:
        for _, e in load_tape(bad).events():
            got.append(e)
    assert got == events[:17]
    assert info.value.position == 17 and str(bad) in str(info.value)
