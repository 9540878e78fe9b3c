"""The postmortem of a fleet: every tape of a directory (one per engine) analysed in parallel,
then a summary with a row per engine saying how its tape ends.

    report = fleet_postmortem("tapes/")               # a process pool, one worker per CPU
    report = fleet_postmortem("tapes/", jobs=1)       # in this process
    report = fleet_postmortem("tapes/", use_ray=True) # Ray tasks (tokentape.postmortem.fleet_ray)
    report.summary.engines["engine-1"].ended          # "complete", "truncated", ...

A fleet's tapes are its `*.tape` files and its subdirectories that are segmented tapes (each
read as one tape). A tape's engine is its file name without `.tape` (a directory's: its
name). Each tape gets the single-tape postmortem
(`tokentape.postmortem.postmortem`); a tape that cannot be opened at all gets an `error`
instead of findings.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import re
import sqlite3
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from tokentape.events.segment_dir import is_segmented_tape
from tokentape.events.store import TapeError
from tokentape.postmortem.findings import Finding, Summary

Ended = Literal[
    "complete", "truncated", "interrupted", "engine_error", "damaged", "inconsistent", "unreadable"
]
# The finding that says how a tape ends, by precedence (a tape has at most one of the first
# four: the pass stops there, or the engine recorded its failure or its interruption, or
# none of these).
_END_KINDS: tuple[tuple[str, Ended], ...] = (
    ("tape_damaged", "damaged"),
    ("tape_inconsistent", "inconsistent"),
    ("engine_error", "engine_error"),
    ("interrupted", "interrupted"),
    ("tape_truncated", "truncated"),
)
UNREADABLE_ENDS = ("damaged", "unreadable")  # the CLI's exit status 2


class TapeResult(msgspec.Struct):
    """One tape's postmortem: its findings and summary, or why it could not be opened."""

    engine: str
    tape: str
    findings: list[Finding] = []
    summary: Summary | None = None
    error: str | None = None  # the tape could not be opened (not a tape, a newer format)
    cpu_s: float = 0.0  # CPU seconds its analysis took, in the process that ran it


class EngineSummary(msgspec.Struct):
    """A row of the fleet: one engine's tape, how and where it ends, its finding counts."""

    tape: str
    ended: Ended
    where: str  # one line: where the tape ends and why
    last_step: int | None  # the last step scheduled on the part analysed
    last_seq: int | None  # the last event analysed
    errors: int
    warnings: int
    counts: dict[str, int]  # findings per kind
    num_events: int
    num_steps: int
    num_requests: int
    discard_policy: str | None
    model_id: str | None
    first_error: str | None  # "kind: message" of its first error finding


class FleetSummary(msgspec.Struct):
    directory: str
    tapes: int
    ok: int  # tapes without an error finding
    failed: int  # tapes with one (or that could not be opened)
    unreadable: int  # tapes that could not be opened or read to their end
    errors: int  # error findings over every tape
    warnings: int
    counts: dict[str, int]  # findings per kind over every tape
    ended: dict[str, int]  # tapes per way of ending
    engines: dict[str, EngineSummary]


class FleetReport(msgspec.Struct):
    tapes: list[TapeResult]
    summary: FleetSummary

    @property
    def ok(self) -> bool:
        return self.summary.failed == 0


_encode = msgspec.msgpack.Encoder().encode
_decode_result = msgspec.msgpack.Decoder(TapeResult).decode


def _natural_key(name: str) -> list[object]:
    """engine-2 before engine-10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def find_tapes(directory: str | os.PathLike[str]) -> list[str]:
    """The `*.tape` files of a directory and its subdirectories that are segmented tapes
    (not other subdirectories, nor what they hold), in natural name order."""
    directory = os.fspath(directory)
    with os.scandir(directory) as entries:
        names = [
            x.name
            for x in entries
            if (x.name.endswith(".tape") and x.is_file())
            or (x.is_dir() and is_segmented_tape(x.path))
        ]
    return [os.path.join(directory, n) for n in sorted(names, key=_natural_key)]


def engine_name(path: str) -> str:
    return os.path.basename(path).removesuffix(".tape")


def analyse_tape(path: str, reference: str | None = None) -> bytes:
    """One tape's postmortem as msgpack (what a worker process or a Ray task sends back)."""
    from tokentape.postmortem.analysis import postmortem

    t0 = time.process_time()
    try:
        report = postmortem(path, reference=reference)
        result = TapeResult(engine_name(path), path, report.findings, report.summary)
    except (TapeError, sqlite3.Error, OSError) as exc:  # not a tape, a newer format, gone
        result = TapeResult(
            engine_name(path), path, error=" ".join(str(exc).split()) or type(exc).__name__
        )
    result.cpu_s = time.process_time() - t0
    return _encode(result)


def decode_result(data: bytes) -> TapeResult:
    return _decode_result(data)


def fleet_postmortem(
    directory: str | os.PathLike[str],
    *,
    jobs: int | None = None,
    use_ray: bool = False,
    reference: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> FleetReport:
    """Analyse every tape of `directory`: in `jobs` worker processes (default: one per CPU
    this process may use; 1: in this process), or as Ray tasks with `use_ray` (`jobs` is then
    the CPUs of a local Ray instance started for it). `progress` gets the tapes done so far."""
    paths = find_tapes(directory)
    if not paths:
        raise ValueError(
            f"{os.fspath(directory)}: no tapes here "
            "(files named *.tape, or segmented tapes' directories)"
        )
    results: dict[str, TapeResult] = {}

    def done(data: bytes) -> None:
        result = decode_result(data)
        results[result.tape] = result
        if progress is not None:
            progress(len(results))

    if use_ray:
        from tokentape.postmortem.fleet_ray import run_on_ray

        run_on_ray(analyse_tape, paths, reference, done, jobs)
    elif (jobs := jobs or default_jobs()) == 1 or len(paths) == 1:
        for path in paths:
            done(analyse_tape(path, reference))
    else:
        _run_pool(paths, reference, done, min(jobs, len(paths)))
    ordered = [results[p] for p in paths]
    return FleetReport(ordered, summarize(os.fspath(directory), ordered))


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _run_pool(
    paths: list[str], reference: str | None, done: Callable[[bytes], None], jobs: int
) -> None:
    # spawn, not fork: the caller may hold threads (a progress bar, torch's pools) that a
    # forked child would inherit mid-lock. A worker imports the postmortem once (~0.4 s).
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [pool.submit(analyse_tape, p, reference) for p in paths]
        try:
            for future in concurrent.futures.as_completed(futures):
                done(future.result())
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def summarize(directory: str, results: list[TapeResult]) -> FleetSummary:
    engines = {r.engine: engine_summary(r) for r in results}
    counts: dict[str, int] = {}
    ended: dict[str, int] = {}
    for row in engines.values():
        for kind, n in row.counts.items():
            counts[kind] = counts.get(kind, 0) + n
        ended[row.ended] = ended.get(row.ended, 0) + 1
    failed = sum(row.errors > 0 or row.ended == "unreadable" for row in engines.values())
    return FleetSummary(
        directory=directory,
        tapes=len(results),
        ok=len(results) - failed,
        failed=failed,
        unreadable=sum(row.ended in UNREADABLE_ENDS for row in engines.values()),
        errors=sum(row.errors for row in engines.values()),
        warnings=sum(row.warnings for row in engines.values()),
        counts=dict(sorted(counts.items())),
        ended=ended,
        engines=engines,
    )


def engine_summary(r: TapeResult) -> EngineSummary:
    s = r.summary
    if s is None:
        return EngineSummary(
            r.tape,
            "unreadable",
            f"cannot be opened: {r.error}",
            None,
            None,
            0,
            0,
            {},
            0,
            0,
            0,
            None,
            None,
            r.error,
        )
    last_step = s.num_steps - 1 if s.num_steps else None
    last_seq = s.num_events - 1 if s.num_events else None
    ended: Ended = "complete"
    where = f"complete: {s.num_events} events, {s.num_steps} steps, {s.num_requests} requests"
    for kind, how in _END_KINDS:
        f = next((f for f in r.findings if f.kind == kind), None)
        if f is not None:
            ended, where = how, _where(how, f, s)
            break
    first = next((f for f in r.findings if f.severity == "error"), None)
    return EngineSummary(
        r.tape,
        ended,
        where,
        last_step,
        last_seq,
        s.errors,
        s.warnings,
        dict(s.counts),
        s.num_events,
        s.num_steps,
        s.num_requests,
        s.discard_policy,
        s.model_id,
        f"{first.kind}: {first.message}" if first is not None else None,
    )


def _where(how: Ended, f: Finding, s: Summary) -> str:
    if how == "truncated":
        return (
            f"stopped mid-run at event {f.seq} after step {f.steps[1]} was scheduled, "
            f"{len(f.request_ids)} request(s) unfinished, no EngineError "
            "(killed, or closed mid-run)"
        )
    if how in ("engine_error", "interrupted"):
        return f.message  # "the engine failed at step N: ...", "the run was interrupted at ..."
    # damaged / inconsistent: the pass stopped at the event the finding names
    return f"{how} from event {f.seq} on; the {s.num_events} events before it were analysed"
