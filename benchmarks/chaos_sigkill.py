"""Chaos: SIGKILL a real engine run at a random moment, then check what its tape writer left.

Each iteration starts an engine in a child process (this script with `--child`): a seeded,
random configuration (pipeline depth 1-3, 0-2 speculative tokens, small KV caches, so
preemptions happen) that keeps adding requests, stepping, and now and then pausing with a
prefix-cache reset, aborting or resetting the cache, until it is killed with SIGKILL at a
random moment after it is up. The engine's tape writer process outlives it; once the writer
has drained (it has exited), the iteration checks that:

- the tape is one file: nothing beside it (no -wal, -shm or -journal) and in rollback-journal
  mode (the writer finished);
- the .tape copied alone holds the same events and verifies (`tokentape.replay.verify`);
- it holds at least every event the engine had flushed before it was killed.

    python benchmarks/chaos_sigkill.py --iterations 100 [--model oracle] [--max-kill-s 2]
        [--tiny-every 10] [--seed 0] [--json out.json]

tests/engine/test_sigkill.py runs a few iterations (oracle, and the tiny model once) through
`run_iteration`. Exit status: 0 when every iteration passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve()
WRITER_DRAIN_TIMEOUT_S = 60.0


# -- the child: an engine run that goes on until it is killed --------------------------------


def run_child(tape: str, model: str, seed: int) -> None:
    from tokentape import LLM, SamplingParams

    rng = random.Random(seed)
    max_num_seqs = rng.choice([2, 4, 8])
    llm = LLM(
        model=model,
        tape=tape,
        seed=seed,
        max_num_seqs=max_num_seqs,
        block_size=4,
        num_kv_blocks=rng.choice([24, 32, 64]),
        max_num_batched_tokens=rng.choice([16, 32, 64]),
        pipeline_depth=rng.choice([1, 2, 3]),
        num_speculative_tokens=rng.choice([0, 1, 2]),
    )
    engine = llm.llm_engine
    print(f"ready {engine.engine_core.tape.writer_pid}", flush=True)  # type: ignore[attr-defined]
    added = steps = 0
    while True:
        while engine.get_num_unfinished_requests() < max_num_seqs + 2:
            prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))]
            engine.add_request(f"r{added}", prompt, SamplingParams(max_tokens=rng.randint(1, 60)))
            added += 1
        roll = rng.random()
        if roll < 0.01:
            engine.pause_generation(mode="keep", clear_cache=True)
            engine.resume_generation()
        elif roll < 0.02:
            engine.abort_request(f"r{rng.randrange(added)}")  # finished ones are ignored
        elif roll < 0.025:
            engine.reset_prefix_cache(reset_running_requests=True)
        engine.step()
        steps += 1
        if steps % 25 == 0:
            engine.engine_core.tape.flush()
            print(f"flushed {len(engine.engine_core.tape)}", flush=True)  # type: ignore[arg-type]


# -- the parent: kill, wait for the writer, check the tape -----------------------------------


@dataclass
class Iteration:
    seed: int
    model: str
    kill_after_s: float
    ok: bool
    problem: str = ""
    events: int = 0
    flushed: int = 0  # events the engine had flushed before the kill (the tape holds >= this)
    drain_s: float = 0.0  # from the kill to the writer's exit
    wall_s: float = 0.0


def _gone(pid: int) -> bool:
    """The process has exited (a zombie that nobody reaps has exited too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def run_iteration(
    folder: Path, seed: int, model: str = "oracle", max_kill_s: float = 1.0
) -> Iteration:
    """One run killed at a random moment (drawn from `seed`) and its tape checked."""
    from tokentape.events.sqlite_store import SQLiteTapeReader, tape_file_status
    from tokentape.replay import verify

    t0 = time.monotonic()
    kill_after = random.Random(seed ^ 0x5EED).uniform(0.0, max_kill_s)
    it = Iteration(seed, model, round(kill_after, 3), ok=False)
    run_dir = folder / f"run-{seed}-{model}"
    run_dir.mkdir(parents=True)
    tape = run_dir / "run.tape"
    child = subprocess.Popen(
        [sys.executable, str(HERE), "--child", str(tape), "--model", model, "--seed", str(seed)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    try:
        ready = child.stdout.readline().split()
        if not ready or ready[0] != "ready":
            child.kill()
            it.problem = f"the engine did not start (exit {child.wait()})"
            return it
        writer_pid = int(ready[1])
        flushed = [0]

        def follow() -> None:  # keeps the child's stdout drained, and notes what it flushed
            for line in child.stdout:  # type: ignore[union-attr]
                if line.startswith("flushed "):
                    flushed[0] = int(line.split()[1])

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        time.sleep(kill_after)
        it.flushed = flushed[0]  # read before the kill: the child flushed at least this much
        if child.poll() is not None:
            it.problem = f"the engine exited on its own (exit {child.returncode}) before the kill"
            return it
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    killed = time.monotonic()
    while not _gone(writer_pid):
        if time.monotonic() - killed > WRITER_DRAIN_TIMEOUT_S:
            it.problem = f"the tape writer (pid {writer_pid}) did not exit after the engine's death"
            return it
        time.sleep(0.005)
    it.drain_s = round(time.monotonic() - killed, 3)
    it.problem = _check(tape, it, SQLiteTapeReader, tape_file_status, verify)
    it.ok = not it.problem
    it.wall_s = round(time.monotonic() - t0, 3)
    if it.ok:
        shutil.rmtree(run_dir)
    return it


def _check(tape: Path, it: Iteration, reader_cls, status_of, verify) -> str:  # type: ignore[no-untyped-def]
    beside = sorted(os.listdir(tape.parent))
    if beside != [tape.name]:
        return f"files beside the tape after the writer drained: {beside}"
    if not status_of(tape).finished:
        return "the tape is still in WAL mode: the writer did not finish"
    alone_dir = tape.parent / "alone"
    alone_dir.mkdir()
    alone = Path(shutil.copy(tape, alone_dir / tape.name))
    events = [_read(tape, reader_cls), _read(alone, reader_cls)]
    if events[0] != events[1]:
        return "the .tape copied alone holds other events than the tape"
    it.events = len(events[0])
    if it.events < it.flushed:
        return f"the tape holds {it.events} events, but {it.flushed} were flushed before the kill"
    result = verify(alone)
    if not result.ok:
        d = result.first_divergence
        return f"verify failed: {d.format() if d is not None else 'no divergence given'}"
    if result.num_events != it.events:
        return f"verify reproduced {result.num_events} of {it.events} events"
    shutil.rmtree(alone_dir)
    return ""


def _read(path: Path, reader_cls) -> list[bytes]:  # type: ignore[no-untyped-def]
    from tokentape.events import schema as ev

    reader = reader_cls(path)
    try:
        return [ev.encode(e) for _, e in reader.iter_events()]
    finally:
        reader.close()


# -- the long run ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--model", default="oracle")
    p.add_argument(
        "--tiny-every",
        type=int,
        default=10,
        metavar="K",
        help="every K-th iteration runs the tiny model (0: never)",
    )
    p.add_argument("--max-kill-s", type=float, default=2.0, help="kill within this after start-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        run_child(args.child, args.model, args.seed)
        return 0
    results: list[Iteration] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chaos-sigkill-") as tmp:
        for i in range(args.iterations):
            model = (
                "tiny"
                if args.tiny_every and i % args.tiny_every == args.tiny_every - 1
                else args.model
            )
            it = run_iteration(Path(tmp), args.seed + i, model, args.max_kill_s)
            results.append(it)
            mark = "ok" if it.ok else f"FAILED: {it.problem}"
            print(
                f"[{i + 1}/{args.iterations}] seed {it.seed} {it.model}: killed after "
                f"{it.kill_after_s:.2f} s, {it.events} events, writer drained in "
                f"{it.drain_s:.2f} s: {mark}",
                flush=True,
            )
    wall = time.monotonic() - t0
    good = [r for r in results if r.ok]
    drains = [r.drain_s for r in results]
    events = [r.events for r in good] or [0]
    print(
        f"\nruns {len(results)}, verified and self-contained {len(good)}, wall time {wall:.1f} s; "
        f"events per tape median {statistics.median(events):.0f} (max {max(events)}); "
        f"writer drain after the kill median {statistics.median(drains or [0]):.3f} s "
        f"(max {max(drains or [0]):.3f} s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_s": wall, "iterations": [asdict(r) for r in results]}, f, indent=1)
    return 0 if len(good) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
