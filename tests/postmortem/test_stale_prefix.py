"""`stale_prefix_hit_after_weight_update`: a prefix-cache hit on KV blocks computed under older
weights. An error when the run asked for the cache to be cleared around the update (NeMo-RL
#4018, reproduced by the fault prefix_cache_kept_across_weight_update:
tests/tapes/prefix_cache_4018.tape), a warning when it kept the cache on purpose
(clear_cache=False); `tokentape why` explains the token; no false positive over 800 clean
storms with weight updates, and the fault's storms are caught."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tokentape import LLM, SamplingParams
from tokentape.chaos import StormSpec, run_storm
from tokentape.engine.runners.oracle_weights import oracle_state_dict
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape
from tokentape.replay.stale_kv import track
from tokentape.replay.why import why

TAPES = Path(__file__).resolve().parents[1] / "tapes"
PROMPT = list(range(10, 30))
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def rl_rounds(path: Path, clear_cache: bool, faults: tuple[str, ...] = ()) -> None:
    """A request, then per update one more with the same prompt (its prefix is cached)."""
    llm = LLM(
        model="oracle-random",
        tape=str(path),
        pipeline_depth=2,
        block_size=4,
        num_kv_blocks=64,
        faults=list(faults),
    )
    llm.generate([PROMPT], PARAMS)
    for i in (1, 2):
        llm.llm_engine.pause_generation(mode="keep", clear_cache=clear_cache)
        llm.llm_engine.update_weights(oracle_state_dict(i), weight_version=f"step-{i}")
        llm.llm_engine.resume_generation()
        llm.generate([PROMPT], PARAMS)
    llm.close()


def test_keeping_the_cache_on_purpose_is_a_warning_that_says_so(tmp_path: Path) -> None:
    rl_rounds(tmp_path / "kept.tape", clear_cache=False)
    report = postmortem(tmp_path / "kept.tape")
    assert report.ok and report.summary.errors == 0
    found = [f for f in report.findings if f.kind == "stale_prefix_hit_after_weight_update"]
    assert [f.severity for f in found] == ["warning", "warning"]  # the two later requests
    assert all(f.bug_class is None for f in found)
    assert "paused with clear_cache=False" in found[0].message
    assert "keeping the cache on purpose" in found[0].message
    assert "under weights version 'default'" in found[0].message
    # The second one reused blocks two updates old.
    assert "2 weight update(s) before the weights in force ('step-2')" in found[1].message


def test_clearing_the_cache_leaves_nothing_stale(tmp_path: Path) -> None:
    rl_rounds(tmp_path / "clean.tape", clear_cache=True)
    assert postmortem(tmp_path / "clean.tape").findings == []
    tracker = track(load_tape(tmp_path / "clean.tape"))
    assert len(tracker.updates) == 2 and not tracker.hits


def test_the_fault_is_an_error_naming_nemo_rl_4018(tmp_path: Path) -> None:
    rl_rounds(tmp_path / "fault.tape", True, ("prefix_cache_kept_across_weight_update",))
    report = postmortem(tmp_path / "fault.tape")
    found = [f for f in report.findings if f.kind == "stale_prefix_hit_after_weight_update"]
    assert [(f.severity, f.bug_class) for f in found] == [("error", "nemo-rl#4018")] * 2
    assert "asked for clear_cache=True, yet the prefix cache was not reset" in found[0].message
    assert [e.kind for e in found[0].excerpt] == [
        "GenerationPaused",
        "WeightsUpdated",
        "StepScheduled",
    ]


def test_why_explains_a_token_computed_on_stale_kv() -> None:
    tape = TAPES / "prefix_cache_4018.tape"
    res = why(tape, "b", 0)
    assert res.weight_version == "step-1"
    assert "Its prefix came from the prefix cache" in res.verdict
    assert "NeMo-RL #4018" in res.verdict and "under weights version 'default'" in res.verdict
    roles = [link.role for link in res.chain]
    assert roles[:2] == ["paused", "weights"] and "cache hit" in roles
    assert "yet no prefix-cache reset followed" in res.chain[0].detail
    # The first request, before any update: its own weights, no stale prefix.
    first = why(tape, "a", 3)
    assert first.weight_version == "default" and "prefix cache" not in first.verdict


def test_no_false_positive_over_800_clean_storms_and_the_fault_is_caught() -> None:
    """Small storms (60 commands) with whole and chunked weight updates, pauses, resets,
    preemptions and aborts: under the default engine not one stale hit, while prefix-cache
    hits after updates do happen; with the fault, some storms are caught."""
    base = StormSpec(seed=0, num_commands=60, model="oracle-random", num_kv_blocks=24)
    hits = updates = 0
    for seed in range(800):
        spec = replace(
            base, seed=seed, pipeline_depth=1 + seed % 3, num_speculative_tokens=seed % 3
        )
        tracker = track(load_tape(run_storm(spec).tape))
        assert tracker.hits == [], (seed, [h.describe() for h in tracker.hits])
        hits += tracker.num_hits
        updates += len(tracker.updates)
    assert hits > 500 and updates > 1000  # the checker had work to do
    caught = 0
    for seed in range(200):  # 13 caught since the storms also sleep and abort all (5 of 100)
        spec = replace(base, seed=seed, faults=("prefix_cache_kept_across_weight_update",))
        caught += bool(track(load_tape(run_storm(spec).tape)).hits)
    assert caught >= 5
