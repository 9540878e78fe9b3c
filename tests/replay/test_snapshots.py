"""Snapshots: seeking through them gives exactly the state a fold from the start gives."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tape_scenarios import busy, double_reset, pause_resume

from tokentape.events import schema as ev
from tokentape.events.reducer import evolve
from tokentape.events.state import EngineState
from tokentape.events.store import MemoryTape
from tokentape.replay import load_tape
from tokentape.replay.snapshots import SnapshotIndex, copy_request, copy_state, is_settled
from tokentape.replay.tape import Tape


@cache
def recorded() -> tuple[object, ...]:
    return (
        busy(),
        busy(seed=3),
        pause_resume("flag"),
        double_reset("counter"),
        double_reset("epoch"),
    )


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
    for step in data.draw(
        st.lists(st.integers(0, num_steps + 2), min_size=1, max_size=4), label="steps"
    ):
        if step < num_steps:
            assert tape.at(step) == fold_to_step(tape, step)
        else:
            with pytest.raises(
                IndexError,
                match=f"step {step} is out of range: the tape schedules steps 0..{num_steps - 1}",
            ):
                tape.at(step)


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
    assert index.seq_of_step(-1) is None  # not the last step, as a list index would give
    assert index.positions == list(range(0, len(tape) + 1, 8))


def test_a_step_the_tape_does_not_schedule_is_an_index_error() -> None:
    tape = load_tape(busy())
    num_steps = tape.fold().step
    assert tape.at(num_steps - 1) == tape.fold()  # the last step: the end of the tape
    for step in (num_steps, num_steps + 100):
        with pytest.raises(IndexError, match=f"the tape schedules steps 0..{num_steps - 1}"):
            tape.at(step)
    for step in (-1, -5):
        with pytest.raises(
            IndexError, match=f"step {step} is out of range: steps are numbered from 0"
        ):
            tape.at(step)
    empty = MemoryTape(tape.header)
    with pytest.raises(IndexError, match="step 0 is out of range: the tape schedules no step"):
        load_tape(empty).at(0)
    # The index itself still answers for a negative step: the state before step 0.
    before_step_0 = fold_to_step(tape, -1)
    assert not before_step_0.in_flight_steps
    assert tape.snapshots.state_at_step(-1) == before_step_0


def test_settled_requests_never_change_again() -> None:
    """What lets copies share settled requests: once finished, with nothing in flight and
    its output delivered, no event changes a request."""
    for source in recorded():
        tape = load_tape(source)
        state = tape.initial_state()
        frozen: dict[str, object] = {}
        for _, event in tape.events():
            evolve(state, event)
            for req_id, req in state.requests.items():
                if req_id in frozen:
                    assert req == frozen[req_id], req_id
                elif is_settled(state, req):
                    frozen[req_id] = copy_request(req)
        assert frozen.keys() == state.requests.keys()


def test_a_copy_shares_only_settled_requests() -> None:
    tape = load_tape(busy())
    for seq in range(0, len(tape), 17):
        state = tape.fold(until_seq=seq)
        copy = copy_state(state)
        for req_id, req in state.requests.items():
            assert (copy.requests[req_id] is req) == is_settled(state, req)


@settings(max_examples=25, deadline=None)
@given(
    depth=st.integers(1, 3),
    policy=st.sampled_from(["epoch", "counter", "flag"]),
    k=st.integers(0, 2),
    blocks=st.integers(12, 40),
    requests=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 16)), min_size=1, max_size=5),
    commands=st.lists(
        st.tuples(st.integers(0, 12), st.sampled_from(["pause", "reset", "abort"])), max_size=3
    ),
    data=st.data(),
)
def test_seek_equals_fold_on_random_runs(
    depth, policy, k, blocks, requests, commands, data
) -> None:  # type: ignore[no-untyped-def]
    """Random engine runs (KV pressure, resets, pauses, aborts), random seeks."""
    from tokentape import LLM, SamplingParams

    llm = LLM(
        model="oracle-random",
        tape=None,
        pipeline_depth=depth,
        discard_policy=policy,
        num_speculative_tokens=k,
        block_size=4,
        num_kv_blocks=blocks,
        max_num_batched_tokens=16,
    )
    for i, (prompt_len, max_tokens) in enumerate(requests):
        llm.llm_engine.add_request(
            f"q{i}",
            list(range(3, 3 + prompt_len)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
    todo = sorted(commands)
    for n in range(400):
        while todo and todo[0][0] == n:
            _, what = todo.pop(0)
            if what == "pause":
                llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
                llm.llm_engine.resume_generation()
            elif what == "reset":
                llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
            else:
                llm.llm_engine.abort_request("q0")
        if not llm.llm_engine.has_unfinished_requests() and not todo:
            break
        llm.llm_engine.step()
    tape = Tape(
        load_tape(llm.llm_engine.engine_core.tape).reader,
        snapshot_interval=data.draw(st.integers(1, 30)),
    )
    n = len(tape)
    for seq in data.draw(st.lists(st.integers(0, n), min_size=1, max_size=4)):
        assert tape.state_at(seq) == tape.fold(until_seq=seq)
    num_steps = tape.fold().step
    step = data.draw(st.integers(0, num_steps + 1))
    if step < num_steps:
        assert tape.at(step) == fold_to_step(tape, step)
    else:
        with pytest.raises(IndexError):
            tape.at(step)
