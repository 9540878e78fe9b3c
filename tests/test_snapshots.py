"""Snapshots: seeking through them gives exactly the state a fold from the start gives."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from tape_scenarios import busy, double_reset, pause_resume
from tokentape.events import schema as ev
from tokentape.events.reducer import evolve
from tokentape.events.state import EngineState
from tokentape.replay import load_tape
from tokentape.replay.snapshots import SnapshotIndex, copy_state
from tokentape.replay.tape import Tape


@cache
def recorded() -> tuple[object, ...]:
    return (busy(), busy(seed=3), pause_resume("flag"), double_reset("counter"), double_reset("epoch"))


def fold_to_step(tape: Tape, step: int) -> EngineState:
    """The baseline: fold from the start until step `step + 1` is scheduled."""
    state = tape.initial_state()
    for _, event in tape.events():
        if isinstance(event, ev.StepScheduled) and event.step > step:
            break
        evolve(state, event)
    return state


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_seek_through_snapshots_equals_fold_from_start(data: st.DataObject) -> None:
    source = data.draw(st.sampled_from(recorded()))
    interval = data.draw(st.integers(1, 40), label="interval")
    tape = Tape(load_tape(source).reader, snapshot_interval=interval)
    n = len(tape)
    # Several seeks on one index, in any order: backwards, forwards, past the indexed part.
    for seq in data.draw(st.lists(st.integers(0, n), min_size=1, max_size=5), label="seqs"):
        assert tape.state_at(seq) == tape.fold(until_seq=seq)
    num_steps = tape.fold().step
    for step in data.draw(st.lists(st.integers(0, num_steps + 2), min_size=1, max_size=4), label="steps"):
        assert tape.at(step) == fold_to_step(tape, step)


def test_a_copy_is_independent_of_its_original() -> None:
    tape = load_tape(busy())
    events = list(tape.events())
    half = len(events) // 2
    original = tape.fold(until_seq=half)
    copy = copy_state(original)
    assert copy == original and copy is not original
    for _, event in events[half:]:
        evolve(copy, event)
    assert original == tape.fold(until_seq=half)
    assert copy == tape.fold()
    # In-flight steps point at the copy's own requests, never at the original's.
    for step in copy.in_flight_steps:
        assert all(copy.requests[r.req_id] is r for r in step.requests)


def test_the_index_reads_only_as_far_as_asked_and_knows_every_step() -> None:
    tape = load_tape(busy())
    index = SnapshotIndex(tape.events, tape.initial_state(), len(tape), interval=8)
    index.state_at(10)
    assert index.indexed_to == 10
    assert index.seq_of_step(3) is not None and index.indexed_to < len(tape)
    index.build()
    steps = [(seq, e.step) for seq, e in tape.events() if isinstance(e, ev.StepScheduled)]
    assert [index.seq_of_step(step) for _, step in steps] == [seq for seq, _ in steps]
    assert index.seq_of_step(len(steps)) is None
    assert index.positions == list(range(0, len(tape) + 1, 8))
