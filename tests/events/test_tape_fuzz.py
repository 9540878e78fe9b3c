"""Tape-damage fuzzing: Hypothesis damages a recorded tape (truncates the file, flips bytes,
puts NULL, text or numbers where an event's payload was, deletes, duplicates or reorders
rows, claims a newer format version) and runs every read command on it. Each must exit 0, 1
or 2 within a time limit, never with a traceback, and exit 2 only with one `error:` line on
stderr; when the damage leaves events that no engine could have recorded, the commands that
check consistency (verify, diff, postmortem) must not pass it.

The cost is kept to seconds: one small tape, a few dozen examples per test."""

from __future__ import annotations

import contextlib
import functools
import io
import shutil
import signal
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokentape import LLM, SamplingParams, cli
from tokentape.events import schema as ev
from tokentape.events.sqlite_store import make_self_contained
from tokentape.replay import load_tape

TIME_LIMIT_S = 20  # per command: a small tape is read in well under a second
FUZZ = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_TRIGGERS = (
    "events_no_update",
    "events_no_delete",
    "events_append_only",
    "meta_no_update",
    "meta_no_delete",
    "meta_append_only",
)
READERS = {
    "inspect": ["inspect", "TAPE"],
    "inspect --json": ["inspect", "TAPE", "--json", "--step", "3"],
    "debug": ["debug", "TAPE"],
    "diff": ["diff", "GOOD", "TAPE"],
    "export jsonl": ["export", "TAPE", "--format", "jsonl"],
    "export perfetto": ["export", "TAPE", "--format", "perfetto"],
    "postmortem --json": ["postmortem", "TAPE", "--json"],
    "postmortem --html": ["postmortem", "TAPE", "--html", "HTML"],
    "replay verify": ["replay", "verify", "TAPE"],
}
CHECKERS = ("diff", "postmortem --json", "postmortem --html", "replay verify")


@functools.cache
def good_tape() -> Path:
    """A small recorded run: chunked prefill, KV-pressure preemptions, spec decoding, a pause
    with a cache reset, an abort."""
    path = Path(tempfile.mkdtemp(prefix="tokentape-fuzz-")) / "good.tape"
    llm = LLM(
        model="oracle",
        tape=path,
        max_num_seqs=3,
        num_kv_blocks=16,
        block_size=4,
        max_num_batched_tokens=16,
        num_speculative_tokens=2,
        pipeline_depth=3,
    )
    engine = llm.llm_engine
    for i in range(5):
        engine.add_request(f"q{i}", list(range(3 + i, 12 + 2 * i)), SamplingParams(max_tokens=8))
    for _ in range(6):
        engine.step()
    engine.pause_generation("keep", clear_cache=True)
    engine.resume_generation()
    engine.abort_request("q4")
    while engine.has_unfinished_requests():
        engine.step()
    llm.close()
    make_self_contained(path)  # one file: what the byte flips and cuts apply to
    return path


@functools.cache
def good_events() -> list[ev.Event]:
    return [e for _, e in load_tape(good_tape()).events()]


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expired(signum: int, frame: object) -> None:
        raise Hang(f"a read command ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_all(damaged: Path, workdir: Path) -> dict[str, int]:
    """Every read command on the damaged tape: exit status by command, checked as it runs."""
    results = {}
    for name, argv in READERS.items():
        subs = {
            "TAPE": str(damaged),
            "GOOD": str(good_tape()),
            "HTML": str(workdir / "report.html"),
        }
        out, err = io.StringIO(), io.StringIO()
        stdin = io.StringIO("continue\nrequests\nreverse-continue\ngoto end\nprint req q1\n")
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            _stdin(stdin),
            time_limit(TIME_LIMIT_S),
        ):
            rc = cli.main([subs.get(a, a) for a in argv])
        text = err.getvalue()
        assert rc in (0, 1, 2), (name, rc, text)
        assert "Traceback" not in text, (name, text)
        if rc == 2:
            lines = text.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), (name, text)
        else:
            assert "error:" not in text, (name, text)
        results[name] = rc
    return results


@contextlib.contextmanager
def _stdin(stream: io.StringIO) -> Iterator[None]:
    import sys

    saved, sys.stdin = sys.stdin, stream
    try:
        yield
    finally:
        sys.stdin = saved


def with_sql(dst: Path, *statements: tuple[str, tuple[object, ...]]) -> None:
    shutil.copy(good_tape(), dst)
    conn = sqlite3.connect(dst)
    for name in _TRIGGERS:
        conn.execute(f"DROP TRIGGER IF EXISTS {name}")
    for sql, params in statements:
        conn.execute(sql, params)
    conn.commit()
    conn.close()


def events_of(path: Path) -> list[ev.Event] | None:
    """The damaged tape's events, or None when it cannot be read whole."""
    try:
        return [e for _, e in load_tape(path).events()]
    except Exception:
        return None


def assert_refused_if_changed(damaged: Path, results: dict[str, int]) -> None:
    """A tape whose events are not a prefix of the recording (a prefix ending at a call
    boundary is what a killed run leaves) must not pass the commands that check it."""
    events, good = events_of(damaged), good_events()
    if events is not None and events == good[: len(events)]:
        return
    for name in CHECKERS:
        assert results[name] != 0, (name, results)


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tokentape-fuzz-run-") as d:
        yield Path(d)


# -- the damage ---------------------------------------------------------------------------------


@FUZZ
@given(fraction=st.floats(0.01, 0.99))
def test_truncated_file(workdir: Path, fraction: float) -> None:
    data = good_tape().read_bytes()
    damaged = workdir / "cut.tape"
    damaged.write_bytes(data[: int(len(data) * fraction)])
    run_all(damaged, workdir)


@FUZZ
@given(
    flips=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=6
    )
)
def test_byte_flips(workdir: Path, flips: list[tuple[float, int]]) -> None:
    data = bytearray(good_tape().read_bytes())
    for where, mask in flips:
        data[int(where * len(data))] ^= mask
    damaged = workdir / "flipped.tape"
    damaged.write_bytes(bytes(data))
    run_all(damaged, workdir)


@FUZZ
@given(
    where=st.floats(0, 1, exclude_max=True),
    payload=st.sampled_from([None, "hello", "", 7, 2.5, b"", b"\xc1"]),
)
def test_payload_that_is_not_an_event(workdir: Path, where: float, payload: object) -> None:
    seq = int(where * len(good_events()))
    damaged = workdir / "payload.tape"
    with_sql(damaged, ("UPDATE events SET data = ? WHERE seq = ?", (payload, seq)))
    results = run_all(damaged, workdir)
    assert all(rc != 0 for name, rc in results.items() if not name.startswith("inspect --json")), (
        results
    )


@FUZZ
@given(where=st.floats(0, 1, exclude_max=True), renumber=st.booleans())
def test_deleted_row(workdir: Path, where: float, renumber: bool) -> None:
    seq = int(where * len(good_events()))
    damaged = workdir / "deleted.tape"
    statements: list[tuple[str, tuple[object, ...]]] = [
        ("DELETE FROM events WHERE seq = ?", (seq,))
    ]
    if renumber:  # hide the gap: the rows after it move up
        statements.append(("UPDATE events SET seq = seq - 1 WHERE seq > ?", (seq,)))
    with_sql(damaged, *statements)
    assert_refused_if_changed(damaged, run_all(damaged, workdir))


@FUZZ
@given(where=st.floats(0, 1, exclude_max=True))
def test_duplicated_row(workdir: Path, where: float) -> None:
    seq = int(where * len(good_events()))
    damaged = workdir / "duplicated.tape"
    n = len(good_events())
    with_sql(
        damaged,
        # Make room after the row (from the end, so that no two rows share a seq), copy it.
        *[("UPDATE events SET seq = seq + 1 WHERE seq = ?", (s,)) for s in range(n - 1, seq, -1)],
        (
            "INSERT INTO events(seq, step, kind, data) SELECT seq + 1, step, kind, data "
            "FROM events WHERE seq = ?",
            (seq,),
        ),
    )
    assert_refused_if_changed(damaged, run_all(damaged, workdir))


@FUZZ
@given(a=st.floats(0, 1, exclude_max=True), b=st.floats(0, 1, exclude_max=True))
def test_reordered_rows(workdir: Path, a: float, b: float) -> None:
    n = len(good_events())
    sa, sb = int(a * n), int(b * n)
    damaged = workdir / "reordered.tape"
    with_sql(
        damaged,
        ("UPDATE events SET seq = -1 WHERE seq = ?", (sa,)),
        ("UPDATE events SET seq = ? WHERE seq = ?", (sa, sb)),
        ("UPDATE events SET seq = ? WHERE seq = -1", (sb,)),
    )
    assert_refused_if_changed(damaged, run_all(damaged, workdir))


def int_paths(value: object, path: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Where the integers are in an event's msgpack form (nested lists, maps as lists)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [path]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in int_paths(v, (*path, i))]
    return []


def with_value(value: object, path: tuple[int, ...], new: int) -> object:
    if not path:
        return new
    assert isinstance(value, list)
    return [with_value(v, path[1:], new) if i == path[0] else v for i, v in enumerate(value)]


@FUZZ
@given(
    where=st.floats(0, 1, exclude_max=True),
    which=st.floats(0, 1, exclude_max=True),
    new=st.one_of(st.integers(-3, 300), st.integers(-(2**63), 2**63 - 1)),
)
def test_edited_number(workdir: Path, where: float, which: float, new: int) -> None:
    """An event that still decodes, with one of its numbers changed: a step, a token, an
    entry's token count or epoch, a block id, a finish or preemption count."""
    events = good_events()
    seq = int(where * len(events))
    form = msgspec.msgpack.decode(ev.encode(events[seq]))
    paths = int_paths(form)
    path = paths[int(which * len(paths))]
    damaged = workdir / "edited.tape"
    with_sql(
        damaged,
        (
            "UPDATE events SET data = ? WHERE seq = ?",
            (msgspec.msgpack.encode(with_value(form, path, new)), seq),
        ),
    )
    results = run_all(damaged, workdir)
    # The scheduler's decisions and what the client was given are checked by the replay.
    if ev.kind_of(events[seq]) in ("StepScheduled", "RequestPreempted", "OutputsEmitted"):
        assert_refused_if_changed(damaged, results)


@FUZZ
@given(
    where=st.sampled_from(["meta", "header", "both"]),
    version=st.integers(ev.FORMAT_VERSION + 1, 2**40),
)
def test_newer_format_version(workdir: Path, where: str, version: int) -> None:
    damaged = workdir / "newer.tape"
    statements: list[tuple[str, tuple[object, ...]]] = []
    if where in ("meta", "both"):
        statements.append(("UPDATE meta SET value = ? WHERE key = 'format_version'", (version,)))
    if where in ("header", "both"):
        header = msgspec.structs.replace(load_tape(good_tape()).header, format_version=version)
        statements.append(
            ("UPDATE meta SET value = ? WHERE key = 'header'", (ev.encode_header(header),))
        )
    with_sql(damaged, *statements)
    results = run_all(damaged, workdir)
    assert set(results.values()) == {2}, results


def test_the_untouched_tape_passes_every_reader(workdir: Path) -> None:
    """The baseline the fuzz tests compare with: every reader accepts the recording."""
    results = run_all(good_tape(), workdir)
    assert results == dict.fromkeys(READERS, 0)
