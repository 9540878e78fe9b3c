"""`tokentape serve --tape-dir DIR`, the flight recorder, end to end: a server that serves
across segments and stops on SIGTERM leaves segments that each verify and a manifest that says
it closed; one whose engine core is SIGKILLed exits 1 and says so in the manifest and on its
last segment; bad directories and limits are refused before it serves; and the retention
keeps the directory within its limit plus one segment while it serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from serve_process import ServerProcess

from tokentape.events import schema as ev
from tokentape.events.segment_dir import read_manifest, segment_files
from tokentape.events.sqlite_reader import SQLiteTapeReader
from tokentape.replay.verify import verify

STOPS = ["n", "]", "$", "S"]  # characters the oracle's text holds often


def serve(tape_dir: Path, *limits: str) -> ServerProcess:
    return ServerProcess("--model", "oracle", "--tape-dir", str(tape_dir), *limits)


def complete(http: httpx.Client, i: int) -> dict[str, object]:
    """Completion `i`: every third one with stop strings."""
    body: dict[str, object] = {"prompt": f"request {i}", "max_tokens": 12 + i % 20}
    if i % 3 == 0:
        body["stop"] = STOPS
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if i % 3 == 0:
        assert not any(s in choice["text"] for s in STOPS), choice
    return dict(choice)


def serve_until_segments(
    server: ServerProcess, tape_dir: Path, segments: int
) -> list[dict[str, object]]:
    """Completions, one after another, until the directory holds `segments` segments that
    have events (besides the next segment's file, made ahead)."""
    choices: list[dict[str, object]] = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        deadline = time.monotonic() + 60
        while len(segment_files(str(tape_dir))) < segments + 1:
            assert time.monotonic() < deadline, "the server opened no new segment in 60 s"
            choices.append(complete(http, len(choices)))
        for _ in range(3):  # and a few more in the last one
            choices.append(complete(http, len(choices)))
    return choices


def events_of(path: str) -> list[ev.Event]:
    reader = SQLiteTapeReader(path)
    try:
        return [e for _, e in reader.iter_events()]
    finally:
        reader.close()


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentape", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def assert_every_segment_verifies(tape_dir: Path) -> list[str]:
    files = segment_files(str(tape_dir))
    for path in files:
        result = verify(path)
        assert result.ok, (path, result.first_divergence)
    assert verify(tape_dir).ok
    rc = cli("replay", "verify", str(tape_dir))
    assert rc.returncode == 0, rc.stdout + rc.stderr
    return files


def test_sigterm_closes_a_tape_of_segments_that_each_verify(tmp_path: Path) -> None:
    tape_dir = tmp_path / "tape"
    server = serve(tape_dir, "--segment-seconds", "0.2", "--tape-retention", "0")
    try:
        choices = serve_until_segments(server, tape_dir, 3)
    finally:
        code = server.stop()
    assert code == 0, server.stderr
    assert any(c["finish_reason"] == "stop" for c in choices[::3])  # some stop strings matched
    assert read_manifest(str(tape_dir))["ended"]["how"] == "closed"
    files = assert_every_segment_verifies(tape_dir)
    assert len(files) >= 3  # nothing deleted (--tape-retention 0), no file made ahead left
    for path in files[:-1]:
        assert isinstance(events_of(path)[-1], ev.SegmentClosed), path
    pm = cli("postmortem", str(tape_dir))
    assert pm.returncode == 0, pm.stdout + pm.stderr


def making_a_segment_file(tape_dir: Path) -> bool:
    """A segment file is being created (SQLite's rollback journal is beside it): the next
    segment's, made ahead after each rotation."""
    return any(name.endswith(".tape-journal") for name in os.listdir(tape_dir))


def made_ahead(tape_dir: Path) -> bool:
    """The next segment's file is made: its writer has started, and switched it to WAL mode
    (byte 18 of an SQLite file's header is 2)."""
    files = segment_files(str(tape_dir))
    if len(files) < 2:
        return False
    with open(files[-1], "rb") as f:
        header = f.read(20)
    return len(header) == 20 and header[18] == 2


def assert_the_kill_is_recorded(server: ServerProcess, tape_dir: Path) -> None:
    code = server.proc.wait(60)  # the server stops on its own
    server.stop()
    assert code == 1, server.stderr
    assert "Traceback" not in server.stderr, server.stderr
    how = read_manifest(str(tape_dir))["ended"]
    assert how is not None and "was killed by SIGKILL" in how["how"], how
    files = assert_every_segment_verifies(tape_dir)
    last = events_of(files[-1])[-1]
    assert isinstance(last, ev.EngineError), last
    assert "was killed by SIGKILL" in last.message, last
    pm = cli("postmortem", str(tape_dir))
    assert "Traceback" not in pm.stderr, pm.stderr
    found = [line for line in pm.stdout.splitlines() if "engine_error" in line]
    assert found, pm.stdout
    assert "was killed by SIGKILL" in pm.stdout, pm.stdout


def test_a_sigkilled_engine_core_is_named_in_the_manifest_and_the_last_segment(
    tmp_path: Path,
) -> None:
    tape_dir = tmp_path / "tape"
    server = serve(tape_dir, "--segment-seconds", "0.2", "--tape-retention", "0")
    try:
        serve_until_segments(server, tape_dir, 2)
        deadline = time.monotonic() + 30
        while not made_ahead(tape_dir):  # idle: no rotation starts another
            assert time.monotonic() < deadline, os.listdir(tape_dir)
            time.sleep(0.01)
        os.kill(server.core_pid, signal.SIGKILL)
    except BaseException:
        server.stop()
        raise
    assert_the_kill_is_recorded(server, tape_dir)


def test_a_core_killed_while_it_makes_the_next_segment_file_is_recorded_too(
    tmp_path: Path,
) -> None:
    """The kill lands while the next segment's file is being made ahead (its creation, a few
    SQLite statements, is caught by its journal): that file is no segment, and the death is
    still recorded in the last one and the manifest."""
    tape_dir = tmp_path / "tape"
    server = serve(tape_dir, "--segment-seconds", "0.2", "--tape-retention", "0")
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            i = 0
            while not stop.is_set():
                try:
                    http.post("/v1/completions", json={"prompt": f"r{i}", "max_tokens": 16})
                except httpx.HTTPError:
                    return  # the server went away
                i += 1

    client = threading.Thread(target=traffic)
    try:
        client.start()
        deadline = time.monotonic() + 60
        while len(segment_files(str(tape_dir))) < 3 or not making_a_segment_file(tape_dir):
            assert time.monotonic() < deadline, "no segment file was made in 60 s"
            time.sleep(0.0005)
        os.kill(server.core_pid, signal.SIGKILL)
    except BaseException:
        server.stop()
        raise
    finally:
        stop.set()
    client.join(60)
    assert_the_kill_is_recorded(server, tape_dir)


def run_serve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentape", "serve", "--model", "oracle"]
        + ["--host", "127.0.0.1", "--port", "0", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_directory_the_tape_cannot_go_in_is_refused_before_serving(tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    huge = tmp_path / "huge"
    for argv, directory in [
        (["--tape-dir", str(busy)], busy),
        (["--tape-dir", str(huge), "--tape-retention", "1000TB"], huge),
    ]:
        proc = run_serve(*argv)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert str(directory) in lines[0], proc.stderr
        assert "serving on" not in proc.stdout + proc.stderr
    assert os.listdir(busy) == ["notes.txt"] and not huge.exists()
    proc = run_serve("--tape-dir", str(tmp_path / "t"), "--tape-retention", "5 parsecs")
    assert proc.returncode == 2, proc.stderr
    assert "usage:" in proc.stderr and "--tape-retention" in proc.stderr, proc.stderr
    assert not (tmp_path / "t").exists()


def footprint(path: str) -> tuple[int, bool]:
    """A segment's bytes on disk, with the files SQLite keeps beside it while it is written,
    and whether any is there (its writer has not finished it)."""
    total, beside = 0, False
    for suffix in ("", "-wal", "-shm", "-journal"):
        try:
            total += os.path.getsize(path + suffix)
            beside = beside or bool(suffix)
        except FileNotFoundError:
            pass  # none there, or deleted by the retention since the listing
    return total, beside


def test_retention_keeps_the_directory_within_its_limit_plus_one_segment(tmp_path: Path) -> None:
    """Under steady traffic the closed segments (those whose writer finished) stay within the
    limit plus one segment (the one closed since the last sweep); the oldest are deleted."""
    tape_dir, limit = tmp_path / "tape", 200 << 10
    server = serve(tape_dir, "--segment-seconds", "0.1", "--tape-retention", "200KB")
    stop = threading.Event()
    closed_totals: list[int] = []  # the closed segments' bytes, in each sample
    whole: list[tuple[int, int]] = []  # (the directory's bytes, segments being written)
    largest_closed = [0]

    def sample() -> None:
        while not stop.is_set():
            files = segment_files(str(tape_dir))
            sizes = [footprint(path) for path in files[:-1]]  # the last: open, or made ahead
            closed = []
            for size, unfinished in sizes:
                if unfinished:
                    break  # it and the ones after it: being closed, or open
                closed.append(size)
            closed_totals.append(sum(closed))
            largest_closed[0] = max([largest_closed[0], *closed])
            writing = sum(unfinished for _, unfinished in sizes)
            whole.append((sum(footprint(p)[0] for p in files), writing))
            time.sleep(0.02)

    def traffic(worker: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            i = worker
            while not stop.is_set():
                complete(http, i)
                i += 4

    sampler = threading.Thread(target=sample)
    try:
        sampler.start()
        with ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(traffic, w) for w in range(4)]
            first = str(tape_dir / "segment-00000000.tape")
            deadline = time.monotonic() + 60
            while not closed_totals or os.path.exists(first):  # until the retention deletes
                assert time.monotonic() < deadline, f"nothing deleted at {whole[-1:]} bytes"
                time.sleep(0.05)
            time.sleep(3)  # steady traffic with the directory at its limit
            stop.set()
            for c in clients:
                c.result()
    finally:
        stop.set()
        sampler.join()
        code = server.stop()
    assert code == 0, server.stderr
    assert max(closed_totals) <= limit + largest_closed[0], (
        max(closed_totals),
        limit,
        largest_closed[0],
    )
    files = segment_files(str(tape_dir))
    assert int(os.path.basename(files[0])[8:16]) >= 3  # the oldest are gone
    # Closed on SIGTERM: the last segment too, after the last sweep.
    final = sum(footprint(p)[0] for p in files)
    assert final <= limit + largest_closed[0] + footprint(files[-1])[0], final
    assert verify(tape_dir).ok
