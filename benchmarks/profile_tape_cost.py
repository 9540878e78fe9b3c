"""Where the SQLite tape's cost goes on a real run: the engine thread's CPU in
`SQLiteTape.append` (encoding each event) and `commit` (framing a step's rows and writing them
to the writer's pipe), and the writer process's CPU.

The events of one `LLM(model="tiny")` run of bench_generate's 256-prompt workload are
captured once (an in-memory tape, commit by commit), then replayed into a fresh SQLiteTape
`--repeats` times, at the run's own pace (`--pace`: seconds between commits; the engine's
step time), so the writer sees the message rate it sees live while nothing else competes
for the measurement: thread CPU time on this side, the writer's CPU from /proc.

    python benchmarks/profile_tape_cost.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import _common as c
from baselines import procstat

from tokentape import LLM, SamplingParams
from tokentape.events import schema as ev
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.events.store import MemoryTape


def capture(num_prompts: int, seed: int) -> tuple[ev.TapeHeader, list[list[ev.Event]], float]:
    """The events of one run at the defaults, grouped by commit, and the run's seconds."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, 259) for _ in range(rng.randint(32, 256))] for _ in range(num_prompts)
    ]
    params = [
        SamplingParams(max_tokens=rng.randint(64, 256), temperature=0.0, ignore_eos=True)
        for _ in prompts
    ]
    with LLM(model="tiny", tape=None) as llm:
        tape = llm.llm_engine.engine_core.tape
        assert isinstance(tape, MemoryTape)
        marks = [len(tape)]
        # MemoryTape.commit does nothing; this one notes where each commit ends.
        tape.commit = lambda: marks.append(len(tape))  # type: ignore[method-assign]
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        events = [e for _, e in tape.iter_events()]
        header = tape.header
    ends = sorted(set(marks))
    batches = [events[a:b] for a, b in zip(ends, ends[1:]) if b > a]
    return header, batches, seconds


def replay(header: ev.TapeHeader, batches: list[list[ev.Event]], pace: float) -> dict[str, float]:
    tmp = c.TempDir()
    try:
        tape = SQLiteTape(tmp.new("cost"), header)
        time.sleep(0.3)  # the writer's start is not part of the run
        w0 = procstat.cpu_seconds(tape.writer_pid)
        append_s = commit_s = 0.0
        due = time.perf_counter()
        for batch in batches:
            t0 = time.thread_time()
            for e in batch:
                tape.append(e)
            t1 = time.thread_time()
            tape.commit()
            t2 = time.thread_time()
            append_s += t1 - t0
            commit_s += t2 - t1
            due += pace
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
        tape.flush()
        writer_s = procstat.cpu_seconds(tape.writer_pid) - w0
        tape.close()
    finally:
        tmp.cleanup()
    return {"append": append_s, "commit": commit_s, "writer": writer_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pace", type=float, help="seconds between commits (default: the run's)")
    args = p.parse_args()
    header, batches, seconds = capture(args.num_prompts, args.seed)
    pace = args.pace if args.pace is not None else seconds / len(batches)
    n_events = sum(map(len, batches))
    print(
        f"# captured {n_events} events in {len(batches)} commits from a {seconds:.2f} s run "
        f"(load average {os.getloadavg()[0]:.2f}); replaying at {pace * 1e3:.1f} ms a commit",
        flush=True,
    )
    runs = [replay(header, batches, pace) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    engine = med["append"] + med["commit"]
    print(
        c.md_table(
            ["where", "CPU per run (ms, median)", "per commit (µs)"],
            [
                [
                    "engine thread: append (encode)",
                    f"{med['append'] * 1e3:.1f}",
                    f"{med['append'] / len(batches) * 1e6:.0f}",
                ],
                [
                    "engine thread: commit (frame, write)",
                    f"{med['commit'] * 1e3:.1f}",
                    f"{med['commit'] / len(batches) * 1e6:.0f}",
                ],
                [
                    "tape writer process",
                    f"{med['writer'] * 1e3:.1f}",
                    f"{med['writer'] / len(batches) * 1e6:.0f}",
                ],
                ["all", f"{(engine + med['writer']) * 1e3:.1f}", "-"],
            ],
        )
    )
    print(f"writer CPU per run, each repeat (ms): {[round(r['writer'] * 1e3) for r in runs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
