"""An interleaved A/B of `LLM` settings, or of source trees, on bench_generate's workloads:
each variant runs in a fresh process per round (so no variant inherits another's warm state),
rounds alternate, each starting one variant later than the last, and the medians are
reported with the CPU of the engine's process and of its tape writer, and beside them the
median and range of each round's own ratio to the first variant.

A variant is `NAME=JSON` (engine arguments beside the model; `"tape": false` for none) or
`NAME=JSON@TREE` (the same, with TREE first on PYTHONPATH: an older checkout, for a
before/after in one window).

    python benchmarks/ab_defaults.py --rounds 3 'defaults={}' 'async={"pipeline_depth": 2}'
    git archive de0da2e | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    (cd /tmp/old && python setup.py build_ext --inplace)   # its compiled modules, as here
    python benchmarks/ab_defaults.py --rounds 3 'before={}@/tmp/old' 'after={}'
    python benchmarks/ab_defaults.py --config qwen3-0.6b --num-prompts 16 --output-len 32 \\
        'sync={}' 'async={"pipeline_depth": 2}'
    python benchmarks/ab_defaults.py --num-prompts 16 --prompt-len 2048 --output-len 128 'd={}'

With `--one SPEC` (what each child runs) it can run under a profiler in this process:
    python -m cProfile -s tottime benchmarks/ab_defaults.py x --one \\
        '{"config": "tiny", "n": 16, "prompt_len": 2048, "output_len": 128, "seed": 0,
          "engine_args": {}}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant, one round, in this process (the child side)."""
    sys.path.insert(0, HERE)
    from baselines import procstat
    from bench_generate import workload

    from tokentape import LLM, SamplingParams
    from tokentape.engine.model.model_config import BUILTIN_CONFIGS

    vocab = BUILTIN_CONFIGS[spec["config"]].vocab_size
    prompts, outputs = workload(
        spec["config"], spec["n"], vocab, spec["seed"], spec["prompt_len"], spec["output_len"]
    )
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    args = dict(spec["engine_args"])
    tape: Any = args.pop("tape", True)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            model=spec["config"], tape=os.path.join(tmp, "ab.tape") if tape else False, **args
        )
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        writer = getattr(llm.llm_engine.engine_core.tape, "writer_pid", None)
        w0 = procstat.cpu_seconds(writer) if writer else 0.0
        c0, t = time.process_time(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        cpu = time.process_time() - c0
        writer_cpu = procstat.cpu_seconds(writer) - w0 if writer else 0.0
        result = {
            "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
            "seconds": seconds,
            "cpu": cpu,
            "writer_cpu": writer_cpu,
            "preemptions": sum(
                r.num_preemptions for r in llm.llm_engine.engine_core.state.requests.values()
            ),
            "num_kv_blocks": llm.config.num_kv_blocks,
            "async": llm.config.async_scheduling,
        }
        llm.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", metavar="NAME=JSON[@TREE]")
    p.add_argument("--config", default="tiny", choices=["tiny", "qwen3-0.6b"])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, help="every prompt's length (default: the workload's)")
    p.add_argument(
        "--output-len", type=int, help="every request's output (default: the workload's)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child side: a JSON spec
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    variants = []
    for v in args.variants:
        name, _, rest = v.partition("=")
        engine_json, _, tree = rest.partition("@")
        variants.append((name, json.loads(engine_json or "{}"), tree or None))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    print(f"# ab_defaults: {args.config}, {args.num_prompts} prompts, {args.rounds} rounds")
    for rnd in range(args.rounds):
        # Each round starts one variant later: a variant's place in the round showed up in
        # its time (whatever runs first after another's exit runs slower), so it rotates.
        shift = rnd % len(variants)
        for name, engine_args, tree in variants[shift:] + variants[:shift]:
            spec = {
                "config": args.config,
                "n": args.num_prompts,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "seed": args.seed,
                "engine_args": engine_args,
            }
            env = dict(os.environ)
            if tree:
                env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")])
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "x", "--one", json.dumps(spec)],
                env=env,
                capture_output=True,
                text=True,
                cwd=tree or os.getcwd(),
            )
            if proc.returncode != 0:
                print(f"# {name} failed:\n{proc.stderr[-2000:]}")
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name].append(r)
            print(
                f"# round {rnd + 1}: {name}: {r['tok_s']:,.0f} tok/s ({r['seconds']:.2f} s; "
                f"CPU {r['cpu']:.2f} s, writer {r['writer_cpu']:.3f} s; "
                f"{r['num_kv_blocks']} blocks, {r['preemptions']} preempted, "
                f"async {r['async']}) load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    base = variants[0][0]
    med = {k: statistics.median(r["tok_s"] for r in rs) for k, rs in results.items()}
    print(
        "\n| variant | median tok/s | all rounds | median CPU (s) | writer CPU (s) | vs first "
        "| vs first, paired by round |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        rounds = ", ".join(f"{r['tok_s']:,.0f}" for r in rs)
        # A round's variants run back to back: the ratio within each round leaves out the
        # machine's slower and faster spells, when they last a round (the range says how far).
        paired = sorted(r["tok_s"] / b["tok_s"] for r, b in zip(rs, results[base], strict=True))
        print(
            f"| {name} | {med[name]:,.0f} | {rounds} | "
            f"{statistics.median(r['cpu'] for r in rs):.2f} | "
            f"{statistics.median(r['writer_cpu'] for r in rs):.3f} | "
            f"{med[name] / med[base]:.3f} | "
            f"{statistics.median(paired):.3f} ({paired[0]:.3f}-{paired[-1]:.3f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
