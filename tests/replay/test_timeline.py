"""The timeline: per-request phase spans and instant markers, from recorded runs."""

from __future__ import annotations

import itertools

import pytest
from tape_scenarios import busy, double_reset, pause_resume

from tokentape.replay import load_tape
from tokentape.replay.timeline import ENGINE_MARKERS, PHASES, build_timeline, iter_items


@pytest.mark.parametrize(
    "make", [lambda: pause_resume("flag"), lambda: double_reset("counter"), busy]
)
def test_spans_cover_each_request_from_add_to_finish(make) -> None:  # type: ignore[no-untyped-def]
    tape = load_tape(make())
    tl = build_timeline(tape)
    assert tl.num_events == len(tape)
    state = tape.fold()
    assert tl.num_steps == state.step
    assert tl.requests == list(state.requests)
    for req_id in tl.requests:
        spans = tl.spans_of(req_id)
        assert spans and all(s.phase in PHASES and s.end_seq > s.start_seq for s in spans)
        assert all(
            a.end_seq == b.start_seq and a.phase != b.phase for a, b in itertools.pairwise(spans)
        )
        finish = [m for m in tl.markers_of(req_id) if m.kind == "finish"]
        assert len(finish) == 1 and finish[0].detail == state.requests[req_id].finish_reason
        assert spans[-1].end_seq == finish[0].seq + 1 and not spans[-1].open
    assert all(m.kind in ENGINE_MARKERS for m in tl.markers_of(None))
    seqs = [m.seq for m in tl.markers]
    assert seqs == sorted(seqs)
    assert len(list(iter_items(tl))) == len(tl.spans) + len(tl.markers)


def test_flag_pause_resume_shows_a_fresh_frame_discarded_after_resume() -> None:
    tl = build_timeline(pause_resume("flag"))
    kinds = [m.kind for m in tl.markers_of(None)]
    assert kinds == ["pause", "reset", "resume"]
    resume = tl.markers_of(None)[2].seq
    dropped = [m for m in tl.markers if m.kind == "discarded"]
    assert {m.req_id for m in dropped} == {"r", "s"}
    assert all(m.detail == "fresh" and m.seq > resume for m in dropped)
    phases = [s.phase for s in tl.spans_of("r")]
    assert phases == ["waiting", "prefill", "decode", "paused", "preempted", "prefill", "decode"]


def test_epoch_double_reset_discards_only_stale_frames() -> None:
    tl = build_timeline(double_reset("epoch"))
    dropped = [m for m in tl.markers if m.kind == "discarded"]
    assert dropped and all(m.detail == "stale" for m in dropped)
    assert [m.detail for m in tl.markers_of("r") if m.kind == "preempt"] == [
        "reset_prefix_cache"
    ] * 2


def test_busy_run_has_kv_pressure_preemptions_and_an_abort() -> None:
    tl = build_timeline(busy())
    assert any(m.kind == "preempt" and m.detail == "kv_pressure" for m in tl.markers)
    assert tl.finish_reasons["q7"] == "abort"
    assert "preempted" in {s.phase for s in tl.spans}
