"""The output path's CPU cost, this checkout against another (`--baseline DIR`, e.g. a
`git worktree` of the commit before a change), run in alternation (ABAB...) in fresh
interpreters, each importing tokentape from its own tree. On the oracle (no model compute),
so what is timed is the engine loop, the tape and the output path alone:

- `generate`: `LLM.generate`, 256 prompts x 128 tokens (FINAL_ONLY outputs);
- `delta`, `cumulative`: the engine API's `step()` until done, 128 requests x 128 tokens,
  every output's token ids and text read as a streaming client reads them.

Figures: the process CPU time of the timed part, the median of `--repeats` rounds (each round
runs every workload once on each side); the ratio is this checkout's over the baseline's.

    git worktree add /tmp/base HEAD~3
    python benchmarks/bench_output_path.py --baseline /tmp/base --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

# Run in the tree under test: prints the CPU seconds of one workload.
CHILD = r"""
import sys, time
from tokentape import LLM, SamplingParams
from tokentape.events.schema import RequestOutputKind as K
work = sys.argv[1]
if work == "generate":
    llm = LLM("oracle", tape=None)
    prompts = [[5 + i % 50, 6 + i % 7, 7, 8 + i % 13] for i in range(256)]
    t0 = time.process_time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True), use_tqdm=False)
    dt = time.process_time() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 256 * 128
else:
    kind = K.DELTA if work == "delta" else K.CUMULATIVE
    llm = LLM("oracle", tape=None)
    e = llm.llm_engine
    for i in range(128):
        params = SamplingParams(max_tokens=128, ignore_eos=True, output_kind=kind)
        e.add_request(str(i), [5 + i % 50, 6, 7], params)
    t0 = time.process_time()
    while e.has_unfinished_requests():
        for o in e.step():
            c = o.outputs[0]
            len(c.token_ids), len(c.text)
    dt = time.process_time() - t0
llm.close()
print(dt)
"""
WORKLOADS = ("generate", "delta", "cumulative")


def run(tree: Path, work: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, work], cwd=tree, env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"{tree}: {work} failed:\n{out.stderr}")
    return float(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    p.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    args = p.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for work in WORKLOADS:
            for side, tree in (("baseline", args.baseline.resolve()), ("this", HERE)):
                times.setdefault((work, side), []).append(run(tree, work))
    print("| workload (oracle) | baseline CPU s | this CPU s | this / baseline |")
    print("|---|---|---|---|")
    for work in WORKLOADS:
        a = statistics.median(times[work, "baseline"])
        b = statistics.median(times[work, "this"])
        print(f"| {work} | {a:.4f} | {b:.4f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
