"""What a chaos storm against vLLM's scheduler costs, beside the same storm against tokentape's
engine with the oracle, per scheduler step; and what shrinking a finding costs.

Each seed's storm (tokentape/chaos/vllm_storms.py's storm_spec: requests added mid-run,
resets with and without running requests, pauses in every mode, aborts, sleeps and wake-ups by
tags, KV pressure, drafts)
runs twice, in alternation:
- against vLLM's own Scheduler/AsyncScheduler, recorded with the live consistency checks on,
  in vLLM's Python (the driver process, started once; `stepping`: the driver's loop, in that
  process; `seed`: the round trip for the seed, building the scheduler and writing its tape,
  plus the postmortem and the oracle's streams here);
- against tokentape's engine, the oracle as the model and the same shape (pipeline depth 2 for
  async scheduling, the drafts, KV blocks, token budget, seats), the same commands at the same
  steps, the tape in memory (`stepping`: the engine's loop; `seed`: building it, the loop and
  the postmortem).
Steps are scheduler steps that ran tokens (a StepScheduled on either tape); the engine steps
that ran nothing (a pipeline filling, a hang's idle steps) cost time on both sides but are not
counted. Then the first finding's storm is shrunk (the shrink's
driver runs and checks, one core) and timed; the target is under a minute on 2 cores.

    python benchmarks/bench_chaos_vllm.py --release 0.20.0 --seeds 30 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from tokentape.chaos.vllm_storms import VLLMChaos, storm_spec
from tokentape.integrations.vllm.driver_process import VLLMNotFound, check_release, find_vllm


def run_on_tokentape(spec: dict[str, Any]) -> tuple[int, float, float]:
    """(scheduler steps, stepping seconds, seed seconds) of the storm on tokentape's engine."""
    from tokentape.engine.config import EngineConfig
    from tokentape.engine.llm_engine import LLMEngine
    from tokentape.events.schema import SamplingParams
    from tokentape.postmortem import postmortem

    start = time.perf_counter()
    config = EngineConfig(
        model="oracle",
        pipeline_depth=2 if spec["async"] else 1,
        num_speculative_tokens=spec["num_speculative_tokens"],
        block_size=spec["block_size"],
        num_kv_blocks=spec["num_blocks"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        seed=0,
    )
    engine = LLMEngine.from_engine_args(config, None)
    pending = sorted(spec["requests"], key=lambda r: r["add_at"])
    resets: dict[int, list[bool]] = {}
    for s, running in spec["reset_at"]:
        resets.setdefault(s, []).append(running)
    pauses = {s: (m, c) for s, m, c in spec["pause_at"]}
    aborts: dict[int, list[str]] = {}
    for s, rid in spec["abort_at"]:
        aborts.setdefault(s, []).append(rid)
    sleeps = {s: (level, mode) for s, level, mode in spec.get("sleep_at", ())}
    wakes: dict[int, list[list[str] | None]] = {}
    for s, tags in spec.get("wake_at", ()):
        wakes.setdefault(s, []).append(tags)
    last_wake = max(wakes, default=-1)
    added: set[str] = set()
    step = 0
    loop = time.perf_counter()
    while pending or engine.has_unfinished_requests() or step <= last_wake:
        while pending and pending[0]["add_at"] <= step:
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True)
            engine.add_request(r["id"], r["prompt"], params)
            added.add(r["id"])
        for running in resets.get(step, ()):
            engine.reset_prefix_cache(reset_running_requests=running)
        live = [r for r in aborts.get(step, ()) if r in added]
        if live:
            engine.abort_request(live)
        if step in pauses:
            engine.pause_generation(*pauses[step])
            engine.resume_generation()
        if step in sleeps:
            engine.sleep(*sleeps[step])
        for tags in wakes.get(step, ()):
            if engine.is_sleeping():  # vLLM's wake-up of an engine awake only warns
                engine.wake_up(tags)
        engine.step()
        step += 1
    stepping = time.perf_counter() - loop
    engine.close()
    postmortem(engine.engine_core.tape)
    return engine.engine_core.state.step, stepping, time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--release", default="0.20.0", help="vLLM release (default 0.20.0)")
    p.add_argument("--seeds", type=int, default=30)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()
    try:
        found = find_vllm()
        release = check_release(found, args.release)
    except VLLMNotFound as exc:
        print(exc, file=sys.stderr)
        return 2
    totals = {
        k: 0.0 for k in ("v_steps", "v_step_s", "v_seed_s", "t_steps", "t_step_s", "t_seed_s")
    }
    first_finding: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-chaos-vllm-") as out:
        with VLLMChaos(found, None if release == found.version else release, out, False) as c:
            for seed in range(args.seeds):
                spec = storm_spec(seed)
                tape = os.path.join(c.work, "bench.tape")
                start = time.perf_counter()
                checked = c.run_spec(spec, tape)
                totals["v_seed_s"] += time.perf_counter() - start
                totals["v_steps"] += checked.result["scheduled_steps"]
                totals["v_step_s"] += checked.result["seconds"]
                if checked.primary is not None and first_finding is None:
                    first_finding = spec
                steps, stepping, whole = run_on_tokentape(spec)
                totals["t_steps"] += steps
                totals["t_step_s"] += stepping
                totals["t_seed_s"] += whole
            shrink: dict[str, Any] = {}
            if first_finding is not None:
                from tokentape.chaos.shrink import shrink_spec

                target = c.run_spec(first_finding, tape).primary
                runs = 0

                def fails(candidate: dict[str, Any]) -> bool:
                    nonlocal runs
                    runs += 1
                    return target in c.run_spec(candidate, tape).signatures

                start = time.perf_counter()
                minimal = shrink_spec(first_finding, fails)
                shrink = {
                    "seed": first_finding["seed"],
                    "finding": str(target),
                    "requests": f"{len(first_finding['requests'])} -> {len(minimal['requests'])}",
                    "runs": runs,
                    "seconds": time.perf_counter() - start,
                }
    v_rate = totals["v_steps"] / totals["v_step_s"]
    t_rate = totals["t_steps"] / totals["t_step_s"]
    v_seed = totals["v_steps"] / totals["v_seed_s"]
    t_seed = totals["t_steps"] / totals["t_seed_s"]
    print(f"storms of {args.seeds} seeds, vLLM {release} against tokentape's oracle engine")
    print()
    print(
        "| engine | scheduler steps | steps/s stepping | steps/s per seed (build, tape, checks) |"
    )
    print("|---|---:|---:|---:|")
    print(
        f"| vLLM {release} scheduler, recorded | {totals['v_steps']:,.0f} | {v_rate:,.0f} "
        f"| {v_seed:,.0f} |"
    )
    print(f"| tokentape, oracle | {totals['t_steps']:,.0f} | {t_rate:,.0f} | {t_seed:,.0f} |")
    if shrink:
        print()
        print(
            f"shrink of seed {shrink['seed']} ({shrink['finding']}): "
            f"requests {shrink['requests']}, "
            f"{shrink['runs']} runs, {shrink['seconds']:.1f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "release": release,
                    "seeds": args.seeds,
                    **totals,
                    "vllm_steps_per_s": v_rate,
                    "tokentape_steps_per_s": t_rate,
                    "vllm_seed_steps_per_s": v_seed,
                    "tokentape_seed_steps_per_s": t_seed,
                    "shrink": shrink,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
