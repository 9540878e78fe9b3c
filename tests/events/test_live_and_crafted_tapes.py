"""Readers of a tape that is still being written, and of a tape whose header asks for more
than this machine has: `diff live.tape live.tape` is stable, the postmortem of a live tape
does not call it complete, and `replay whatif` of a tape recorded on CUDA (or with 5,000 CPU
threads) runs on this machine's CPU, saying so in one line."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tokentape import LLM, SamplingParams, cli
from tokentape.entrypoints.cli import diff as diff_cli
from tokentape.events import schema as ev
from tokentape.replay import load_tape
from tokentape.replay.whatif import whatif


@contextlib.contextmanager
def live_tape(path: Path) -> Iterator[LLM]:
    """An engine writing `path` in a thread, with requests always running, until the block
    ends (then its requests are aborted and the tape closed)."""
    llm = LLM("oracle", tape=str(path), block_size=4, num_kv_blocks=4096)
    stop = threading.Event()

    def write() -> None:
        engine, n = llm.llm_engine, 0
        while not stop.is_set():
            if engine.get_num_unfinished_requests() < 4:
                engine.add_request(
                    f"r{n}", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)
                )
                n += 1
            engine.step()
            time.sleep(0.001)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        while len(load_tape(path)) < 200:  # well under way
            time.sleep(0.02)
        yield llm
    finally:
        stop.set()
        writer.join()
        llm.close()


def test_diff_of_a_live_tape_with_itself_is_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_progress = diff_cli.progress

    @contextlib.contextmanager
    def slow_progress(total: int, what: str) -> Iterator[Callable[[int], None]]:
        # Reading A, then B, takes a while on a big tape: the tape grows in between.
        with real_progress(total, what) as update:

            def pause_then_update(n: int) -> None:
                time.sleep(0.05)
                update(n)

            yield pause_then_update

    monkeypatch.setattr(diff_cli, "progress", slow_progress)
    monkeypatch.setattr("tokentape.replay.tape.PROGRESS_EVERY", 64)  # so progress is called
    tape = tmp_path / "live.tape"
    with live_tape(tape):
        codes = [cli.main(["diff", str(tape), str(tape)]) for _ in range(2)]
    assert codes == [0, 0], capsys.readouterr().out


def test_the_postmortem_of_a_live_tape_does_not_call_it_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tape = tmp_path / "live.tape"
    with live_tape(tape):
        cli.main(["postmortem", str(tape)])
        out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "tape_truncated" in out and "(ends mid-run)" in first and "complete" not in first, out


def crafted_copy(src: Path, dst: Path, **config: Any) -> None:
    """A copy of `src` whose header's engine config has `config` changed."""
    header = load_tape(src).header
    header = msgspec.structs.replace(header, config={**header.config, **config})
    with (
        contextlib.closing(sqlite3.connect(f"file:{src}?mode=ro", uri=True)) as s_conn,
        contextlib.closing(sqlite3.connect(dst)) as d_conn,
    ):
        s_conn.backup(d_conn)
        d_conn.execute("DROP TRIGGER meta_no_update")
        d_conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'header'", (ev.encode_header(header),)
        )
        d_conn.commit()


def test_whatif_of_a_cuda_tape_with_5000_threads_runs_on_this_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the tape's device is available")
    recorded = tmp_path / "cpu.tape"
    with LLM("tiny", tape=str(recorded), device="cpu", num_kv_blocks=64) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    crafted = tmp_path / "cuda.tape"
    crafted_copy(recorded, crafted, device="cuda", cpu_threads=5000)
    start = time.perf_counter()
    code = cli.main(["replay", "whatif", str(crafted), "--out", str(tmp_path / "new.tape")])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "note: device 'cuda' is not available" in out and "replayed on the CPU" in out
    assert "Traceback" not in err and time.perf_counter() - start < 60
    result = whatif(str(crafted))
    assert result.config.device == "cpu" and result.config.cpu_threads == len(
        os.sched_getaffinity(0)
    )
    assert result.diff.identical  # the same greedy tokens on the CPU it was recorded on
