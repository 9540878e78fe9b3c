"""Chaos storms against vLLM's own scheduler: each seed draws a storm as a spec of the
scheduler driver (tokentape/integrations/vllm/scheduler_driver.py), which runs vLLM's
Scheduler or AsyncScheduler, recorded, in vLLM's Python with the oracle as the model; the run
is checked live by the recorder (each event against the fold of the tape so far), then by the
postmortem of its tape and against the oracle's streams. A run with a finding is kept (its
spec, tape and report) and shrunk (tokentape/chaos/shrink.py) to the smallest storm that
still gives its first finding.

    with VLLMChaos(find_vllm(), "0.20.0", "out/") as chaos:
        outcome = chaos.run_seed(7)     # outcome.primary: "post_resume_token_dropped (vllm#42043)"

What a seed draws (`storm_spec`): async scheduling (a batch queue of depth 2) or not, 0-3
n-gram drafts of which the model accepts a seeded random number (rejections), KV pressure (8
to 64 blocks of 16 tokens), chunked prefill (a token budget of 16 to 512 over 2 to 16 running
requests), 2 to 14 requests (some sharing a prefix, some added mid-run), and 0 to 6 commands
between steps: `reset_prefix_cache` with and without running requests, pauses in every mode
(keep, wait, abort) with and without clear_cache, and aborts; and in a third of the storms
one or two sleeps (levels 0-2) with their wake-ups by tags, as RL loops call them. The same
seed on the same release replays the same run. The driver stops a run whose requests are
never scheduled again after 100 idle engine steps (vLLM 0.20's #42043 hang): a finding with
its tape.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokentape.integrations.vllm.driver_process import (
    DriverProcess,
    FoundVLLM,
    VLLMNotFound,
    overlay_dir,
)

BLOCK_SIZE = 16
_KV_BLOCKS = (8, 12, 16, 24, 32, 64)
_MAX_SEQS = (2, 4, 8, 16)
_BUDGETS = (16, 32, 64, 128, 512)
_SPECULATIVE = (0, 1, 1, 2, 3)
_PAUSE_MODES = ("keep", "keep", "keep", "wait", "wait", "abort")
_SLEEP_MODES = ("keep", "keep", "abort", "wait")
# The wake-ups after a sleep of level 1 or 2: RL's order (the weights for their update, then
# the KV cache), everything at once, or both tags together.
_WAKE_ORDERS: tuple[list[list[str] | None], ...] = (
    [["weights"], ["kv_cache"]],
    [None],
    [["weights", "kv_cache"]],
)
COMMAND_HORIZON = 60  # commands land in the first steps, while requests are running
# The driver's own findings, beside the postmortem's kinds.
RECORDING_INCONSISTENT = "recording_inconsistent"  # the recorder's live check stopped the run
VLLM_EXCEPTION = "vllm_exception"  # vLLM raised (an assert, an index error) mid-run
DEVICE_FAULT = "device_fault"  # a step needed memory the executor had released (asleep)
HANG = "hang"  # requests left, and 100 engine steps in a row that ran nothing
STEP_LIMIT = "step_limit"  # still running after the driver's step limit (a livelock)
BROKEN_STREAM = "broken_stream"  # a client's tokens are not the oracle's, the tape silent


class SetupFailed(RuntimeError):
    """The release cannot run a storm at all (its scheduler cannot be built or recorded)."""


def storm_spec(seed: int) -> dict[str, Any]:
    """The storm of a seed, as the driver reads it (without model, tape and out)."""
    rng = random.Random(f"vllm-chaos-{seed}")
    k = rng.choice(_SPECULATIVE)
    num_blocks = rng.choice(_KV_BLOCKS)
    max_num_seqs = rng.choice(_MAX_SEQS)
    # Room for one request of max_model_len and its drafts: any request can always run alone.
    max_model_len = min(256, (num_blocks - 1) * BLOCK_SIZE)
    requests: list[dict[str, Any]] = []
    for i in range(rng.randint(2, 14)):
        max_tokens = rng.randint(1, 32) if rng.random() < 0.8 else rng.randint(33, 96)
        max_tokens = min(max_tokens, max_model_len // 2)
        length = rng.randint(2, min(80, max_model_len - max_tokens))
        if requests and rng.random() < 0.3:  # a shared prefix: prefix-cache hits
            base = rng.choice(requests)["prompt"]
            prompt = base[: rng.randint(1, len(base))]
            prompt += [rng.randrange(3, 259) for _ in range(max(0, length - len(prompt)))]
            prompt = prompt[: max_model_len - max_tokens]
        else:
            prompt = [rng.randrange(3, 259) for _ in range(length)]
        add_at = 0 if rng.random() < 0.5 else rng.randint(1, COMMAND_HORIZON // 2)
        requests.append(
            {"id": f"r{i}", "prompt": prompt, "max_tokens": max_tokens, "add_at": add_at}
        )
    reset_at: list[list[Any]] = []
    pause_at: list[list[Any]] = []
    abort_at: list[list[Any]] = []
    for _ in range(rng.randint(0, 8)):
        step = rng.randint(1, COMMAND_HORIZON)
        what = rng.random()
        if what < 0.45:
            reset_at.append([step, rng.random() < 0.7])
        elif what < 0.8:
            pause_at.append([step, rng.choice(_PAUSE_MODES), rng.random() < 0.6])
        else:
            abort_at.append([step, rng.choice(requests)["id"]])
    sleep_at, wake_at = _sleeps(seed)
    for window in _windows(sleep_at, wake_at):  # no pause or reset while the engine sleeps
        reset_at = [r for r in reset_at if r[0] not in window]
        pause_at = [p for p in pause_at if p[0] not in window]
    return {
        "async": rng.random() < 0.85,
        "num_speculative_tokens": k,
        "num_blocks": num_blocks,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(rng.choice(_BUDGETS), max_num_seqs * (1 + k)),
        "max_model_len": max_model_len,
        "seed": seed,
        "requests": requests,
        "reset_at": sorted(reset_at),
        "pause_at": sorted({s: [s, m, c] for s, m, c in pause_at}.values()),  # one a step
        "abort_at": sorted(abort_at),
        "sleep_at": sleep_at,
        "wake_at": wake_at,
    }


def _sleeps(seed: int) -> tuple[list[list[Any]], list[list[Any]]]:
    """A third of the storms sleep once or twice, as an RL loop does between rollouts: a
    sleep (level 1 or 2; level 0 pauses only) in a pause mode, then its wake-ups a few steps
    apart, in the order RL frameworks call them (the weights, for their update, then the KV
    cache), all at once, or by tags together. Drawn from a stream of their own: the other
    commands of a seed stay what they were."""
    rng = random.Random(f"vllm-chaos-sleep-{seed}")
    sleep_at: list[list[Any]] = []
    wake_at: list[list[Any]] = []
    if rng.random() >= 1 / 3:
        return sleep_at, wake_at
    step = 0
    for _ in range(rng.randint(1, 2)):
        step += rng.randint(1, COMMAND_HORIZON // 2)
        level = rng.choice((0, 1, 1, 2))
        sleep_at.append([step, level, rng.choice(_SLEEP_MODES)])
        if level == 0:
            wakes: list[list[str] | None] = [["scheduling"]]
        else:
            wakes = rng.choice(_WAKE_ORDERS)
        for tags in wakes:
            step += rng.randint(1, 8)
            wake_at.append([step, tags])
        step += 1
    return sleep_at, wake_at


def _windows(sleep_at: list[list[Any]], wake_at: list[list[Any]]) -> list[range]:
    """The steps each sleep lasts: from it to its last wake-up."""
    windows = []
    for i, (start, *_) in enumerate(sleep_at):
        end = sleep_at[i + 1][0] if i + 1 < len(sleep_at) else None
        last = max(w[0] for w in wake_at if w[0] >= start and (end is None or w[0] < end))
        windows.append(range(start, last + 1))
    return windows


def write_model(folder: str) -> str:
    """A config-only checkpoint folder of the tiny model: what vLLM's ModelConfig reads (the
    driver runs no model, so no weights)."""
    from tokentape.engine.model import BUILTIN_CONFIGS

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(BUILTIN_CONFIGS["tiny"].to_hf_dict(), f, indent=2)
    return folder


def expected_streams(spec: dict[str, Any]) -> dict[str, list[int]]:
    """Every request's stream as the oracle gives it (the driver's model: cyclic, seed 0)."""
    from tokentape.engine.runners.oracle import OracleRunner
    from tokentape.events.schema import SamplingParams

    oracle = OracleRunner(cyclic=True, seed=0)
    return {
        r["id"]: oracle.expected_stream(
            r["prompt"],
            SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
            spec["max_model_len"],
        )
        for r in spec["requests"]
    }


def oracle_violations(spec: dict[str, Any], result: dict[str, Any]) -> dict[str, str]:
    """Requests whose client did not get the oracle's stream (an aborted one: a prefix)."""
    wrong = {}
    outputs = result["outputs"]
    for rid, want in expected_streams(spec).items():
        out = outputs.get(rid, {"tokens": [], "finish_reason": None})
        got, reason = out["tokens"], out["finish_reason"]
        if reason == "abort":
            if got != want[: len(got)]:
                wrong[rid] = f"aborted with {got}, not a prefix of the oracle's {want}"
        elif reason is None:
            wrong[rid] = f"never finished (received {len(got)} of {len(want)} tokens)"
        elif got != want:
            wrong[rid] = f"finished ({reason}) with {got}, the oracle's stream is {want}"
    return wrong


_PLACE = re.compile(r" at \S+ in ")  # where an exception was raised, but its function


class Signature(msgspec.Struct, frozen=True):
    """A finding, as a shrink must keep it: its kind and the vLLM bug class it matches."""

    kind: str
    bug_class: str | None = None
    where: str | None = None  # a vLLM exception's type and the line that raised it

    def __str__(self) -> str:
        detail = self.bug_class or self.where
        return f"{self.kind} ({detail})" if detail else self.kind

    @property
    def finding_class(self) -> str:
        """What a release matrix compares across releases: the vLLM bug class, else the kind
        (an exception's type and function, its line numbers moving from release to release)."""
        if self.bug_class:
            return self.bug_class
        if self.where:  # "AssertionError at core/sched/async_scheduler.py:53 in f"
            return f"{self.kind}: " + _PLACE.sub(" in ", self.where)
        return self.kind


@dataclass(slots=True)
class Checked:
    """One run, checked: every finding's signature (the first one first), the postmortem."""

    signatures: list[Signature]
    violations: dict[str, str]
    report: Any  # tokentape.postmortem.Report
    result: dict[str, Any]

    @property
    def primary(self) -> Signature | None:
        return self.signatures[0] if self.signatures else None


def check_run(spec: dict[str, Any], result: dict[str, Any], tape: str) -> Checked:
    """The findings of a driver run: the driver's own (an exception, a hang), then the
    postmortem's in tape order (errors first), then streams that are not the oracle's."""
    from tokentape.postmortem import postmortem

    report = postmortem(tape)
    violations = oracle_violations(spec, result)
    signatures: list[Signature] = []
    error = result.get("error")
    device_fault = error is not None and error.startswith("DeviceFault")
    if error and not device_fault:  # the device's comes after the tape's findings
        if error.startswith("RecordingLost"):
            signatures.append(Signature(RECORDING_INCONSISTENT))
        else:  # which exception, raised where: a shrink keeps the same one
            where = error.rsplit(" (at ", 1)[-1].rstrip(")") if " (at " in error else None
            signatures.append(Signature(VLLM_EXCEPTION, None, f"{error.split(':')[0]} at {where}"))
    findings = sorted(report.findings, key=lambda f: f.severity != "error")  # stable: tape order
    for f in findings:
        if f.kind in ("engine_error", "tape_truncated") and error:
            continue  # the driver's exception, already said
        signatures.append(Signature(f.kind, f.bug_class))
    if device_fault:
        signatures.append(Signature(DEVICE_FAULT))
    if result.get("stopped") == "idle":
        signatures.append(Signature(HANG))
    elif result.get("stopped") == "step_limit":
        signatures.append(Signature(STEP_LIMIT))
    if violations and not signatures:
        signatures.append(Signature(BROKEN_STREAM))
    return Checked(list(dict.fromkeys(signatures)), violations, report, result)


def finding_classes(signatures: list[Signature]) -> list[str]:
    """What a run found, for a release matrix: the vLLM bug classes its findings name (a
    finding without one, a hang or a stream cut short, is their consequence); a run whose
    findings name none, the first one's class (its kind, or its exception's place)."""
    named = list(dict.fromkeys(s.bug_class for s in signatures if s.bug_class))
    return named or [signatures[0].finding_class] if signatures else []


def why_position(spec: dict[str, Any], checked: Checked, tape: str) -> tuple[str, int] | None:
    """The request and output position where the first finding shows, for `tokentape why`:
    the first token that is not the oracle's (or never came), else the first token the
    request was given at or after the finding's step."""
    report, result, violations = checked.report, checked.result, checked.violations
    errors = [f for f in report.findings if f.severity == "error"] or report.findings
    rid = next((r for f in errors for r in f.request_ids), None)
    if rid is None:
        rid = next(iter(sorted(violations)), None)
    if rid is None:
        return None
    want = expected_streams(spec).get(rid)
    request = next((r for r in spec["requests"] if r["id"] == rid), None)
    if want is None or request is None:
        return None
    got = result["outputs"].get(rid, {}).get("tokens", [])
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return rid, i
    if rid in violations:
        return rid, min(len(got), request["max_tokens"] - 1)
    step = next(f.steps[0] for f in errors if rid in f.request_ids)
    return rid, min(_delivered_before(tape, rid, step), request["max_tokens"] - 1)


def _delivered_before(tape: str, rid: str, step: int) -> int:
    from tokentape.events import schema as ev
    from tokentape.replay import load_tape

    n = 0
    for _, e in load_tape(tape).events():
        if isinstance(e, ev.OutputsEmitted) and e.step < step:
            n += sum(len(o.token_ids) for o in e.entries if o.req_id == rid)
    return n


class ShrinkRecord(msgspec.Struct):
    """What a shrink reached, and where it kept it."""

    spec: str  # the minimal spec (JSON the driver reads)
    tape: str
    report: str
    requests: int
    commands: int
    steps: int
    runs: int  # driver runs the shrink made
    seconds: float
    why: list[Any] | None = None  # [request, position] for `tokentape why`


class VLLMSeedOutcome(msgspec.Struct):
    """One seed's run against vLLM: its shape, what was found, and where it was kept."""

    seed: int
    release: str
    asynchronous: bool
    num_speculative_tokens: int
    num_blocks: int
    num_requests: int
    num_commands: int
    steps: int = 0  # engine steps the driver ran (a pause's drain included)
    scheduled_steps: int = 0  # of them, steps that ran tokens
    driver_s: float = 0.0  # the driver's stepping, in vLLM's process
    seconds: float = 0.0  # the whole seed: the driver's run, the checks, keeping, shrinking
    broken_streams: int = 0
    finding_kinds: dict[str, int] = {}
    bug_classes: dict[str, int] = {}
    finding_classes: list[str] = []  # what it found, for a release matrix (finding_classes)
    primary: str | None = None  # the first finding, as the shrink keeps it
    error: str | None = None  # the driver's: an exception of vLLM or of the live checks
    hung: list[str] = []
    spec: str | None = None  # kept, with a finding
    tape: str | None = None
    report: str | None = None
    shrunk: ShrinkRecord | None = None

    @property
    def has_finding(self) -> bool:
        return self.primary is not None


def num_commands(spec: dict[str, Any]) -> int:
    return (
        len(spec.get("reset_at", ()))
        + len(spec.get("pause_at", ()))
        + len(spec.get("abort_at", ()))
        + len(spec.get("sleep_at", ()))
        + len(spec.get("wake_at", ()))
    )


@dataclass(slots=True)
class VLLMChaos:
    """Storms against one vLLM release, through one driver process; `out_dir` receives what
    runs with findings keep (their spec, tape, postmortem report, and the shrunk ones)."""

    found: FoundVLLM
    release: str | None  # None: the venv's own
    out_dir: str
    shrink: bool = True
    shrink_budget_s: float = 120.0  # a shrink stops here with the smallest storm so far
    driver: DriverProcess = field(init=False)
    model: str = field(init=False)
    work: str = field(init=False)
    _runs: int = 0

    def __post_init__(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        # The tapes of runs not kept (every clean seed, every shrink candidate) are written
        # where no disk syncs them: a tmpfs when there is one. Kept ones move to out_dir.
        shm = "/dev/shm"
        scratch = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
        self.work = tempfile.mkdtemp(prefix="tokentape-chaos-vllm-", dir=scratch)
        self.model = write_model(os.path.join(self.out_dir, "model"))
        self.driver = DriverProcess(
            self.found, self.release, os.path.join(self.out_dir, "vllm-driver.log")
        )
        version = self.driver.start()  # vLLM imported once, here: VLLMNotFound if it cannot be
        if self.release is not None and version.split("+")[0] != self.release.split("+")[0]:
            self.close()
            raise VLLMNotFound(
                f"vLLM {self.release}: the driver imported vLLM {version} instead "
                f"(is {overlay_dir(self.found.venv, self.release)} a {self.release} overlay?)"
            )

    @property
    def release_name(self) -> str:
        return self.release or self.found.version

    def close(self) -> None:
        self.driver.close()
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> VLLMChaos:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_spec(self, spec: dict[str, Any], tape: str) -> Checked:
        """Run a storm onto a new tape at `tape` and check it; SetupFailed when the release
        cannot run it at all."""
        from tokentape.events.sqlite_store import remove_tape_files

        remove_tape_files(tape)
        self._runs += 1
        result = self.driver.run({**spec, **self._recording(tape)})
        if "setup_error" in result:
            raise SetupFailed(f"vLLM {self.release_name}: {result['setup_error']}")
        return check_run(spec, result, tape)

    def _recording(self, tape: str) -> dict[str, Any]:
        """The spec's recording fields: the model folder, the tape, the live checks on, and
        the tape written once at the end (a run's SQLite writer process would cost more than
        the run)."""
        return {"model": self.model, "tape": tape, "check": True, "tape_at_close": True}

    def stem(self, seed: int) -> str:
        return f"vllm-{self.release_name}-seed{seed}"

    def run_seed(self, seed: int) -> VLLMSeedOutcome:
        from tokentape.events.sqlite_store import remove_tape_files

        start = time.perf_counter()
        spec = storm_spec(seed)
        outcome = VLLMSeedOutcome(
            seed,
            self.release_name,
            spec["async"],
            spec["num_speculative_tokens"],
            spec["num_blocks"],
            len(spec["requests"]),
            num_commands(spec),
        )
        work_tape = os.path.join(self.work, f"seed{seed}.tape")
        checked = self.run_spec(spec, work_tape)
        result = checked.result
        outcome.steps = result["steps"] + result["drain_steps"]
        outcome.scheduled_steps = result["scheduled_steps"]
        outcome.driver_s, outcome.error, outcome.hung = (
            result["seconds"],
            result["error"],
            result["hung"],
        )
        outcome.broken_streams = len(checked.violations)
        outcome.finding_kinds = dict(Counter(s.kind for s in checked.signatures))
        outcome.bug_classes = dict(Counter(s.bug_class for s in checked.signatures if s.bug_class))
        outcome.finding_classes = finding_classes(checked.signatures)
        if checked.primary is None:
            remove_tape_files(work_tape)
            outcome.seconds = time.perf_counter() - start
            return outcome
        outcome.primary = str(checked.primary)
        stem = os.path.join(self.out_dir, self.stem(seed))
        outcome.spec, outcome.tape, outcome.report, _ = self._keep(spec, checked, work_tape, stem)
        if self.shrink:
            outcome.shrunk = self._shrink(spec, checked.primary, stem + ".min")
        outcome.seconds = time.perf_counter() - start
        return outcome

    def _keep(
        self, spec: dict[str, Any], checked: Checked, work_tape: str, stem: str
    ) -> tuple[str, str, str, tuple[str, int] | None]:
        """Move the run's tape beside its spec and postmortem report (text and JSON); also
        where `tokentape why` shows its first finding."""
        from tokentape.events.sqlite_store import remove_tape_files
        from tokentape.postmortem.report_text import print_report

        tape = stem + ".tape"
        remove_tape_files(tape)
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(work_tape + suffix):
                shutil.move(work_tape + suffix, tape + suffix)
        checked.report.summary.tape = tape  # the report names the tape where it is kept
        spec_path = stem + ".spec.json"
        with open(spec_path, "w") as f:  # the driver reads it (--tape records it again)
            json.dump({**spec, **self._recording(tape)}, f, indent=1)
        why = why_position(spec, checked, tape)
        report = stem + ".postmortem.txt"
        with open(report, "w") as f:
            print_report(checked.report, f)
            for rid, what in sorted(checked.violations.items()):
                f.write(f"\nnot the oracle's stream: {rid}: {what}\n")
            if checked.result.get("error"):
                f.write(f"\nthe run stopped on: {checked.result['error']}\n")
            if checked.result.get("hung"):
                f.write(f"\nhung (never scheduled again): {', '.join(checked.result['hung'])}\n")
            if why:
                f.write(f"\nthe first finding: tokentape why {tape} {why[0]} {why[1]}\n")
        with open(stem + ".postmortem.json", "wb") as f:
            f.write(msgspec.json.encode(checked.report))
        return spec_path, tape, report, why

    def _shrink(self, spec: dict[str, Any], target: Signature, stem: str) -> ShrinkRecord:
        from tokentape.chaos.shrink import shrink_spec

        start, runs = time.perf_counter(), self._runs
        probe = os.path.join(self.work, "shrink.tape")

        def still_fails(candidate: dict[str, Any]) -> bool:
            checked = self.run_spec(candidate, probe)
            return target in checked.signatures

        minimal = shrink_spec(spec, still_fails, time.perf_counter() + self.shrink_budget_s)
        # The minimal storm once more, kept: its tape, spec and report beside the original's.
        checked = self.run_spec(minimal, probe)
        spec_path, tape, report, why = self._keep(minimal, checked, probe, stem)
        return ShrinkRecord(
            spec_path,
            tape,
            report,
            len(minimal["requests"]),
            num_commands(minimal),
            checked.result["steps"] + checked.result["drain_steps"],
            self._runs - runs,
            time.perf_counter() - start,
            list(why) if why else None,
        )


@dataclass(slots=True)
class VLLMCampaignSummary:
    release: str
    first_seed: int
    shrink: bool
    jobs: int = 1
    num_seeds: int = 0
    wall_s: float = 0.0
    runs_with_findings: int = 0
    broken_streams: int = 0
    steps: int = 0
    scheduled_steps: int = 0
    driver_s: float = 0.0
    shrink_s: float = 0.0
    primaries: Counter[str] = field(default_factory=Counter)
    finding_kinds: Counter[str] = field(default_factory=Counter)
    bug_classes: Counter[str] = field(default_factory=Counter)
    finding_classes: Counter[str] = field(default_factory=Counter)  # seeds showing each class
    first_seed_of: dict[str, int] = field(default_factory=dict)  # each class's first seed
    found: list[VLLMSeedOutcome] = field(default_factory=list)

    @property
    def steps_per_s(self) -> float:
        """Engine steps per second of the whole campaign (driving, checks, keeping, shrinks
        included; the shrinks' own steps not counted)."""
        return self.steps / self.wall_s if self.wall_s > 0 else 0.0

    def add(self, o: VLLMSeedOutcome) -> None:
        self.num_seeds += 1
        self.steps += o.steps
        self.scheduled_steps += o.scheduled_steps
        self.driver_s += o.driver_s
        self.broken_streams += o.broken_streams
        self.finding_kinds.update(o.finding_kinds)
        self.bug_classes.update(o.bug_classes)
        self.finding_classes.update(o.finding_classes)
        for c in o.finding_classes:
            self.first_seed_of.setdefault(c, o.seed)
        if o.has_finding:
            self.runs_with_findings += 1
            self.primaries[o.primary or ""] += 1
            self.found.append(o)
            if o.shrunk is not None:
                self.shrink_s += o.shrunk.seconds

    def to_json(self) -> dict[str, object]:
        return {
            "engine": "vllm",
            "vllm_release": self.release,
            "first_seed": self.first_seed,
            "seeds": self.num_seeds,
            "jobs": self.jobs,
            "shrink": self.shrink,
            "wall_s": self.wall_s,
            "steps": self.steps,
            "scheduled_steps": self.scheduled_steps,
            "steps_per_s": self.steps_per_s,
            "driver_steps_per_s": self.steps / self.driver_s if self.driver_s > 0 else 0.0,
            "shrink_s": self.shrink_s,
            "runs_with_findings": self.runs_with_findings,
            "broken_streams": self.broken_streams,
            "first_findings": dict(self.primaries),
            "finding_kinds": dict(self.finding_kinds),
            "bug_classes": dict(self.bug_classes),
            "finding_classes": dict(self.finding_classes),
            "first_seed_of": self.first_seed_of,
            "found": msgspec.to_builtins(self.found),
        }


def run_vllm_campaign(
    seeds: range,
    found: FoundVLLM,
    release: str | None,
    out_dir: str,
    jobs: int = 1,
    shrink: bool = True,
    on_outcome: Callable[[VLLMSeedOutcome], None] | None = None,
) -> VLLMCampaignSummary:
    """Every seed against one release, in seed order, through `jobs` driver processes (each
    its own vLLM; the checks here are small beside a run). Raises VLLMNotFound or SetupFailed
    when the release cannot run storms at all."""
    import concurrent.futures
    import queue
    import threading

    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    first = VLLMChaos(found, release, out_dir, shrink)  # a setup problem shows before any seed
    opened, idle = [first], queue.SimpleQueue[VLLMChaos]()
    idle.put(first)
    lock = threading.Lock()

    def run_seed(seed: int) -> VLLMSeedOutcome:
        try:
            chaos = idle.get_nowait()
        except queue.Empty:  # another job: its own driver process, started in this thread
            chaos = VLLMChaos(found, release, out_dir, shrink)
            with lock:
                opened.append(chaos)
        try:
            return chaos.run_seed(seed)
        finally:
            idle.put(chaos)

    summary = VLLMCampaignSummary(first.release_name, seeds.start, shrink, jobs)
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            for outcome in pool.map(run_seed, seeds):
                summary.add(outcome)
                summary.wall_s = time.perf_counter() - start
                if on_outcome is not None:
                    on_outcome(outcome)
    finally:
        for chaos in opened:
            chaos.close()
    summary.wall_s = time.perf_counter() - start
    return summary
