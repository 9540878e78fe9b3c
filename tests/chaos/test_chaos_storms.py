"""Seeded storms (tokentape/chaos/storms.py) across pipeline depth 1-4, speculative tokens
0-3 and the discard policies, each checked against the oracle's stream: under `epoch` and
`deliver` (vLLM since #48245: stale output delivered while the request waits, dropped after a
reset) every request gets exactly its stream and the postmortem finds nothing; under `counter`
and `flag` a broken stream is allowed, but the postmortem must then name its bug class.
`benchmarks/chaos_storms.py` runs the same checks over 1,000 seeds."""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest

from tokentape.chaos import (
    COMMANDS,
    StormError,
    StormResult,
    StormSpec,
    run_storm,
    storm_commands,
    storm_grid,
)
from tokentape.events import schema as ev
from tokentape.events.discard import DISCARD_POLICIES
from tokentape.postmortem import postmortem
from tokentape.postmortem.findings import BUG_CLASSES
from tokentape.replay import load_tape, verify

EXACT_POLICIES = ("epoch", "deliver")  # the policies that never break a stream
SHORT = StormSpec(seed=0, num_commands=300)  # the CI grid: a short storm per combination
GRID = list(storm_grid(seeds=[11], base=SHORT))


def unexplained(result: StormResult) -> list[str]:
    """Requests whose stream broke without an error finding that names them and a bug class."""
    report = postmortem(result.tape)
    classes: dict[str, set[str | None]] = collections.defaultdict(set)
    for f in report.findings:
        if f.severity == "error":
            for r in f.request_ids:
                classes[r].add(f.bug_class)
    return [r for r in result.oracle_violations() if not classes[r] - {None}]


@pytest.mark.parametrize(
    "spec",
    GRID,
    ids=lambda s: f"{s.discard_policy}-d{s.pipeline_depth}-k{s.num_speculative_tokens}",
)
def test_storm_against_the_oracle(spec: StormSpec) -> None:
    result = run_storm(spec)
    assert result.num_preemptions and result.num_resets  # the storm did disturb the engine
    if spec.discard_policy in EXACT_POLICIES:
        assert result.oracle_violations() == {}
        assert postmortem(result.tape).findings == []
    else:
        assert unexplained(result) == []


def test_the_small_grid_breaks_the_historical_policies() -> None:
    """The CI grid is not vacuous: some streams break, and only under counter and flag."""
    broken = collections.Counter()
    for spec in GRID:
        if spec.discard_policy not in EXACT_POLICIES and spec.pipeline_depth > 1:
            broken[spec.discard_policy] += bool(run_storm(spec).oracle_violations())
    assert broken["counter"] and broken["flag"]


@pytest.mark.parametrize("seed", range(4))
def test_clean_storms_have_no_finding_of_any_kind(seed: int) -> None:
    """Full-length storms under epoch (the benchmark runs 1,000 of these): no false finding,
    request_stuck included, and the tape verifies."""
    spec = StormSpec(seed=seed, pipeline_depth=1 + seed % 4, num_speculative_tokens=(3 * seed) % 4)
    result = run_storm(spec)
    assert result.oracle_violations() == {}
    report = postmortem(result.tape)
    assert report.findings == [] and report.summary.complete
    t = report.summary.tokens
    assert t["produced"] == t["applied"] + t["dropped_stale"] + t["after_stop"] and t["lost"] == 0
    assert result.num_events == len(result.tape) == report.summary.num_events


def test_a_storm_issues_every_kind_of_disturbance() -> None:
    result = run_storm(StormSpec(seed=3, pipeline_depth=3, num_speculative_tokens=2))
    assert set(result.commands) == set(COMMANDS)
    events = [e for _, e in load_tape(result.tape).events()]
    reasons = collections.Counter(e.reason for e in events if isinstance(e, ev.RequestPreempted))
    assert reasons["kv_pressure"] and reasons["reset_prefix_cache"]
    resets = collections.Counter(
        (e.reset_running_requests, e.ok) for e in events if isinstance(e, ev.PrefixCacheReset)
    )
    assert resets[(True, True)] and resets[(False, True)] and resets[(False, False)]
    pauses = {(e.mode, e.clear_cache) for e in events if isinstance(e, ev.GenerationPaused)}
    assert pauses == {(m, c) for m in ("keep", "wait", "abort") for c in (False, True)}
    finishes = {r for r in result.finish_reasons.values()}
    assert finishes == {"stop", "length", "abort"}
    assert result.num_preemptions == sum(reasons.values())
    assert {e.level for e in events if isinstance(e, ev.EngineSlept)} == {0, 1, 2}
    woken = {
        None if e.tags is None else e.tags[0] for e in events if isinstance(e, ev.EngineWokeUp)
    }
    assert woken == {None, "weights", "kv_cache", "scheduling"}


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_sleep_and_abort_all_storms_are_clean(depth: int) -> None:
    """Sleeps at every level and mode, wake-ups tag by tag, abort-all, with steps in flight
    and requests arriving asleep: every stream is the oracle's, no finding, the tape verifies."""
    sleepy = ["step", "add", "step", "step", "add", "step"]
    calls = ["sleep1_keep", "add", "step", "wake_weights", "step", "wake_kv_cache", "step"]
    calls += ["sleep2_keep", "resume", "pause_keep", "wake", "step", "step", "abort_all"]
    calls += [
        "add",
        "step",
        "sleep0_wait",
        "add",
        "wake_scheduling",
        "step",
        "sleep1_abort",
        "wake",
    ]
    spec = replace(SHORT, seed=7, pipeline_depth=depth, num_speculative_tokens=1)
    result = run_storm(spec, (sleepy + calls) * 6)
    assert result.oracle_violations() == {}
    assert postmortem(result.tape).findings == [] and verify(result.tape).ok
    kinds = collections.Counter(ev.kind_of(e) for _, e in load_tape(result.tape).events())
    assert kinds["EngineSlept"] == 4 * 6 and kinds["EngineWokeUp"] >= 4 * 6


def test_a_storm_is_a_pure_function_of_its_spec_and_commands(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = StormSpec(seed=5, pipeline_depth=2, num_speculative_tokens=1, num_commands=400)
    a, b = run_storm(spec), run_storm(spec, storm_commands(spec.seed, spec.num_commands))
    assert a.received == b.received and a.commands == b.commands
    assert [e for _, e in load_tape(a.tape).events()] == [e for _, e in load_tape(b.tape).events()]
    c = run_storm(spec, tape=tmp_path / "storm.tape")  # an SQLite tape, kept
    assert c.tape_path == str(tmp_path / "storm.tape") and verify(c.tape_path).ok
    assert [e for _, e in load_tape(c.tape_path).events()] == [
        e for _, e in load_tape(a.tape).events()
    ]
    assert run_storm(replace(spec, seed=6)).received != a.received


def test_explicit_commands_and_bad_specs() -> None:
    result = run_storm(
        StormSpec(seed=1), ["step", "pause_keep_clear", "add", "step", "resume", "reset_running"]
    )
    assert result.oracle_violations() == {}
    assert set(result.received) == {"s0", "s1", "s2", "s3"}
    with pytest.raises(StormError, match="unknown storm command 'jump'"):
        run_storm(StormSpec(seed=1), ["step", "jump"])
    with pytest.raises(StormError, match="unknown discard policy"):
        run_storm(StormSpec(seed=1, discard_policy="hope"))
    with pytest.raises(StormError, match="storms need the oracle model"):
        run_storm(StormSpec(seed=1, model="tiny", num_commands=1))


def test_the_grid_covers_every_combination() -> None:
    specs = list(storm_grid(seeds=[0, 1]))
    assert len(specs) == 4 * 4 * len(DISCARD_POLICIES) * 2
    assert {(s.discard_policy, s.pipeline_depth, s.num_speculative_tokens) for s in specs} == {
        (p, d, k) for p in DISCARD_POLICIES for d in range(1, 5) for k in range(4)
    }
    assert "vllm#42043-one-frame" in BUG_CLASSES
