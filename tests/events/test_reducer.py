"""The reducer on hand-written events: the discard policies and request bookkeeping."""

from __future__ import annotations

import pytest

from tokentape.events import schema as ev
from tokentape.events.discard import discard_count
from tokentape.events.fold_errors import ReducerError
from tokentape.events.reducer import evolve, initial_state
from tokentape.events.state import EngineState, RequestStatus
from tokentape.events.stop_check import check_stop

PARAMS = ev.SamplingParams(max_tokens=10)


def apply(state: EngineState, *events: ev.Event) -> EngineState:
    for e in events:
        evolve(state, e)
    return state


def decode_step(step: int, epoch: int, computed: int, k: int = 0) -> ev.StepScheduled:
    return ev.StepScheduled(step, [ev.ScheduledEntry("r", epoch, computed, 1 + k, k, [])])


def started(policy: str) -> EngineState:
    """Request r prefilled (4 tokens) in step 0 and decoded in step 1, both in flight."""
    return apply(
        initial_state(policy),
        ev.RequestAdded(0, "r", [5, 6, 7, 8], PARAMS),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 4, 0, [0])]),
        decode_step(1, 0, 4),
    )


def test_schedule_counts_placeholders_and_in_flight_entries() -> None:
    s = started("epoch")
    r = s.requests["r"]
    assert r.status is RequestStatus.RUNNING and s.running == ["r"] and not s.waiting
    assert r.num_computed_tokens == 5 and r.num_output_placeholders == 2
    assert [step for step, _ in s.in_flight_entries("r")] == [0, 1] and r.block_ids == [0]
    assert r.num_in_flight == 2 and r.num_fresh_in_flight == 2
    apply(s, ev.FrameProduced(0, [ev.FrameEntry("r", [42])]))
    assert r.output_token_ids == [42] and r.num_output_placeholders == 1
    assert s.pending_output == {"r": None}


@pytest.mark.parametrize("policy", ["epoch", "counter", "flag"])
def test_a_stale_frame_after_preemption_is_dropped(policy: str) -> None:
    s = started(policy)
    r = s.requests["r"]
    apply(s, ev.RequestPreempted(1, "r", "reset_prefix_cache", 2))
    assert r.epoch == 1 and r.status is RequestStatus.PREEMPTED and s.waiting[0] == "r"
    assert r.num_output_placeholders == 0 and r.num_computed_tokens == 0 and r.block_ids == []
    assert discard_count(s, r) == (2 if policy != "flag" else 1)
    apply(s, ev.FrameProduced(0, [ev.FrameEntry("r", [42])]))
    assert r.output_token_ids == [] and r.num_frames_dropped == 1


def test_epoch_never_drops_a_fresh_frame() -> None:
    s = apply(started("epoch"), ev.RequestPreempted(1, "r", "kv_pressure", 2))
    r = s.requests["r"]
    apply(
        s,
        ev.StepScheduled(2, [ev.ScheduledEntry("r", 1, 0, 4, 0, [1])]),
        ev.FrameProduced(0, [ev.FrameEntry("r", [42])]),
        ev.FrameProduced(1, [ev.FrameEntry("r", [43])]),
        ev.FrameProduced(2, [ev.FrameEntry("r", [42])]),
    )
    assert r.output_token_ids == [42] and r.num_frames_dropped == 2
    assert discard_count(s, r) == 0 and r.num_output_placeholders == 0


def test_flag_drops_the_first_fresh_frame_when_nothing_was_in_flight() -> None:
    s = apply(
        initial_state("flag"),
        ev.RequestAdded(0, "r", [5, 6], PARAMS),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 2, 0, [0])]),
        ev.FrameProduced(0, [ev.FrameEntry("r", [42])]),
        ev.RequestPreempted(1, "r", "reset_prefix_cache", 0),
        ev.StepScheduled(1, [ev.ScheduledEntry("r", 1, 0, 3, 0, [0])]),
        ev.FrameProduced(1, [ev.FrameEntry("r", [43])]),
    )
    r = s.requests["r"]
    assert r.output_token_ids == [42] and r.num_frames_dropped == 1  # #42043


def test_flag_does_nothing_under_synchronous_scheduling() -> None:
    s = initial_state("flag", async_scheduling=False)
    apply(
        s,
        ev.RequestAdded(0, "r", [5, 6], PARAMS),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 2, 0, [0])]),
        ev.FrameProduced(0, [ev.FrameEntry("r", [42])]),
        ev.RequestPreempted(1, "r", "reset_prefix_cache", 0),
        ev.StepScheduled(1, [ev.ScheduledEntry("r", 1, 0, 3, 0, [0])]),
        ev.FrameProduced(1, [ev.FrameEntry("r", [43])]),
    )
    assert s.requests["r"].output_token_ids == [42, 43]


def test_counter_is_overwritten_by_a_second_preemption() -> None:
    s = apply(started("counter"), ev.RequestPreempted(1, "r", "reset_prefix_cache", 2))
    r = s.requests["r"]
    assert r.async_tokens_to_discard == 2
    apply(
        s,
        ev.StepScheduled(2, [ev.ScheduledEntry("r", 1, 0, 4, 0, [1])]),
        ev.RequestPreempted(2, "r", "reset_prefix_cache", 3),
    )
    assert r.async_tokens_to_discard == 1  # was 2 still to drop + 1 new: set to 1, not 3
    apply(s, ev.FrameProduced(0, [ev.FrameEntry("r", [42])]))
    apply(s, ev.FrameProduced(1, [ev.FrameEntry("r", [43])]))
    assert r.output_token_ids == [43]  # a stale token got through
    assert r.num_output_placeholders < 0  # and the placeholder count underflowed (#47900)


def test_spec_rejections_give_back_computed_positions() -> None:
    s = apply(
        initial_state("epoch"),
        ev.RequestAdded(0, "r", [5, 6], PARAMS),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 2, 0, [0])]),
        ev.FrameProduced(0, [ev.FrameEntry("r", [7])]),
        decode_step(1, 0, 2, k=3),
    )
    r = s.requests["r"]
    assert r.num_computed_tokens == 6 and r.num_output_placeholders == 4
    apply(s, ev.FrameProduced(1, [ev.FrameEntry("r", [8, 9], [8, 1, 1])]))
    assert r.output_token_ids == [7, 8, 9] and r.num_computed_tokens == 4
    assert r.num_output_placeholders == 0


def _stopping_frame(params: ev.SamplingParams) -> EngineState:
    """A decode with three drafts whose frame holds the stop token 9, then two tokens more."""
    return apply(
        initial_state("epoch"),
        ev.RequestAdded(0, "r", [5, 6], params),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 2, 0, [0])]),
        ev.FrameProduced(0, [ev.FrameEntry("r", [7])]),
        decode_step(1, 0, 2, k=3),
        ev.FrameProduced(1, [ev.FrameEntry("r", [8, 9, 10, 11], [8, 9, 10])]),
    )


def test_stop_conditions_truncate_a_frame() -> None:
    """The reducer applies the whole frame; the scheduler's stop rule says where it stops,
    and the RequestFinished that records it cuts the tokens after the stop."""
    params = ev.SamplingParams(max_tokens=10, stop_token_ids=(9,))
    s = _stopping_frame(params)
    r = s.requests["r"]
    assert r.output_token_ids == [7, 8, 9, 10, 11] and r.finish_reason is None
    assert s.frame_outputs == [(r, 1)]  # where the scheduler's stop check begins
    assert check_stop(r, 1, s.eos_token_id) == ("stop", 9, 3)  # vLLM's stop_reason: the id
    apply(s, ev.RequestFinished(1, "r", "stop", 9, 3))
    assert r.output_token_ids == [7, 8, 9] and r.stop_reason == 9
    assert r.status is RequestStatus.FINISHED_STOPPED and s.running == [] and r.block_ids == []
    # A length finish inside a frame, as the rule finds it: max_tokens=2 stops at 8.
    short = _stopping_frame(ev.SamplingParams(max_tokens=2, stop_token_ids=(9,)))
    assert check_stop(short.requests["r"], 1, None) == ("length", None, 2)
    with pytest.raises(ReducerError, match="finished with 6 output tokens"):
        apply(short, ev.RequestFinished(1, "r", "length", None, 6))
    with pytest.raises(ReducerError, match="stop token 10, which is not one of"):
        apply(short, ev.RequestFinished(1, "r", "stop", 10, 3))


def test_a_finish_that_does_not_say_its_length_is_cut_by_the_stop_rule() -> None:
    """A tape before format 6 (or another engine's recording) has no num_output_tokens: the
    reducer cuts where the stop rule says, as its reducer cut the frame."""
    s = _stopping_frame(ev.SamplingParams(max_tokens=10, stop_token_ids=(9,)))
    apply(s, ev.RequestFinished(1, "r", "stop"))
    r = s.requests["r"]
    assert r.output_token_ids == [7, 8, 9] and r.stop_reason is None
    s = _stopping_frame(ev.SamplingParams(max_tokens=2))
    apply(s, ev.RequestFinished(1, "r", "length"))
    assert s.requests["r"].output_token_ids == [7, 8]


def test_inconsistent_events_are_refused() -> None:
    s = started("epoch")
    with pytest.raises(ReducerError, match="never added"):
        evolve(s, ev.RequestAborted(1, "ghost"))
    with pytest.raises(ReducerError, match="added twice"):
        evolve(s, ev.RequestAdded(1, "r", [1], PARAMS))
    with pytest.raises(ReducerError, match="step 1 arrived when step 0"):
        evolve(s, ev.FrameProduced(1, []))
    with pytest.raises(ReducerError, match="scheduled when step 2"):
        evolve(s, decode_step(5, 0, 5))


def test_events_round_trip_through_msgpack() -> None:
    events = [
        ev.RequestAdded(
            0, "r", [5, 6], ev.SamplingParams(max_tokens=3, stop_token_ids=[4], seed=7)
        ),
        ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 2, 0, [0, 1])]),
        ev.FrameProduced(0, [ev.FrameEntry("r", [7], [], [-0.5])]),
        ev.OutputsEmitted(0, [ev.EmittedOutput("r", [7], False, None)]),
        ev.GenerationPaused(1, "keep", True),
        ev.EngineError(1, "RuntimeError", "boom"),
    ]
    for e in events:
        assert ev.decode(ev.encode(e)) == e
