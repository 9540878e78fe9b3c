"""The flight recorder under SIGKILL: a segmented tape must survive a kill at any point.

Each kill point starts an engine (the oracle model) in a child process (this script with
`--child`), writing a segmented tape with tiny segments (20-50 ms; half the points with a
small byte retention, so closed segments are deleted as well) under a random storm: adds with
random prompts and lengths, some with stop strings or stop tokens, aborts, pauses in every
mode, resumes, prefix-cache resets, sleeps and weight updates (tokentape.chaos.storms). After
a random delay one process is killed with SIGKILL, chosen at random among:

- `engine`: the engine's own process (the engine runs in it: LLMEngine, as LLM does);
- `open_writer`: the open segment's tape writer (its child `python -I .../sqlite_writer.py`;
  the child says which, as the files cannot: the next segment's file is made ahead);
- `closing_writer`: the writer of a segment being closed (caught while the segment after it
  is open already);
- `spare_writer`: the writer of the next segment's file, made ahead and not opened yet. The
  engine makes the file again and goes on; two segments later the engine is killed too.

The child engine, like the engine core process, records a failure it did not record itself
(a writer's death) as an EngineError and closes the tape as it stands.

Once the engine and every writer have exited, the point passes when:

- every segment file verifies on its own (`verify(path).ok`; a tape that ends with the
  EngineError the engine recorded when its writer was killed verifies as ok too), and is one
  file in rollback-journal mode (its writer finished, or the engine repaired it);
- the whole directory verifies as one tape, and so does a random run of consecutive segments
  (copied with the manifest into a directory of their own);
- the tape holds every event the engine had flushed before the kill;
- `postmortem(DIR)` runs, with findings only of the kinds tape_truncated and engine_error.

    python tools/flight_recorder_kills.py [--points 50] [--seed 0] [--out DIR]

A point that fails keeps its directory under --out (default: a temporary directory, removed
when everything passed). Exit status: 0 when every point passed, 1 otherwise.
tests/events/test_flight_recorder_kills.py runs a point of each victim and one drawn at
random through `run_kill_points`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve()
VICTIMS = ("engine", "open_writer", "closing_writer", "spare_writer")
ALLOWED_FINDINGS = {"tape_truncated", "engine_error"}
EXIT_TIMEOUT_S = 60.0  # for the engine, then its writers, to exit after the kill
CATCH_CLOSING_S = 10.0  # how long to look for the writer to kill (a closing one is brief)
_WRITER = "sqlite_writer.py"


# -- the child: an engine under a storm until it is killed ------------------------------------


def run_child(directory: str, seed: int, segment_seconds: float, retention_bytes: int) -> None:
    from tokentape.chaos.storms import StormDriver, StormResult, StormSpec, storm_commands
    from tokentape.engine.config import EngineConfig
    from tokentape.engine.llm_engine import LLMEngine
    from tokentape.events.schema import SamplingParams
    from tokentape.events.segment_dir import SegmentedTapeSpec
    from tokentape.events.segmented_store import SegmentedTape

    rng = random.Random(f"child-{seed}")
    spec = StormSpec(
        seed=seed,
        pipeline_depth=rng.choice([1, 2, 2, 3]),
        num_speculative_tokens=rng.choice([0, 0, 1, 2]),
        num_kv_blocks=rng.choice([16, 24, 32]),
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 16, 32]),
    )
    tape_spec = SegmentedTapeSpec(
        directory,
        segment_seconds=segment_seconds,
        retention_bytes=retention_bytes or None,
    )
    engine = LLMEngine.from_engine_args(
        EngineConfig(model=spec.model, **spec.engine_args()),  # type: ignore[arg-type]
        tape_spec,
    )
    core = engine.engine_core
    if not isinstance(core.tape, SegmentedTape):
        raise TypeError(f"expected a segmented tape, got {type(core.tape).__name__}")
    tape: SegmentedTape = core.tape
    print(f"ready {os.getpid()}", flush=True)
    shown = [0]

    def show_open_segment() -> None:
        """Tell the parent which writer is the open segment's, when it changes (the files
        do not say: the next segment's file is made ahead, with its writer running)."""
        segment = tape._segment
        if segment is not None and segment.writer_pid != shown[0]:
            shown[0] = segment.writer_pid
            print(f"open {segment.writer_pid} {segment.path}", flush=True)

    class Driver(StormDriver):
        def step(self) -> None:
            super().step()
            show_open_segment()
            if core.state.step % 40 == 0:
                tape.flush()
                print(f"flushed {len(tape)}", flush=True)

    driver = Driver(engine, seed, StormResult(spec, [], tape))
    texts = 0
    try:
        for batch in range(1 << 30):
            for command in storm_commands(seed * 100_003 + batch, 200):
                if command == "add" and rng.random() < 0.25:  # a text request, stop strings
                    stop = tuple(chr(rng.randrange(33, 127)) for _ in range(rng.randint(1, 2)))
                    params = SamplingParams(max_tokens=rng.randint(1, 40), stop=stop)
                    engine.add_request(f"t{texts}", "hello " * rng.randint(1, 6), params)
                    texts += 1
                else:
                    driver.issue(command)
                show_open_segment()
            driver.drain()  # every request finishes now and then: the queues stay short
    except Exception as exc:
        # As the engine core process does (engine_core_proc): the failure on the tape, when
        # the engine did not record it itself, then the tape closed as it stands.
        if core.dead_reason is None:
            with contextlib.suppress(Exception):
                core.fail(type(exc).__name__, f"engine: {exc}")
        with contextlib.suppress(Exception):
            engine.close()
        raise


# -- the parent: kill, wait, check -------------------------------------------------------------


@dataclass
class KillPoint:
    index: int
    victim: str
    delay_s: float
    segment_seconds: float
    retention_bytes: int
    killed: str = ""  # what was killed (the writer's segment file), or why nothing was
    segments: int = 0  # segment files left
    events: int = 0  # in the directory read as one tape
    flushed: int = 0  # events the engine had flushed before the kill
    engine_exit: int | None = None
    ended_with_error: int = 0  # segments that end with an EngineError
    findings: tuple[str, ...] = ()
    problem: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problem

    def line(self) -> str:
        mark = "ok" if self.ok else f"FAILED: {self.problem}"
        return (
            f"point {self.index} {self.victim} after {self.delay_s:.2f} s ({self.killed}): "
            f"{self.segments} segments, {self.events} events, exit {self.engine_exit}, "
            f"{self.ended_with_error} ending with an error, findings "
            f"{', '.join(self.findings) or 'none'}: {mark}"
        )


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    """The children of every thread of `pid` (a segment's writer is started by the thread
    that rotates the tape)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return found


def _writers(pid: int) -> list[tuple[str, int]]:
    """(segment file, pid) of the engine's tape writer processes, oldest segment first."""
    found = []
    for child in _children(pid):
        cmd = _cmdline(child)
        if len(cmd) >= 4 and cmd[2].endswith(_WRITER):
            found.append((cmd[3], child))
    return sorted(found)


def _writers_of(directory: str) -> list[int]:
    """Every live tape writer of a segment in `directory` (whoever its parent is now)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            cmd = _cmdline(int(name))
            if len(cmd) >= 4 and cmd[2].endswith(_WRITER) and cmd[3].startswith(directory):
                if not _is_zombie(int(name)):
                    found.append(int(name))
    return found


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _kill(point: KillPoint, child: subprocess.Popen[str], open_segment: list[object]) -> None:
    """Kill the point's victim, noting in `point.killed` what it was. `open_segment`: the
    open segment's [writer pid, path], as the engine last said."""
    if point.victim == "engine":
        os.kill(child.pid, signal.SIGKILL)
        point.killed = f"engine pid {child.pid}"
        return
    deadline = time.monotonic() + CATCH_CLOSING_S
    while time.monotonic() < deadline and child.poll() is None:
        open_pid, open_path = open_segment
        writers = _writers(child.pid) if open_pid else []
        if point.victim == "open_writer":
            victims = [(path, pid) for path, pid in writers if pid == open_pid]
        elif point.victim == "closing_writer":
            victims = [(path, pid) for path, pid in writers if path < str(open_path)]
        else:  # the spare: the next segment's file, made ahead
            victims = [(path, pid) for path, pid in writers if path > str(open_path)]
        if not victims:
            time.sleep(0.0005)
            continue
        path, pid = victims[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # it finished between the listing and the kill
        point.killed = f"writer of {os.path.basename(path)}"
        return
    point.killed = "nothing"
    point.problem = f"no {point.victim} to kill (engine exit {child.poll()})"


def run_kill_point(
    out_dir: str | os.PathLike[str], index: int, seed: int, victim: str | None = None
) -> KillPoint:
    """One kill point (its choices drawn from (seed, index)), run and checked."""
    t0 = time.monotonic()
    rng = random.Random(f"kill-{seed}-{index}")
    point = KillPoint(
        index,
        victim or rng.choice(VICTIMS),
        delay_s=round(rng.uniform(0.05, 1.5), 3),
        segment_seconds=round(rng.uniform(0.02, 0.05), 3),
        retention_bytes=rng.choice([0, 300 << 10]),
    )
    os.makedirs(out_dir, exist_ok=True)
    directory = os.path.join(os.fspath(out_dir), f"point-{index}")
    child = subprocess.Popen(
        [
            sys.executable,
            str(HERE),
            "--child",
            directory,
            "--seed",
            str(seed * 1000 + index),
            "--segment-seconds",
            str(point.segment_seconds),
            "--retention-bytes",
            str(point.retention_bytes),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stderr is not None
    err: list[str] = []
    stderr = child.stderr
    err_reader = threading.Thread(target=lambda: err.extend(stderr), daemon=True)
    err_reader.start()
    try:
        ready = child.stdout.readline().split()
        if not ready or ready[0] != "ready":
            child.kill()
            child.wait()
            err_reader.join(5)
            point.problem = f"the engine did not start: {''.join(err)[-2000:]}"
            return point
        flushed = [0]
        open_segment: list[object] = [0, ""]

        def follow() -> None:
            for line in child.stdout:  # type: ignore[union-attr]
                if line.startswith("flushed "):
                    flushed[0] = int(line.split()[1])
                elif line.startswith("open "):
                    _, pid, path = line.split(maxsplit=2)
                    open_segment[:] = [int(pid), path.strip()]

        threading.Thread(target=follow, daemon=True).start()
        time.sleep(point.delay_s)
        point.flushed = flushed[0]  # read before the kill: the tape holds at least this
        if child.poll() is not None:
            point.problem = f"the engine exited before the kill (exit {child.returncode})"
        else:
            _kill(point, child, open_segment)
        if point.victim == "spare_writer" and not point.problem:
            # The engine makes the next segment's file again in its place and goes on: it
            # must still be running two segments later, and then it is killed itself.
            time.sleep(2 * point.segment_seconds + 0.5)
            if child.poll() is not None:
                point.problem = (
                    f"the engine stopped (exit {child.returncode}) after the kill of the "
                    "writer of a segment file it had not opened yet"
                )
            else:
                child.send_signal(signal.SIGKILL)
        try:
            point.engine_exit = child.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            point.problem = point.problem or (
                f"the engine did not exit within {EXIT_TIMEOUT_S} s of the kill of its "
                f"{point.killed}"
            )
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    err_reader.join(5)
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while (left := _writers_of(directory)) and time.monotonic() < deadline:
        time.sleep(0.01)
    if left and not point.problem:
        point.problem = f"tape writers {left} still running {EXIT_TIMEOUT_S} s after the kill"
    if not point.problem:
        point.problem = check_directory(directory, point, rng)
    if point.problem and err:
        point.problem += f"\n  the engine's stderr ends: {''.join(err)[-1500:]}"
    point.wall_s = round(time.monotonic() - t0, 3)
    if point.ok:
        shutil.rmtree(directory, ignore_errors=True)
    return point


def _verify_problem(what: str, source: str) -> str:
    """What is wrong with `source` as a tape, in one line (empty when it verifies)."""
    from tokentape.replay.verify import verify

    try:
        result = verify(source)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the finding
        return f"{what} does not verify: {type(exc).__name__}: {_short(str(exc))}"
    if result.ok:
        return ""
    d = result.first_divergence
    return f"{what} does not verify: {_short(d.format()) if d else 'no divergence given'}"


def _runs_of_segments(files: list[str]) -> list[list[str]]:
    """The segment files split where one does not end with SegmentClosed though another
    follows: a writer killed before its last commit, whose repair ends the segment with an
    EngineError saying what was lost (any other end there is a problem of its own, which
    the verification of the run finds)."""
    from tokentape.events import schema as ev
    from tokentape.replay.tape import load_tape

    runs: list[list[str]] = [[]]
    for i, path in enumerate(files):
        runs[-1].append(path)
        if i == len(files) - 1:
            break
        tape = load_tape(path)
        last = next(iter(e for _, e in tape.events(max(len(tape) - 1, 0))), None)
        if not isinstance(last, ev.SegmentClosed) and isinstance(last, ev.EngineError):
            runs.append([])
    return runs


def _copy_segments(directory: str, files: list[str], dest: str) -> str:
    """A directory holding the manifest and these segment files: a tape of its own."""
    from tokentape.events.segment_dir import MANIFEST

    os.mkdir(dest)
    shutil.copy(os.path.join(directory, MANIFEST), dest)
    for path in files:
        shutil.copy(path, dest)
    return dest


def _short(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _holds_events(path: str) -> bool:
    from tokentape.events.sqlite_reader import SQLiteTapeReader

    try:
        reader = SQLiteTapeReader(path)
    except Exception:  # noqa: BLE001 - not even a header: a file made halfway
        return False
    try:
        return len(reader) > 0
    finally:
        reader.close()


def check_directory(directory: str, point: KillPoint, rng: random.Random) -> str:
    """What is wrong with the tape the kill left in `directory` ("" when nothing; every
    problem found otherwise, joined by "; ")."""
    from tokentape.events.segment_dir import segment_files
    from tokentape.events.sqlite_reader import tape_file_status
    from tokentape.postmortem import postmortem
    from tokentape.replay.tape import load_tape
    from tokentape.replay.verify import verify

    files = segment_files(directory)
    # The next segment's file, made ahead and never opened (its writer killed, or the engine
    # killed first): no event in it. Readers pass over it; a front end removes it. So does a
    # file the engine was making when it died (`.creating`: never under a segment's name).
    unopened = files.pop() if files and not _holds_events(files[-1]) else None
    point.segments = len(files)
    if not files:
        return "no segment file in the directory"
    problems = []
    beside = sorted(
        n
        for n in os.listdir(directory)
        if n.endswith(("-wal", "-shm", "-journal", ".tmp"))
        and ".creating" not in n
        and not (unopened is not None and n.startswith(os.path.basename(unopened)))
    )
    if beside:
        problems.append(f"files left beside the segments: {beside}")
    for path in files:
        name = os.path.basename(path)
        try:
            if not tape_file_status(path).finished:
                problems.append(f"{name} is still in WAL mode: its writer did not finish")
                continue
            result = verify(path)
        except Exception as exc:  # noqa: BLE001 - any failure to read a segment is the finding
            problems.append(f"{name} does not verify alone: {type(exc).__name__}: {exc}")
            continue
        if not result.ok:
            problems.append(_verify_problem(f"{name} alone", path))
        point.ended_with_error += bool(result.ended_with_error)
    # A writer killed before its last commit loses the segment's tail (its SegmentClosed
    # among it, said by the EngineError the repair ends it with): the directory then reads
    # as runs of segments split there, each of which must verify as one tape.
    runs = _runs_of_segments(files)
    gaps = len(runs) - 1
    for run in runs:
        first, last = os.path.basename(run[0]), os.path.basename(run[-1])
        if len(runs) == 1:
            source = directory
        else:
            source = _copy_segments(directory, run, f"{directory}-{first}-{last}")
        problem = _verify_problem(
            "the directory" if len(runs) == 1 else f"segments {first} to {last}", source
        )
        if problem:
            problems.append(problem)
        elif source != directory:
            shutil.rmtree(source)
    if not problems:
        tape = load_tape(_copy_segments(directory, runs[-1], f"{directory}-last-run"))
        point.events = len(tape)
        # The events recorded in all: the last segment's first seq plus what it holds.
        last = tape.reader.segments[-1]  # type: ignore[attr-defined]
        total = last.snapshot.seq_offset + last.num_events
        if total < point.flushed and not gaps:
            problems.append(f"the tape ends at event {total}, but {point.flushed} were flushed")
        shutil.rmtree(f"{directory}-last-run")
    run = max(runs, key=len)
    if len(run) >= 3:  # a run of consecutive segments, read as a tape of its own
        i = rng.randrange(len(run) - 1)
        j = rng.randrange(i + 2, len(run) + 1)
        part = _copy_segments(directory, run[i:j], f"{directory}-segments-{i}-{j - 1}")
        problem = _verify_problem(f"segments {i}-{j - 1}", part)
        if problem:
            problems.append(problem)
        else:
            shutil.rmtree(part)
    try:
        report = postmortem(directory)
    except Exception as exc:  # noqa: BLE001
        problems.append(f"postmortem failed: {type(exc).__name__}: {exc}")
    else:
        point.findings = tuple(sorted({f.kind for f in report.findings}))
        allowed = ALLOWED_FINDINGS | ({"tape_damaged"} if gaps else set())  # the gap, named
        problems += [
            f"postmortem finding {f.kind}: {_short(f.message)}"
            for f in report.findings
            if f.kind not in allowed
        ]
    return "; ".join(problems)


def run_kill_points(
    n: int,
    seed: int,
    out_dir: str | os.PathLike[str],
    victims: Sequence[str] | None = None,
    on_point: Callable[[KillPoint], None] | None = None,
) -> list[str]:
    """Run `n` kill points; the failures, one string each (empty: all passed). `victims`:
    the victim of each point in turn (default: drawn at random)."""
    os.makedirs(out_dir, exist_ok=True)
    failures = []
    for i in range(n):
        victim = victims[i] if victims is not None and i < len(victims) else None
        point = run_kill_point(out_dir, i, seed, victim)
        if on_point is not None:
            on_point(point)
        if not point.ok:
            failures.append(point.line())
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--points", type=int, default=50, help="kill points to run (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="DIR", help="keep failed points' tapes here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--segment-seconds", type=float, default=0.03, help=argparse.SUPPRESS)
    p.add_argument("--retention-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        run_child(args.child, args.seed, args.segment_seconds, args.retention_bytes)
        return 0
    t0 = time.monotonic()
    points: list[KillPoint] = []

    def report(point: KillPoint) -> None:
        points.append(point)
        print(f"[{len(points)}/{args.points}] {point.line()}", flush=True)

    out = args.out or tempfile.mkdtemp(prefix="flight-recorder-kills-")
    failures = run_kill_points(args.points, args.seed, out, on_point=report)
    wall = time.monotonic() - t0
    kinds = Counter(p.victim for p in points)
    failed = Counter(p.victim for p in points if not p.ok)
    print(
        f"\n{len(points)} kill points in {wall:.1f} s: "
        + ", ".join(f"{kinds[v]} {v} ({failed[v]} failed)" for v in VICTIMS)
        + f"; segments per point median {sorted(p.segments for p in points)[len(points) // 2]}"
        + f", {sum(p.ended_with_error for p in points)} segments ending with an EngineError"
    )
    if failures:
        print(f"{len(failures)} failed (kept under {out}):")
        for line in failures:
            print(f"  {line}")
        return 1
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    print("every point passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
