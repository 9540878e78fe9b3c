"""The `deliver` discard policy: vLLM since #48245 (the answer to #47900), the semantics of the
vLLM tapes tokentape.integrations.vllm records. A preemption zeroes the placeholders and marks
what is in flight stale; stale output is delivered but not counted, and the request is not
scheduled again until it has drained; a reset's preemption drops it instead.

Hand-written events for the reducer and the postmortem, and tokentape's own engine run under
the policy (its scheduler waits for the stale output, as vLLM's does)."""

from __future__ import annotations

import collections

import msgspec

from tokentape.chaos import StormSpec, run_storm
from tokentape.engine.config import EngineConfig
from tokentape.events import schema as ev
from tokentape.events.discard import DISCARD_POLICIES, discard_count, get_policy
from tokentape.events.reducer import evolve, initial_state
from tokentape.events.state import EngineState, RequestStatus
from tokentape.events.store import MemoryTape
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape, verify

PARAMS = ev.SamplingParams(max_tokens=10)


def apply(state: EngineState, *events: ev.Event) -> EngineState:
    for e in events:
        evolve(state, e)
    return state


def started() -> EngineState:
    """Request r prefilled (4 tokens) in step 0 and decoded in step 1, both in flight."""
    return apply(
        initial_state("deliver"),
        ev.RequestAdded(0, "r", [5, 6, 7, 8], PARAMS),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 4, 0, [0])]),
        ev.StepScheduled(1, [ev.ScheduledEntry("r", 0, 4, 1, 0, [])]),
    )


def test_deliver_is_a_policy_that_never_drops_a_fresh_frame() -> None:
    policy = get_policy("deliver")
    assert "deliver" in DISCARD_POLICIES and policy.delivers_stale and not policy.may_drop_fresh
    assert EngineConfig(discard_policy="deliver").discard_policy == "deliver"
    assert not any(get_policy(p).delivers_stale for p in ("epoch", "counter", "flag"))


def test_stale_output_after_kv_pressure_is_delivered_and_not_counted() -> None:
    s = apply(started(), ev.RequestPreempted(2, "r", "kv_pressure", 2))
    r = s.requests["r"]
    assert r.status is RequestStatus.PREEMPTED and r.num_output_placeholders == 0
    assert r.num_stale_in_flight == 2 and not r.drop_stale_output and discard_count(s, r) == 0
    apply(
        s,
        ev.FrameProduced(0, [ev.FrameEntry("r", [42])]),
        ev.FrameProduced(1, [ev.FrameEntry("r", [43])]),
    )
    assert r.output_token_ids == [42, 43] and r.num_frames_dropped == 0
    assert r.num_output_placeholders == 0  # not decremented: no underflow (#47900)
    assert r.num_stale_in_flight == 0 and s.pending_output == {"r": None}
    # Scheduled again once drained: the recompute covers prompt and both delivered tokens.
    apply(
        s,
        ev.StepScheduled(2, [ev.ScheduledEntry("r", 1, 0, 6, 0, [3])]),
        ev.FrameProduced(2, [ev.FrameEntry("r", [44])]),
    )
    assert r.output_token_ids == [42, 43, 44] and r.num_output_placeholders == 0


def test_a_reset_drops_the_stale_output() -> None:
    s = apply(started(), ev.RequestPreempted(2, "r", "reset_prefix_cache", 2))
    r = s.requests["r"]
    assert r.drop_stale_output and discard_count(s, r) == 2
    # A reset allows the request back at once: its new entry is fresh behind the stale ones.
    apply(
        s,
        ev.StepScheduled(2, [ev.ScheduledEntry("r", 1, 0, 4, 0, [1])]),
        ev.FrameProduced(0, [ev.FrameEntry("r", [42])]),
    )
    assert r.output_token_ids == [] and r.num_frames_dropped == 1 and discard_count(s, r) == 1
    apply(
        s,
        ev.FrameProduced(1, [ev.FrameEntry("r", [43])]),
        ev.FrameProduced(2, [ev.FrameEntry("r", [42])]),
    )
    assert r.output_token_ids == [42] and r.num_frames_dropped == 2 and discard_count(s, r) == 0


def test_an_undrained_dropped_share_stays_dropped_at_the_next_preemption() -> None:
    """vLLM's _preempt_request: `drop = reset or (drop and stale share left)`."""
    s = apply(
        started(),
        ev.RequestPreempted(2, "r", "reset_prefix_cache", 2),
        ev.StepScheduled(2, [ev.ScheduledEntry("r", 1, 0, 4, 0, [1])]),
        ev.RequestPreempted(3, "r", "kv_pressure", 3),
    )
    r = s.requests["r"]
    assert r.drop_stale_output and r.num_stale_in_flight == 3 and discard_count(s, r) == 3
    for step in range(3):
        apply(s, ev.FrameProduced(step, [ev.FrameEntry("r", [42 + step])]))
    assert r.output_token_ids == [] and r.num_frames_dropped == 3
    # Drained: a later KV-pressure preemption delivers again.
    apply(
        s,
        ev.StepScheduled(3, [ev.ScheduledEntry("r", 2, 0, 4, 0, [1])]),
        ev.RequestPreempted(4, "r", "kv_pressure", 1),
    )
    assert not r.drop_stale_output and discard_count(s, r) == 0


def test_synchronous_scheduling_has_no_discard_logic() -> None:
    s = apply(
        initial_state("deliver", async_scheduling=False),
        ev.RequestAdded(0, "r", [5, 6], PARAMS),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 2, 0, [0])]),
        ev.FrameProduced(0, [ev.FrameEntry("r", [42])]),
        ev.RequestPreempted(1, "r", "reset_prefix_cache", 0),
    )
    assert not s.requests["r"].drop_stale_output


def _stale_fates(tape: MemoryTape) -> collections.Counter[str]:
    """How the stale frames of a tape ended: delivered or dropped."""
    t = load_tape(tape)
    state = t.initial_state()
    fates: collections.Counter[str] = collections.Counter()
    for _, e in t.events():
        if isinstance(e, ev.FrameProduced):
            step = state.in_flight_steps[0]
            before = [
                (req, x.epoch != req.epoch, req.num_frames_dropped, len(req.output_token_ids))
                for x, req in zip(step.entries, step.requests)
                if x.req_id not in step.partial and req.stop_reason is None
            ]
            evolve(state, e)
            for req, stale, dropped, n in before:
                if stale:
                    fates[
                        "dropped"
                        if req.num_frames_dropped > dropped
                        else "delivered"
                        if len(req.output_token_ids) > n
                        else "stopped"
                    ] += 1
        else:
            evolve(state, e)
    return fates


def test_tokentape_under_deliver_waits_for_stale_output_and_gives_the_oracle_stream() -> None:
    """Depth 3 and speculative tokens, KV pressure, resets, pauses: stale output is delivered
    and dropped, and every stream is still the oracle's, with no finding."""
    result = run_storm(
        StormSpec(
            seed=12,  # a storm whose stale frames meet both fates (the seeds draw COMMANDS)
            pipeline_depth=3,
            num_speculative_tokens=2,
            num_commands=300,
            discard_policy="deliver",
        )
    )
    assert result.oracle_violations() == {}
    fates = _stale_fates(result.tape)
    assert fates["delivered"] and fates["dropped"]
    assert postmortem(result.tape).findings == [] and verify(result.tape).ok


def _header(policy: str, depth: int) -> ev.TapeHeader:
    config = EngineConfig(
        model="tiny", discard_policy=policy, pipeline_depth=depth, num_kv_blocks=64, block_size=4
    )
    return ev.TapeHeader(ev.FORMAT_VERSION, msgspec.to_builtins(config), policy, "tiny", 0, "test")


def test_postmortem_names_stale_output_delivered_after_the_request_came_back() -> None:
    """What #48245's wait prevents: the request scheduled again before its stale output
    drained, so that output's position is computed twice."""
    tape = MemoryTape(_header("deliver", 3))
    for e in (
        ev.RequestAdded(0, "r", [5, 6, 7, 8], PARAMS),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 4, 0, [0])]),
        ev.StepScheduled(1, [ev.ScheduledEntry("r", 0, 4, 1, 0, [])]),
        ev.RequestPreempted(2, "r", "kv_pressure", 2),
        ev.StepScheduled(2, [ev.ScheduledEntry("r", 1, 0, 4, 0, [1])]),  # too early
        ev.FrameProduced(0, [ev.FrameEntry("r", [42])]),
        ev.FrameProduced(1, [ev.FrameEntry("r", [43])]),
        ev.FrameProduced(2, [ev.FrameEntry("r", [42])]),
    ):
        tape.append(e)
    findings = [f for f in postmortem(tape).findings if f.kind == "stale_frame_applied"]
    assert findings and findings[0].bug_class == "vllm#47900"
    assert "scheduled again before its stale output drained" in findings[0].message

    waited = MemoryTape(_header("deliver", 3))  # the same run, scheduled again once drained
    for e in (
        ev.RequestAdded(0, "r", [5, 6, 7, 8], ev.SamplingParams(max_tokens=3)),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 4, 0, [0])]),
        ev.StepScheduled(1, [ev.ScheduledEntry("r", 0, 4, 1, 0, [])]),
        ev.RequestPreempted(2, "r", "kv_pressure", 2),
        ev.FrameProduced(0, [ev.FrameEntry("r", [42])]),
        ev.FrameProduced(1, [ev.FrameEntry("r", [43])]),
        ev.OutputsEmitted(2, [ev.EmittedOutput("r", [42, 43], False)]),
        ev.StepScheduled(2, [ev.ScheduledEntry("r", 1, 0, 6, 0, [1, 2])]),
        ev.FrameProduced(2, [ev.FrameEntry("r", [44])]),
        ev.RequestFinished(3, "r", "length"),
        ev.OutputsEmitted(3, [ev.EmittedOutput("r", [44], True, "length")]),
    ):
        waited.append(e)
    # (Hand-written, not tokentape's scheduler's decisions: verify's re-run differs.)
    assert [f.kind for f in postmortem(waited).findings] == ["replay_diverged"]
