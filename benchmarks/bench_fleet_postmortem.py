"""The fleet postmortem (`tokentape postmortem DIR`): 1,000 tapes of 10,000 events each,
analysed by a pool of worker processes (and, with --ray, as Ray tasks) against one process,
in the same run, on the same tapes.

The tapes are recorded first, in parallel, by real engines on the oracle model (async depth 2,
2 speculative tokens, a KV cache small enough for KV-pressure preemptions, a
pause(keep, clear_cache) / resume and a prefix-cache reset every few hundred steps; every
tenth under the `flag` policy, so the fleet has findings), into a temporary directory that is
removed at the end. Then, timed:

- one process: `fleet_postmortem(DIR, jobs=1)`, every tape in this process;
- process pool: `fleet_postmortem(DIR, jobs=J)` (J = --jobs, default: the CPUs available);
- ray (with --ray): `fleet_postmortem(DIR, use_ray=True)` on a local Ray instance of J CPUs,
  started before the timing (its start-up is reported apart).

For each: wall time, CPU time of this process, and CPU time of the helper processes (the
pool's workers: getrusage(RUSAGE_CHILDREN) once they are reaped; Ray: every live process
below this one, raylet, GCS and workers, from /proc). The reports must agree.

    python benchmarks/bench_fleet_postmortem.py [--tapes 1000] [--events 10000] [--jobs J]
        [--ray] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import random
import resource
import time
from collections.abc import Callable
from typing import Any

import _common as c
from baselines import procstat

from tokentape import LLM, SamplingParams
from tokentape.postmortem.fleet import FleetReport, default_jobs, fleet_postmortem


def record_tape(path: str, num_events: int, seed: int) -> int:
    """One engine's tape, of about `num_events` events; returns how many it holds."""
    rng = random.Random(seed)
    policy = "flag" if seed % 10 == 9 else "epoch"
    with LLM(
        model="oracle",
        tape=path,
        max_num_seqs=8,
        num_kv_blocks=64,
        block_size=16,
        seed=seed,
        num_speculative_tokens=2,
        discard_policy=policy,
    ) as llm:
        engine = llm.llm_engine
        next_id = steps = 0
        while engine.engine_core.state.num_events < num_events:
            while engine.get_num_unfinished_requests() < 12:
                prompt = [rng.randrange(3, 259) for _ in range(rng.randint(8, 96))]
                engine.add_request(
                    str(next_id),
                    prompt,
                    SamplingParams(max_tokens=rng.randint(16, 160), seed=next_id),
                )
                next_id += 1
            engine.step()
            steps += 1
            if steps % 500 == 0:
                engine.pause_generation(mode="keep", clear_cache=True)
                engine.resume_generation()
            elif steps % 500 == 250:
                engine.reset_prefix_cache(reset_running_requests=True)
        while engine.has_unfinished_requests():  # every request on the tape completes
            engine.step()
        return engine.engine_core.state.num_events


def record_fleet(directory: str, num_tapes: int, num_events: int, jobs: int) -> list[int]:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [
            pool.submit(record_tape, os.path.join(directory, f"engine-{i}.tape"), num_events, i)
            for i in range(num_tapes)
        ]
        return [f.result() for f in futures]


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(
    run: Callable[[], FleetReport], helpers: Callable[[], float]
) -> tuple[FleetReport, dict[str, float]]:
    h0, p0, t0 = helpers(), time.process_time(), time.perf_counter()
    report = run()
    wall = time.perf_counter() - t0
    return report, {
        "wall_s": wall,
        "cpu_this_s": time.process_time() - p0,
        "cpu_helpers_s": helpers() - h0,
        "cpu_in_tasks_s": sum(r.cpu_s for r in report.tapes),
    }


def comparable(report: FleetReport) -> Any:
    return [
        (r.engine, [(f.kind, f.request_ids, f.steps) for f in r.findings], r.error)
        for r in report.tapes
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tapes", type=int, default=1000, help="tapes in the fleet (default 1,000)")
    p.add_argument("--events", type=int, default=10_000, help="events per tape (default 10,000)")
    p.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        help="worker processes / Ray CPUs (default: the CPUs available)",
    )
    p.add_argument(
        "--ray", action="store_true", help="also time the fleet postmortem on a local Ray instance"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()
    tmp = c.TempDir()
    try:
        t0 = time.perf_counter()
        sizes = record_fleet(tmp.path, args.tapes, args.events, args.jobs)
        record_s = time.perf_counter() - t0
        total = sum(sizes)
        results: dict[str, dict[str, float]] = {}
        reports: dict[str, FleetReport] = {}
        reports["one process"], results["one process"] = timed(
            lambda: fleet_postmortem(tmp.path, jobs=1), children_cpu
        )
        reports["process pool"], results["process pool"] = timed(
            lambda: fleet_postmortem(tmp.path, jobs=args.jobs), children_cpu
        )
        ray_start_s = None
        if args.ray:
            import logging

            import ray

            t0 = time.perf_counter()
            ray.init(num_cpus=args.jobs, include_dashboard=False, logging_level=logging.WARNING)
            ray_start_s = time.perf_counter() - t0
            me = os.getpid()

            def ray_helpers() -> float:
                return sum(sec for pid, (_, sec) in procstat.tree_cpu(me).items() if pid != me)

            try:
                reports["ray"], results["ray"] = timed(
                    lambda: fleet_postmortem(tmp.path, use_ray=True), ray_helpers
                )
            finally:
                ray.shutdown()
        base = comparable(reports["one process"])
        agree = all(comparable(r) == base for r in reports.values())
        one = results["one process"]["wall_s"]
        rows = [
            [
                name,
                f"{r['wall_s']:.1f}",
                f"{one / r['wall_s']:.2f}x",
                f"{r['cpu_this_s']:.1f}",
                f"{r['cpu_helpers_s']:.1f}",
                f"{r['cpu_in_tasks_s']:.1f}",
                c.fmt_rate(total / r["wall_s"]),
            ]
            for name, r in results.items()
        ]
        summary = reports["one process"].summary
        md = "\n".join(
            [
                f"### fleet postmortem: {args.tapes:,} tapes, {total:,} events "
                f"({total / args.tapes:,.0f} per tape), --jobs {args.jobs}",
                "",
                f"Recorded in {record_s:.0f} s ({args.jobs} processes). "
                f"Findings: {summary.errors} error(s), {summary.warnings} warning(s) "
                f"on {summary.failed} tapes; the reports agree: {agree}."
                + (
                    f" Ray started in {ray_start_s:.1f} s (not in its wall time)."
                    if ray_start_s is not None
                    else ""
                ),
                "",
                c.md_table(
                    [
                        "variant",
                        "wall s",
                        "speed-up",
                        "CPU s, this process",
                        "CPU s, helper processes",
                        "CPU s, in the analyses",
                        "events/s",
                    ],
                    rows,
                ),
            ]
        )
        c.emit(
            {
                "bench": "fleet_postmortem",
                "tapes": args.tapes,
                "events": total,
                "jobs": args.jobs,
                "record_s": record_s,
                "ray_start_s": ray_start_s,
                "results": results,
                "agree": agree,
                "machine": c.machine_info(),
                "summary": [
                    {
                        "name": f"fleet postmortem of {args.tapes:,} tapes, {name}",
                        "value": f"{r['wall_s']:.1f} s ({one / r['wall_s']:.2f}x one process)",
                        "target": "",
                        "pass": agree,
                    }
                    for name, r in results.items()
                ],
            },
            md,
            args.json,
        )
        if not agree:
            raise SystemExit("the reports of the variants differ")
    finally:
        tmp.cleanup()


if __name__ == "__main__":
    main()
