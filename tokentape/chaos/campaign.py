"""A chaos campaign: many seeded storms (tokentape/chaos/storms.py), each with perturbations
drawn from its seed, checked against the oracle and by the postmortem; the tape and the
postmortem report of every run with a finding are kept.

    summary = run_campaign(range(1000), ChaosOptions(), "chaos-out/", jobs=2)
    summary.seeds_per_hour, summary.runs_with_findings

What a seed perturbs (`chaos_spec`): the pipeline depth (1-4), the speculative tokens (0-3),
preemption pressure (a KV cache of 12 to 32 blocks of 4 tokens, 2 to 8 running requests,
a token budget of 8 to 32), and the storm itself: adds, aborts, prefix-cache resets with and
without running requests, pauses in every mode, resumes, sleeps and wake-ups, abort-all. A
finding is a request whose stream is not the oracle's, a postmortem finding, or a storm that
hangs or fails. Under the exact
policies (`epoch`, `deliver`) a finding is a bug; under `flag` and `counter` it is expected.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import msgspec

from tokentape.chaos.storms import StormResult, StormSpec, run_storm
from tokentape.events.discard import DISCARD_POLICIES

_DEPTHS = (1, 2, 2, 3, 4)  # vLLM's async default (2) twice as often
_SPECULATIVE = (0, 0, 1, 2, 3)
_KV_BLOCKS = (12, 16, 24, 32)  # of 4 tokens: a few requests fill the cache, preemptions follow
_MAX_SEQS = (2, 4, 8)
_BUDGETS = (8, 16, 32)


@dataclass(frozen=True, slots=True)
class ChaosOptions:
    discard_policy: str = "epoch"
    num_commands: int = StormSpec(seed=0).num_commands
    model: str = "oracle"

    def __post_init__(self) -> None:
        if self.discard_policy not in DISCARD_POLICIES:
            raise ValueError(
                f"unknown discard_policy {self.discard_policy!r}; choose one of "
                f"{sorted(DISCARD_POLICIES)}"
            )
        if type(self.num_commands) is not int or self.num_commands < 1:
            raise ValueError(f"num_commands must be an integer >= 1, got {self.num_commands!r}")


def chaos_spec(seed: int, options: ChaosOptions) -> StormSpec:
    """The storm of a seed: its engine shape drawn from the seed (the same seed, the same run)."""
    rng = random.Random(f"chaos-{seed}")
    return StormSpec(
        seed=seed,
        pipeline_depth=rng.choice(_DEPTHS),
        num_speculative_tokens=rng.choice(_SPECULATIVE),
        discard_policy=options.discard_policy,
        num_commands=options.num_commands,
        model=options.model,
        num_kv_blocks=rng.choice(_KV_BLOCKS),
        max_num_seqs=rng.choice(_MAX_SEQS),
        max_num_batched_tokens=rng.choice(_BUDGETS),
    )


class SeedOutcome(msgspec.Struct):
    """One seed's run: its shape, what it did, what was found, and where it was kept."""

    seed: int
    pipeline_depth: int
    num_speculative_tokens: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_events: int = 0
    num_preemptions: int = 0
    num_resets: int = 0
    broken_streams: int = 0  # requests whose stream is not the oracle's
    finding_kinds: dict[str, int] = {}
    bug_classes: dict[str, int] = {}
    error: str | None = None  # the storm hung or failed
    tape: str | None = None  # kept, with a finding
    report: str | None = None
    seconds: float = 0.0
    cpu_s: float = 0.0  # CPU time of the process that ran it (what a busy machine cannot take)

    @property
    def has_finding(self) -> bool:
        return bool(self.broken_streams or self.finding_kinds or self.error)


def _stem(spec: StormSpec) -> str:
    return (
        f"chaos-{spec.discard_policy}-seed{spec.seed}-d{spec.pipeline_depth}"
        f"-k{spec.num_speculative_tokens}-kv{spec.num_kv_blocks}"
    )


def _keep(result: StormResult, report: object, out_dir: str, stem: str) -> tuple[str, str]:
    """Write the run's tape (an SQLite file) and its postmortem report (text and JSON)."""
    from tokentape.events.sqlite_store import SQLiteTape
    from tokentape.postmortem.report_text import print_report
    from tokentape.replay import load_tape

    tape_path = os.path.join(out_dir, f"{stem}.tape")
    tape = load_tape(result.tape)  # type: ignore[arg-type]  # a MemoryTape
    out = SQLiteTape(tape_path, tape.header)
    for _, event in tape.events():
        out.append(event)
    out.close()
    report_path = os.path.join(out_dir, f"{stem}.postmortem.txt")
    with open(report_path, "w") as f:
        print_report(report, f)  # type: ignore[arg-type]
    with open(os.path.join(out_dir, f"{stem}.postmortem.json"), "wb") as f:
        f.write(msgspec.json.encode(report))
    return tape_path, report_path


def run_seed(seed: int, options: ChaosOptions, out_dir: str) -> SeedOutcome:
    """Run one seed's storm, check it, and keep its tape and report if anything was found."""
    from tokentape.postmortem import postmortem

    start, cpu = time.perf_counter(), time.process_time()
    spec = chaos_spec(seed, options)
    outcome = SeedOutcome(
        seed,
        spec.pipeline_depth,
        spec.num_speculative_tokens,
        spec.num_kv_blocks,
        spec.max_num_seqs,
        spec.max_num_batched_tokens,
    )
    try:
        result = run_storm(spec)
    except Exception as exc:  # noqa: BLE001 - a hang (StormError) or any failure is a finding
        outcome.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        # Run it again onto a file: the seed replays the same run, now kept.
        path = os.path.join(out_dir, f"{_stem(spec)}.tape")
        try:
            run_storm(spec, tape=path)
        except Exception:  # noqa: BLE001 - the same failure again; the tape holds it
            pass
        outcome.tape = path if os.path.exists(path) else None
        outcome.seconds, outcome.cpu_s = time.perf_counter() - start, time.process_time() - cpu
        return outcome
    report = postmortem(result.tape)  # type: ignore[arg-type]  # a MemoryTape
    outcome.num_events, outcome.num_resets = result.num_events, result.num_resets
    outcome.num_preemptions = result.num_preemptions
    outcome.broken_streams = len(result.oracle_violations())
    outcome.finding_kinds = dict(Counter(f.kind for f in report.findings))
    outcome.bug_classes = dict(Counter(f.bug_class for f in report.findings if f.bug_class))
    if outcome.has_finding:
        outcome.tape, outcome.report = _keep(result, report, out_dir, _stem(spec))
    outcome.seconds, outcome.cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return outcome


def _run_chunk(seeds: list[int], options: ChaosOptions, out_dir: str) -> list[SeedOutcome]:
    return [run_seed(s, options, out_dir) for s in seeds]


def iter_outcomes(
    seeds: Iterable[int], options: ChaosOptions, out_dir: str, jobs: int = 1
) -> Iterator[SeedOutcome]:
    """Each seed's outcome, in seed order: in this process (jobs=1) or a spawn process pool."""
    seeds = list(seeds)
    if jobs <= 1:
        for seed in seeds:
            yield run_seed(seed, options, out_dir)
        return
    chunk = 8  # seeds per task: the pool's round trip is small beside 8 storms
    chunks = [seeds[i : i + chunk] for i in range(0, len(seeds), chunk)]
    context = multiprocessing.get_context("spawn")  # no fork of the caller's threads
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        for outcomes in pool.map(
            _run_chunk, chunks, [options] * len(chunks), [out_dir] * len(chunks)
        ):
            yield from outcomes


@dataclass(slots=True)
class CampaignSummary:
    options: ChaosOptions
    first_seed: int
    num_seeds: int = 0
    wall_s: float = 0.0
    jobs: int = 1
    runs_with_findings: int = 0
    broken_streams: int = 0
    errors: int = 0
    events: int = 0
    preemptions: int = 0
    resets: int = 0
    cpu_s: float = 0.0
    finding_kinds: Counter[str] = field(default_factory=Counter)
    bug_classes: Counter[str] = field(default_factory=Counter)
    found: list[SeedOutcome] = field(default_factory=list)

    @property
    def seeds_per_hour(self) -> float:
        return 3600.0 * self.num_seeds / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def seeds_per_cpu_hour(self) -> float:
        """Seeds per hour of one core's CPU time: the rate on an idle core, whatever else ran."""
        return 3600.0 * self.num_seeds / self.cpu_s if self.cpu_s > 0 else 0.0

    def add(self, o: SeedOutcome) -> None:
        self.num_seeds += 1
        self.events += o.num_events
        self.preemptions += o.num_preemptions
        self.resets += o.num_resets
        self.cpu_s += o.cpu_s
        self.broken_streams += o.broken_streams
        self.errors += o.error is not None
        self.finding_kinds.update(o.finding_kinds)
        self.bug_classes.update(o.bug_classes)
        if o.has_finding:
            self.runs_with_findings += 1
            self.found.append(o)

    def to_json(self) -> dict[str, object]:
        return {
            "discard_policy": self.options.discard_policy,
            "num_commands": self.options.num_commands,
            "first_seed": self.first_seed,
            "seeds": self.num_seeds,
            "jobs": self.jobs,
            "wall_s": self.wall_s,
            "seeds_per_hour": self.seeds_per_hour,
            "cpu_s": self.cpu_s,
            "seeds_per_cpu_hour": self.seeds_per_cpu_hour,
            "runs_with_findings": self.runs_with_findings,
            "broken_streams": self.broken_streams,
            "errors": self.errors,
            "events": self.events,
            "preemptions": self.preemptions,
            "resets": self.resets,
            "finding_kinds": dict(self.finding_kinds),
            "bug_classes": dict(self.bug_classes),
            "found": msgspec.to_builtins(self.found),
        }


def run_campaign(
    seeds: range,
    options: ChaosOptions,
    out_dir: str,
    jobs: int = 1,
    on_outcome: Callable[[SeedOutcome], None] | None = None,
) -> CampaignSummary:
    """Run every seed; `out_dir` (created) receives the kept tapes and reports."""
    os.makedirs(out_dir, exist_ok=True)
    summary = CampaignSummary(replace(options), seeds.start, jobs=jobs)
    start = time.perf_counter()
    for outcome in iter_outcomes(seeds, options, out_dir, jobs):
        summary.add(outcome)
        summary.wall_s = time.perf_counter() - start
        if on_outcome is not None:
            on_outcome(outcome)
    summary.wall_s = time.perf_counter() - start
    return summary
