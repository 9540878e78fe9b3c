"""What recording costs vLLM: its CPU engine's throughput with tokentape's RecordingScheduler
(`scheduler_cls="tokentape.integrations.vllm.RecordingScheduler"`, the tape in
$TOKENTAPE_TAPE) against the same engine with its own scheduler. Target: <= 5% slower.

Two side processes (benchmarks/baselines/vllm_generate.py, vLLM's offline `LLM.generate` with
token-id prompts, greedy, each request's own max_tokens) on the tiny model exported as a
checkpoint, started once each and kept alive, run interleaved rounds in the same window
(the order alternates each round; each waits until the other's processes are quiet, since
vLLM's workers spin ~1 s after a request). The recorded engine writes every round onto one
tape, which is verified at the end. Throughput is output tokens per second of a round's
`generate`; the report gives each variant's median and best, and the overhead of recording
by both. Needs vLLM with tokentape installed in its Python (benchmarks/setup_vllm_venv.sh).

    python benchmarks/bench_vllm_recorder.py [--rounds 8] [--requests 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _generate_baselines import Side  # noqa: E402
from baselines.client import SideProcess  # noqa: E402
from baselines.locate import find_vllm  # noqa: E402

from tokentape.engine.model.loader import builtin_model, save_checkpoint  # noqa: E402
from tokentape.postmortem import postmortem  # noqa: E402
from tokentape.replay import load_tape, verify  # noqa: E402

TARGET = 0.05  # recording may cost at most 5% of vLLM's throughput
RECORDER = "tokentape.integrations.vllm.RecordingScheduler"


def workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(16, 96))] for _ in range(n)]
    return prompts, [rng.randint(48, 96) for _ in range(n)]


def start(python: str, name: str, spec: dict[str, Any], env: dict[str, str], workdir: str) -> Side:
    proc = SideProcess(python, "vllm_generate.py", spec, label=name, env=env, workdir=workdir)
    try:
        info = proc.start()
    except BaseException:
        proc.close()
        raise
    side = Side(name, proc, None, info)  # type: ignore[arg-type]
    side.settle()
    return side


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="timed rounds per variant (default 8)")
    p.add_argument("--requests", type=int, default=64, help="requests per round (default 64)")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()
    found, where = find_vllm(args.vllm_python)
    if found is None:
        print(where, file=sys.stderr)
        return 2
    prompts, outputs = workload(args.requests, seed=1)
    with tempfile.TemporaryDirectory(prefix="tokentape-bench-vllm-recorder-") as tmp:
        model = str(save_checkpoint(builtin_model("tiny", 0)[1], Path(tmp) / "tiny"))
        tape = str(Path(tmp) / "recorded.tape")
        spec = {
            "model": model,
            "dtype": "float32",
            "seed": 0,
            "max_model_len": 256,
            "prompts": prompts,
            "max_tokens": outputs,
            "warmup_prompts": 2,
        }
        env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
        sides = {
            "vLLM": start(found.python, "vllm", spec, env, tmp),
            "vLLM recorded": start(
                found.python,
                "vllm-recorded",
                {**spec, "llm": {"scheduler_cls": RECORDER}},
                {**env, "TOKENTAPE_TAPE": tape},
                tmp,
            ),
        }
        assert sides["vLLM recorded"].info.get("scheduler_cls") == RECORDER
        tput: dict[str, list[float]] = {name: [] for name in sides}
        tokens: dict[str, list[list[int]]] = {}
        try:
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for name in order:
                    for other in sides.values():
                        other.settle()
                    reply = sides[name].proc.call("round", tokens=(r == 0))
                    tput[name].append(reply["output_tokens"] / reply["seconds"])
                    if r == 0:
                        tokens[name] = reply["tokens"]
                print(
                    f"round {r + 1}/{args.rounds}: "
                    + ", ".join(f"{n} {tput[n][-1]:.0f} tok/s" for n in sides),
                    file=sys.stderr,
                )
        finally:
            for side in sides.values():
                side.close()
        time.sleep(1.0)  # the engine core's tape writer finishes the file
        checked = verify(tape)
        report = postmortem(tape)
        num_events = len(load_tape(tape))
    plain, rec = tput["vLLM"], tput["vLLM recorded"]
    result = {
        "vllm": found.version,
        "rounds": args.rounds,
        "requests": args.requests,
        "output_tokens_per_round": sum(outputs),
        "median_tok_s": {"vLLM": statistics.median(plain), "vLLM recorded": statistics.median(rec)},
        "best_tok_s": {"vLLM": max(plain), "vLLM recorded": max(rec)},
        "overhead_median": 1 - statistics.median(rec) / statistics.median(plain),
        "overhead_best": 1 - max(rec) / max(plain),
        "rounds_tok_s": tput,
        "same_streams": tokens["vLLM"] == tokens["vLLM recorded"],
        "tape_events": num_events,
        "tape_verifies": checked.ok,
        "tape_findings": len(report.findings),
    }
    print(
        f"## vLLM {found.version} CPU engine, tiny model: recording overhead "
        f"({args.requests} requests, {sum(outputs)} output tokens per round, "
        f"{args.rounds} interleaved rounds)\n"
    )
    print("| variant | median tok/s | best tok/s |\n|---|---|---|")
    for name in tput:
        print(f"| {name} | {result['median_tok_s'][name]:.0f} | {result['best_tok_s'][name]:.0f} |")
    ok = result["overhead_median"] <= TARGET
    print(
        f"\noverhead: {100 * result['overhead_median']:.1f}% by the median, "
        f"{100 * result['overhead_best']:.1f}% by the best round "
        f"(target <= {100 * TARGET:.0f}%: {'met' if ok else 'NOT met'}); greedy streams "
        f"{'identical' if result['same_streams'] else 'DIFFER'}; the tape: {num_events} events, "
        f"{'verifies' if checked.ok else 'does NOT verify'}, {len(report.findings)} findings"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if ok and result["same_streams"] and checked.ok and not report.findings else 1


if __name__ == "__main__":
    raise SystemExit(main())
