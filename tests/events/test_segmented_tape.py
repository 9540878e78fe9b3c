"""The segmented tape (the flight recorder): every segment opens with a snapshot of the engine
and verifies and postmortems on its own, a directory of segments reads as one tape, the
retention keeps it bounded, and bad directories and limits are refused before anything runs."""

from __future__ import annotations

import os
import random
import shutil
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tokentape import LLM
from tokentape.engine.config import EngineConfig
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.factory import build_engine_core
from tokentape.errors import TapeError
from tokentape.events import schema as ev
from tokentape.events.segment_dir import (
    SegmentedTapeSpec,
    parse_retention,
    parse_size,
    read_manifest,
    segment_files,
)
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape
from tokentape.replay.verify import verify
from tokentape.replay.whatif import whatif

SP = ev.SamplingParams


def storm(engine: EngineCore, seed: int, steps: int, pauses: bool = True) -> None:
    """Random traffic through everything a snapshot must carry: chunked prefills, drafts,
    preemptions on a small cache, stop strings, n = 2, aborts, pauses, resets, sleeps."""
    rnd = random.Random(seed)
    n = 0
    for _ in range(steps):
        if rnd.random() < 0.3:
            prompt = [rnd.randrange(1, 100) for _ in range(rnd.randrange(1, 30))]
            stop = ("ab",) if rnd.random() < 0.3 else ()
            logprobs = rnd.choice([None, 0, 2])
            params = SP(max_tokens=rnd.randrange(1, 30), stop=stop, logprobs=logprobs)
            engine.add_request(f"r{n}", prompt, params)
            n += 1
        if rnd.random() < 0.03:
            engine.add_request(f"p{n}", [1, 2, 3, 4, 5], SP(max_tokens=8, n=2, seed=n))
            n += 1
        if pauses and rnd.random() < 0.05 and engine.state.unfinished:
            engine.abort_request(rnd.choice(engine.state.unfinished).req_id)
        if pauses and rnd.random() < 0.03:
            engine.pause_generation(rnd.choice(["keep", "wait", "abort"]), rnd.random() < 0.5)
            engine.resume_generation()
        if pauses and rnd.random() < 0.02:
            engine.reset_prefix_cache(rnd.random() < 0.5)
        if pauses and rnd.random() < 0.02:
            engine.sleep(rnd.choice([0, 1, 2]), rnd.choice(["keep", "wait", "abort"]))
            engine.step()
            if rnd.random() < 0.5:
                engine.wake_up(["weights"])
                engine.step()
            engine.wake_up(None)
        engine.step()
        time.sleep(0.001)
    while engine.has_unfinished_requests():
        engine.step()


def config(seed: int) -> EngineConfig:
    rnd = random.Random(seed)
    return EngineConfig(
        model="oracle",
        pipeline_depth=rnd.choice([1, 2, 3]),
        num_kv_blocks=40,
        block_size=4,
        max_num_batched_tokens=32,
        num_speculative_tokens=rnd.choice([0, 2]),
    )


def record(directory: Path, seed: int, steps: int = 250, **limits: object) -> list[str]:
    spec = SegmentedTapeSpec(str(directory), **{"segment_seconds": 0.01, **limits})  # type: ignore[arg-type]
    engine = build_engine_core(config(seed), spec)
    try:
        storm(engine, seed, steps)
    finally:
        engine.close()
    return segment_files(str(directory))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_segment_verifies_and_gets_a_clean_postmortem_alone(
    tmp_path: Path, seed: int
) -> None:
    files = record(tmp_path / "run", seed, retention_bytes=None)
    assert len(files) >= 5
    for i, path in enumerate(files):
        events = [e for _, e in load_tape(path).events()]
        assert isinstance(events[0], ev.EngineSnapshot) and events[0].segment == i
        last = i == len(files) - 1
        assert isinstance(events[-1], ev.SegmentClosed) != last
        result = verify(path)
        assert result.ok, (path, result.first_divergence)
        report = postmortem(path)
        assert report.findings == [], (path, report.findings)
    # The directory as one tape: the replay must reach each later snapshot exactly.
    whole = load_tape(tmp_path / "run")
    assert len(whole) == sum(len(load_tape(p)) for p in files)
    assert verify(whole).ok
    report = postmortem(tmp_path / "run")
    assert report.findings == []
    assert report.summary.segments == [os.path.basename(p) for p in files]
    assert report.summary.ended is not None and report.summary.ended.startswith("closed (at ")
    assert read_manifest(str(tmp_path / "run"))["ended"]["how"] == "closed"


def test_a_snapshot_restores_an_equal_engine(tmp_path: Path) -> None:
    """At every step boundary, a fresh engine restored from the snapshot snapshots the same
    state, and the snapshot survives the tape's encoding."""
    engine = build_engine_core(config(5), None)
    rnd = random.Random(5)
    for i in range(120):
        if rnd.random() < 0.3:
            stop = ("ab",) if rnd.random() < 0.3 else ()
            engine.add_request(f"r{i}", [rnd.randrange(1, 100) for _ in range(9)], SP(stop=stop))
        engine.step()
        snap = engine.snapshot(3, 100)
        assert ev.decode(ev.encode(snap)) == snap
        other = build_engine_core(config(5), None)
        other.restore(snap)
        assert other.snapshot(3, 100).restated() == snap.restated()
        with pytest.raises(RuntimeError, match="only a new engine"):
            other.restore(snap)


def test_a_window_of_segments_verifies_as_one_tape(tmp_path: Path) -> None:
    files = record(tmp_path / "run", 3, retention_bytes=None)
    starts = [next(load_tape(p).events())[1].wall_time for p in files]  # type: ignore[attr-defined]
    middle = len(files) // 2
    window = load_tape(tmp_path / "run", since=starts[middle] + 1e-6, until=starts[middle + 2])
    assert [s.path for s in window.reader.segments] == files[middle : middle + 3]  # type: ignore[attr-defined]
    assert verify(window).ok
    last = load_tape(tmp_path / "run", since=timedelta(0))
    assert [s.path for s in last.reader.segments] == files[-1:]  # type: ignore[attr-defined]
    with pytest.raises(TapeError, match="needs a segmented tape's directory"):
        load_tape(files[0], since=timedelta(minutes=10))


def test_whatif_replays_a_segment_from_its_snapshot(tmp_path: Path) -> None:
    """Without commands that depend on timing (aborts, pauses), the requests a segment opens
    with, recomputed from their confirmed tokens, give the client the same streams."""
    spec = SegmentedTapeSpec(str(tmp_path / "run"), segment_seconds=0.01, retention_bytes=None)
    engine = build_engine_core(config(7), spec)
    storm(engine, 7, 150, pauses=False)
    engine.close()
    files = segment_files(str(tmp_path / "run"))
    busy = max(files[1:-1], key=lambda p: len(next(load_tape(p).events())[1].requests))  # type: ignore[attr-defined]
    for depth in (1, 3):
        result = whatif(busy, pipeline_depth=depth)
        assert result.diff.identical, result.diff.divergences
        assert verify(result.tape).ok


def test_retention_keeps_the_tape_within_its_size_plus_one_segment(tmp_path: Path) -> None:
    limit = 200 << 10
    spec = SegmentedTapeSpec(
        str(tmp_path / "run"), segment_seconds=0.05, segment_bytes=64 << 10, retention_bytes=limit
    )
    engine = build_engine_core(config(11), spec)
    reader = None
    kept: list[int] = []
    try:
        for i in range(60):
            engine.add_request(f"r{i}", list(range(1, 40)), SP(max_tokens=40, ignore_eos=True))
            for _ in range(8):
                engine.step()
                time.sleep(0.002)
            engine.tape.flush()  # every close done, and the retention applied after it
            files = segment_files(str(tmp_path / "run"))
            kept.append(sum(os.path.getsize(p) for p in files[:-1]))  # all but the open one
            if reader is None and len(files) > 3:
                reader = load_tape(tmp_path / "run")  # opened before its first segment goes
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()
    assert not os.path.exists(tmp_path / "run" / "segment-00000000.tape")
    assert max(kept) <= limit
    assert verify(tmp_path / "run").ok  # what is left reads as one tape from its first snapshot
    assert reader is not None and verify(reader).ok  # deleted under it, still read to the end


def test_a_missing_or_damaged_segment_is_named(tmp_path: Path) -> None:
    files = record(tmp_path / "run", 4, steps=120, retention_bytes=None)
    gap = tmp_path / "gap"
    shutil.copytree(tmp_path / "run", gap)
    os.remove(gap / os.path.basename(files[2]))
    tape = load_tape(gap)  # the segments before the gap read; reading stops there
    with pytest.raises(TapeError, match="segment 2 is missing") as info:
        list(tape.events())
    assert os.path.basename(files[3]) in str(info.value)
    found = [f for f in postmortem(gap).findings if f.kind == "tape_damaged"]
    assert found and os.path.basename(files[3]) in found[0].message
    # A segment cut short: the commands analyse up to the damage and name the segment.
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "run", cut)
    damaged = cut / os.path.basename(files[3])
    damaged.write_bytes(damaged.read_bytes()[:5000])
    report = postmortem(cut)
    found = [f for f in report.findings if f.kind == "tape_damaged"]
    assert found and report.summary.num_events > 0


def test_bad_directories_and_limits_are_refused_before_anything_runs(tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match="holds files already"):
        LLM(model="oracle", tape_dir=busy)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        LLM(model="oracle", tape_dir=tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model="oracle", tape_dir=tmp_path / "no" / "such")
    with pytest.raises(OSError, match="less than the retention"):
        build_engine_core(
            EngineConfig(model="oracle"),
            SegmentedTapeSpec(str(tmp_path / "huge"), retention_bytes=1 << 60),
        )
    assert not os.path.exists(tmp_path / "huge")
    with pytest.raises(ValueError, match="not both"):
        LLM(model="oracle", tape="x.tape", tape_dir=tmp_path / "d")
    with pytest.raises(ValueError, match="segment_seconds"):
        SegmentedTapeSpec(str(tmp_path / "d"), segment_seconds=0)
    assert parse_size("500KB") == 500 << 10 and parse_size("2GB") == 2 << 30
    assert parse_retention("30m") == (1800.0, None)
    assert parse_retention("1MB") == (None, 1 << 20)
    assert parse_retention("0") == (None, None)
    with pytest.raises(ValueError, match="not a retention"):
        parse_retention("5 parsecs")


def test_llm_with_tape_dir_writes_a_flight_recorder(tmp_path: Path) -> None:
    llm = LLM(model="oracle", tape_dir=tmp_path / "run")
    outs = llm.generate([[1, 2, 3]] * 4, SP(max_tokens=8), use_tqdm=False)
    llm.close()
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert llm.tape_path == str(tmp_path / "run")
    assert verify(tmp_path / "run").ok
