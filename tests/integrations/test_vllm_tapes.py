"""Tapes recorded from vLLM 0.32.0 (tests/tapes/vllm, made by its regenerate.py with
tokentape.integrations.vllm), read where vLLM is not installed: fold, verify (the recorded
decisions folded and checked, since vLLM's scheduler cannot be re-run), postmortem, diff
against tokentape's own run of the same requests, debug, export and inspect; and verify on
copies edited where a recorder or a vLLM bug would go wrong."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tokentape import cli
from tokentape.events import schema as ev
from tokentape.events.reducer import evolve
from tokentape.events.store import MemoryTape
from tokentape.postmortem import postmortem
from tokentape.replay import diff, load_tape, verify

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_scenarios import async_scenario, engine_scenario, run_tokentape  # noqa: E402

TAPES = Path(__file__).resolve().parents[1] / "tapes" / "vllm"
NAMES = ["engine_cpu", "async_scheduler", "async_aborts", "padded_admission"]


@pytest.mark.parametrize("name", NAMES)
def test_a_vllm_tape_verifies_and_has_no_finding(name: str) -> None:
    tape = load_tape(TAPES / f"{name}.tape")
    h = tape.header
    assert (h.source, h.source_version, h.discard_policy) == ("vllm", "0.32.0", "deliver")
    assert h.eos_token_id is None and h.vocab_size > 0
    result = verify(tape)
    assert result.ok and result.num_events == len(tape)
    assert result.statement is not None and "recorded by vllm 0.32.0" in result.statement
    report = postmortem(tape)
    assert report.findings == [] and report.summary.complete
    t = report.summary.tokens
    assert t["produced"] == t["applied"] + t["dropped_stale"] + t["after_stop"] and t["lost"] == 0
    state = tape.fold()
    assert not state.unfinished and not state.in_flight_steps and not state.pending_output


def _kinds(name: str) -> list[ev.Event]:
    return [e for _, e in load_tape(TAPES / f"{name}.tape").events()]


def test_the_tapes_hold_what_they_were_made_for() -> None:
    cpu, asy, aborts = (_kinds(n) for n in NAMES[:3])
    config = load_tape(TAPES / "engine_cpu.tape").config
    assert not config.async_scheduling and config.block_size == 32 and config.num_kv_blocks == 8
    assert load_tape(TAPES / "async_scheduler.tape").config.effective_pipeline_depth == 2
    for events in (cpu, asy):
        reasons = {e.reason for e in events if isinstance(e, ev.RequestPreempted)}
        assert reasons == {"kv_pressure", "reset_prefix_cache"}
        assert any(isinstance(e, ev.GenerationPaused) and e.mode == "keep" for e in events)
    # Under async scheduling both #48245 paths: stale output delivered, and dropped after a reset.
    state = load_tape(TAPES / "async_scheduler.tape").initial_state()
    from tokentape.events.reducer import evolve

    delivered = dropped = 0
    for e in asy:
        if isinstance(e, ev.FrameProduced):
            flight = state.in_flight_steps[0]
            before = [
                (r, x.epoch != r.epoch, len(r.output_token_ids), r.num_frames_dropped)
                for x, r in zip(flight.entries, flight.requests)
                if x.req_id not in flight.partial
            ]
            evolve(state, e)
            delivered += sum(stale and len(r.output_token_ids) > n for r, stale, n, _ in before)
            dropped += sum(stale and r.num_frames_dropped > d for r, stale, _, d in before)
        else:
            evolve(state, e)
    assert delivered and dropped
    assert any(isinstance(e, ev.RequestAborted) for e in aborts)
    assert {e.mode for e in aborts if isinstance(e, ev.GenerationPaused)} == {"wait"}


@pytest.mark.parametrize(
    "name, model, scenario",
    [("engine_cpu", "tiny", engine_scenario), ("async_scheduler", "oracle", async_scenario)],
)
def test_a_vllm_tape_diffs_identical_with_tokentape(
    name: str, model: str, scenario, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The same requests, greedy, on tokentape's engine (the tiny model is the checkpoint vLLM
    ran; the oracle is the model the scheduler driver gave vLLM): no client-visible difference,
    whatever the preemptions, resets and pauses of the vLLM run."""
    ours = tmp_path / "tokentape.tape"
    run_tokentape(scenario("unused"), model, ours)
    d = diff(TAPES / f"{name}.tape", ours)
    assert d.identical, d.format()
    assert postmortem(TAPES / f"{name}.tape", reference=ours).findings == []


def test_the_commands_read_a_vllm_tape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tape = str(TAPES / "async_scheduler.tape")
    assert cli.main(["replay", "verify", tape]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("ok: ") and "events consistent" in out and "recorded by vllm 0.32.0" in out
    )
    assert cli.main(["inspect", tape]) == 0
    assert "recorded from           vllm 0.32.0" in capsys.readouterr().out
    assert cli.main(["export", tape, "--format", "jsonl", "-o", str(tmp_path / "t.jsonl")]) == 0
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) == len(load_tape(tape)) and json.loads(lines[0])["kind"] == "RequestAdded"
    assert cli.main(["postmortem", tape]) == 0
    capsys.readouterr()


def _edited(name: str, edit) -> MemoryTape:  # type: ignore[no-untyped-def]
    """A copy of a recorded tape with the first event `edit` changes (it returns the new
    event, or None to drop it, or the event itself to leave it)."""
    tape = load_tape(TAPES / f"{name}.tape")
    out = MemoryTape(tape.header)
    done = False
    for _, e in tape.events():
        new = e if done else edit(e)
        done = done or new is not e
        if new is not None:
            out.append(new)
    assert done, "nothing was edited"
    return out


def _fails(tape: MemoryTape, words: str) -> None:
    result = verify(tape)
    assert not result.ok and result.first_divergence is not None
    assert words in result.first_divergence.message, result.first_divergence.format()
    assert "derived:" in result.first_divergence.format()


def test_verify_checks_what_the_client_was_given_against_the_fold() -> None:
    def extra_token(e: ev.Event) -> ev.Event:
        if isinstance(e, ev.OutputsEmitted) and e.entries and e.entries[0].token_ids:
            first = e.entries[0]
            return msgspec.structs.replace(
                e,
                entries=[
                    msgspec.structs.replace(first, token_ids=first.token_ids * 2),
                    *e.entries[1:],
                ],
            )
        return e

    _fails(_edited("async_scheduler", extra_token), "the client was given tokens")
    kinds = {f.kind for f in postmortem(_edited("async_scheduler", extra_token)).findings}
    assert "output_mismatch" in kinds


def test_verify_on_a_vllm_tape_under_the_wrong_policy_fails_where_stale_output_was_delivered() -> (
    None
):
    """The policy models vLLM: folded as tokentape's epoch policy (stale output dropped), the
    tape contradicts what vLLM gave its clients."""
    tape = load_tape(TAPES / "async_scheduler.tape")
    config = {**tape.header.config, "discard_policy": "epoch"}
    header = msgspec.structs.replace(tape.header, discard_policy="epoch", config=config)
    out = MemoryTape(header)
    for _, e in tape.events():
        out.append(e)
    _fails(out, "but the fold derives")


def test_verify_checks_the_scheduling_facts() -> None:
    def moved(e: ev.Event) -> ev.Event:  # a decode that does not continue where the request is
        if isinstance(e, ev.StepScheduled) and e.step == 5:
            x = e.entries[0]
            return msgspec.structs.replace(
                e,
                entries=[
                    msgspec.structs.replace(x, num_computed_before=x.num_computed_before + 1),
                    *e.entries[1:],
                ],
            )
        return e

    _fails(_edited("async_scheduler", moved), "the fold has it computed to")

    def in_flight(e: ev.Event) -> ev.Event:
        if isinstance(e, ev.RequestPreempted):
            return msgspec.structs.replace(e, in_flight=e.in_flight + 1)
        return e

    _fails(_edited("async_scheduler", in_flight), "steps in flight, the fold has")

    def reset_ok(e: ev.Event) -> ev.Event:
        if isinstance(e, ev.PrefixCacheReset):
            return msgspec.structs.replace(e, ok=not e.ok)
        return e

    _fails(_edited("engine_cpu", reset_ok), "the prefix-cache reset records ok=")

    def length_as_stop(e: ev.Event) -> ev.Event:
        if isinstance(e, ev.RequestFinished):
            return msgspec.structs.replace(e, reason="abort")
        return e

    result = verify(_edited("engine_cpu", length_as_stop))
    assert not result.ok and "reach the length condition" in result.first_divergence.message  # type: ignore[union-attr]

    def dropped_preemption(e: ev.Event) -> ev.Event | None:
        return (
            None if isinstance(e, ev.RequestPreempted) and e.reason == "reset_prefix_cache" else e
        )

    _fails(_edited("engine_cpu", dropped_preemption), "left 1 request(s) running")


def test_verify_refuses_a_budget_or_epoch_vllm_never_gives() -> None:
    def epoch(e: ev.Event) -> ev.Event:
        if isinstance(e, ev.StepScheduled) and e.step == 3:
            return msgspec.structs.replace(
                e, entries=[msgspec.structs.replace(e.entries[0], epoch=7), *e.entries[1:]]
            )
        return e

    _fails(_edited("async_aborts", epoch), "is scheduled in epoch 7")

    tape = load_tape(TAPES / "async_aborts.tape")
    config = {**tape.header.config, "max_num_batched_tokens": 8}
    small = MemoryTape(msgspec.structs.replace(tape.header, config=config))
    for _, e in tape.events():
        small.append(e)
    result = verify(small)
    assert not result.ok and "more than max_num_batched_tokens 8" in result.first_divergence.message  # type: ignore[union-attr]


def test_the_debugger_steps_through_a_vllm_tape() -> None:
    """Breakpoints on a vLLM tape stop where vLLM preempted with a step in flight (its stale
    output then delivered under 'deliver'), and every position is the fold's state there."""
    import io

    from tokentape.replay.debugger import TapeDebugger

    tape = load_tape(TAPES / "async_scheduler.tape")
    events = [e for _, e in tape.events()]
    first = next(
        i for i, e in enumerate(events) if isinstance(e, ev.RequestPreempted) and e.in_flight
    )
    out = io.StringIO()
    dbg = TapeDebugger(tape, io.StringIO(), out, rich=False)
    for command in ("break kind=RequestPreempted", "continue"):
        dbg.onecmd(dbg.precmd(command))
    first_any = next(i for i, e in enumerate(events) if isinstance(e, ev.RequestPreempted))
    assert dbg.pos == first_any + 1 and "breakpoint 1 hit: kind=RequestPreempted" in out.getvalue()
    dbg.onecmd(dbg.precmd(f"goto @{first}"))  # the event itself: applied
    assert dbg.state == tape.fold(until_seq=first + 1)
    assert dbg.state.requests[events[first].req_id].num_output_placeholders == 0  # type: ignore[attr-defined]
    for command in ("next FrameProduced", "back 5", "goto end"):
        dbg.onecmd(dbg.precmd(command))
        assert dbg.state == tape.fold(until_seq=dbg.pos), command
    assert dbg.pos == len(events) and "error" not in out.getvalue()


def test_an_admission_padded_to_the_uniform_decode_size_is_not_vllm_40768() -> None:
    """vLLM 0.32.0 admits a preempted request whose prefix-cache hit leaves one token to compute
    with -1 drafts padding it to 1 + k tokens (pad_spec_decode): slots that hold -1 as input
    ids, as #40768's leaked placeholders did, but the scheduler's own and rejected by the
    sampler. The tape holds such an admission, and the postmortem does not call it #40768
    (the test above: no finding at all)."""
    tape = load_tape(TAPES / "padded_admission.tape")
    state = tape.initial_state()
    padded = []
    for _, e in tape.events():
        if isinstance(e, ev.StepScheduled):
            for x in e.entries:
                if x.req_id in state.waiting and x.num_spec_tokens:
                    assert x.num_new_tokens == 1 + x.num_spec_tokens == 3
                    assert x.num_computed_before + 1 == state.requests[x.req_id].num_tokens
                    padded.append(x)
        evolve(state, e)
    assert padded and all(x.epoch > 0 for x in padded)  # admitted again, after a preemption


# -- tapes recorded from the other releases the recorder knows -----------------------------------


def test_vllm_0_20_0_drops_the_first_token_after_a_pause_and_resume() -> None:
    """vLLM 0.20.0's own AsyncScheduler, recorded: pause(keep, clear_cache) with two requests
    decoding, resume. The postmortem names the seed bug without anyone reading vLLM's code."""
    tape = load_tape(TAPES / "0.20.0_pause_resume.tape")
    assert (tape.header.source_version, tape.header.discard_policy) == ("0.20.0", "vllm-flag")
    assert verify(tape).ok
    report = postmortem(tape)
    dropped = [f for f in report.findings if f.kind == "post_resume_token_dropped"]
    assert sorted(r for f in dropped for r in f.request_ids) == ["a", "b"]
    assert {f.bug_class for f in dropped} == {"vllm#42043"} and report.summary.complete
    newer = load_tape(TAPES / "0.33.0_pause_resume.tape")
    assert newer.header.source_version == "0.33.0" and postmortem(newer).findings == []
    # The same requests: 0.33.0's clients got every token, 0.20.0's lost one each.
    d = diff(tape, newer)
    assert not d.identical and d.first is not None and d.first.req_id == "a"


def test_vllm_0_20_0_leaves_a_request_hung_after_the_dropped_token() -> None:
    """async_scheduler's scenario on vLLM 0.20.0: its pause drops a token (#42043), and a
    request that lost it one token short of max_tokens keeps a placeholder for it, which vLLM's
    async max_tokens guard counts: it is never scheduled again (the driver gave up waiting)."""
    tape = load_tape(TAPES / "0.20.0_preemptions.tape")
    assert verify(tape).ok
    report = postmortem(tape)
    phantom = [f for f in report.findings if f.kind == "phantom_placeholders"]
    assert (
        len(phantom) == 1
        and phantom[0].severity == "error"
        and phantom[0].bug_class == "vllm#42043"
    )
    assert "hangs" in phantom[0].message
    assert {f.kind for f in report.findings} >= {"post_resume_token_dropped", "tape_truncated"}


def test_vllm_0_24_0_handles_the_same_preemptions_cleanly() -> None:
    """vLLM 0.24.0 (the counter of #42117) on the same scenario: stale frames dropped after the
    reset, delivered after KV-pressure preemptions, nothing lost; its clients got what the 0.32.0
    run's got."""
    tape = load_tape(TAPES / "0.24.0_preemptions.tape")
    assert tape.header.discard_policy == "vllm-counter" and verify(tape).ok
    report = postmortem(tape)
    assert report.findings == [] and report.summary.tokens["dropped_stale"] > 0
    d = diff(tape, TAPES / "async_scheduler.tape")
    assert d.identical, d.format()


def _findings(tape: Any) -> dict[str, set[str | None]]:
    """Each finding kind of a tape's postmortem, with the bug classes it named."""
    found: dict[str, set[str | None]] = {}
    for f in postmortem(tape).findings:
        found.setdefault(f.kind, set()).add(f.bug_class)
    return found


def test_speculative_decoding_and_resets_on_the_releases_before_48245() -> None:
    """Two drafts per step under async scheduling, resets with a step in flight, recorded from
    0.20.0, 0.24.0 and 0.26.0; each tape verifies under its release's policy. 0.20.0's flag drops
    the stale frame, but that frame's rejected drafts are still taken off the resumed request's
    placeholders, which go below zero (#46066). 0.24.0's counter is set in tokens (1 + 2 per
    frame) but drained per frame, so fresh frames are dropped after the stale one, and #46066
    too; a request one token short of its limit then hangs. 0.26.0 has #46066's guard: fresh
    frames are still dropped, nothing goes below zero."""
    expected = {
        "0.20.0": ("vllm-flag", {"negative_count": {"vllm#46066"}}),
        "0.24.0": (
            "vllm-counter",
            {
                "negative_count": {"vllm#46066"},
                "fresh_frame_dropped": {"vllm#42117-spec-units"},
                "phantom_placeholders": {"vllm#42117-spec-units"},
            },
        ),
        "0.26.0": (
            "vllm-counter-guarded",
            {
                "fresh_frame_dropped": {"vllm#42117-spec-units"},
                "phantom_placeholders": {"vllm#42117-spec-units"},
            },
        ),
    }
    for version, (policy, findings) in expected.items():
        tape = load_tape(TAPES / f"{version}_spec_resets.tape")
        assert (tape.header.source_version, tape.header.discard_policy) == (version, policy)
        assert verify(tape).ok, version
        kinds = ("negative_count", "fresh_frame_dropped", "phantom_placeholders")
        found = {k: v for k, v in _findings(tape).items() if k in kinds}
        assert found == findings, (version, found)


def test_the_recorder_knows_each_release_and_reads_the_others_by_their_code() -> None:
    from tokentape.integrations.vllm.mapping import UnsupportedByRecorder
    from tokentape.integrations.vllm.releases import check_release, release_of

    taught = {
        v: release_of(v)
        for v in (
            *("0.20.0", "0.21.0", "0.22.0", "0.24.1", "0.25.0", "0.26.0", "0.27.0"),
            *("0.32.0+cpu", "0.33.1rc1", "0.34.0"),
        )
    }
    assert {v: r.discard_policy for v, r in taught.items() if r is not None} == {
        "0.20.0": "vllm-flag",
        "0.21.0": "vllm-flag",
        "0.22.0": "vllm-counter",
        "0.24.1": "vllm-counter",
        "0.25.0": "vllm-counter-guarded",
        "0.26.0": "vllm-counter-guarded",
        "0.27.0": "deliver",
        "0.32.0+cpu": "deliver",
        "0.33.1rc1": "deliver",
        "0.34.0": "deliver",
    }
    assert all(release_of(v) is None for v in ("0.19.1", "0.35.0", "1.0.0"))
    with pytest.raises(UnsupportedByRecorder, match="cannot read this version"):
        release_of("main")

    # A release outside the ranges is read by its code: here two schedulers, one with
    # #48245's preemption and one with no mechanism the recorder knows.
    class Delivering:
        def _preempt_request(self, request: object, timestamp: float, drop_stale_output: bool):
            pass

    class Request:
        def __init__(self) -> None:
            self.num_preemptions = 0

    release = check_release("0.35.0", Delivering, Request)
    assert (release.discard_policy, release.taught) == ("deliver", False)
    assert check_release("0.34.0", Delivering, Request).taught
    with pytest.raises(UnsupportedByRecorder, match="no discard mechanism the recorder knows"):
        check_release("0.35.0", Request, Request)
    with pytest.raises(UnsupportedByRecorder, match="expects Request.discard_latest_async"):
        check_release("0.20.0", Delivering, Request)


def test_vllm_0_20_0_resumes_on_a_wake_up_of_the_weights_alone() -> None:
    """An RL loop's sleep on vLLM 0.20.0's own EngineCore.sleep / wake_up code: sleep(level=1,
    keep), wake_up(["weights"]), wake_up(["kv_cache"]). 0.20.0's first wake-up resumes
    scheduling (#44395): the next step is scheduled onto the KV cache still asleep, and the
    device fails there. 0.24.0 (#44483) waits for the KV cache and serves every token."""
    tape = load_tape(TAPES / "0.20.0_partial_wake.tape")
    assert tape.header.source_version == "0.20.0"
    assert tape.config.faults == ["resume_on_partial_wake"]  # 0.20.0's wake_up, read from it
    events = [e for _, e in tape.events()]
    kinds = [type(e).__name__ for e in events]
    woke = kinds.index("EngineWokeUp")
    assert kinds[woke - 1] == "EngineSlept" and kinds[woke + 1 : woke + 3] == [
        "GenerationResumed",
        "StepScheduled",
    ]
    assert isinstance(events[-1], ev.EngineError) and "illegal memory access" in events[-1].message
    assert verify(tape).ok
    report = postmortem(tape)
    found = {(f.kind, f.bug_class) for f in report.findings}
    assert ("step_on_sleeping_kv_cache", "vllm#44395") in found, found
    fixed = load_tape(TAPES / "0.24.0_partial_wake.tape")
    assert fixed.config.faults == [] and postmortem(fixed).findings == []
    fixed_kinds = [type(e).__name__ for _, e in fixed.events()]
    start = fixed_kinds.index("EngineSlept")
    assert fixed_kinds[start + 1 : start + 4] == [
        "EngineWokeUp",
        "EngineWokeUp",
        "GenerationResumed",
    ]
    assert fixed.fold().unfinished == []


def test_placeholders_left_over_show_at_the_step_they_are_left() -> None:
    """vLLM 0.20.0's flag drops a fresh frame and keeps its placeholder: the request runs on
    with nothing in flight but a placeholder for a token that never comes. The postmortem
    says so at the step it happens, before the finish (or the hang) shows it."""
    report = postmortem(load_tape(TAPES / "0.20.0_pause_resume.tape"))
    left = {f.request_ids[0]: f for f in report.findings if f.kind == "placeholders_left_over"}
    at_finish = {
        f.request_ids[0]: f for f in report.findings if f.kind == "count_nonzero_at_finish"
    }
    assert sorted(left) == sorted(at_finish) == ["a", "b"]
    for rid, f in left.items():
        assert f.bug_class == "vllm#42043" and f.steps[0] < at_finish[rid].steps[0]
    hung = postmortem(load_tape(TAPES / "0.20.0_preemptions.tape"))
    left_steps = {
        f.request_ids[0]: f.steps[0] for f in hung.findings if f.kind == "placeholders_left_over"
    }
    phantom = [f for f in hung.findings if f.kind == "phantom_placeholders"]
    assert phantom and all(left_steps[f.request_ids[0]] < f.steps[0] for f in phantom)
    for clean in ("async_scheduler", "0.33.0_pause_resume", "0.24.0_partial_wake"):
        assert postmortem(load_tape(TAPES / f"{clean}.tape")).findings == []


def test_a_late_stop_after_a_reset_discarded_the_output_in_flight_is_49860() -> None:
    """vLLM 0.24.0, two drafts a step, a reset with a step in flight: the counter discards the
    output in flight without giving its placeholders back, which then count tokens that never
    come, and the request is scheduled past its last token: #49860's late stop, recorded from
    the release (the PR that fixed it on that path closed when #48245 removed the counter)."""
    report = postmortem(load_tape(TAPES / "0.24.0_spec_resets.tape"))
    late = [f for f in report.findings if f.kind == "scheduled_past_stop"]
    assert late and {f.bug_class for f in late} == {"vllm#49860"}
    assert all("after a reset discarded its output in flight" in f.message for f in late)
    preempted = {
        e.req_id
        for _, e in load_tape(TAPES / "0.24.0_spec_resets.tape").events()
        if isinstance(e, ev.RequestPreempted) and e.reason == "reset_prefix_cache" and e.in_flight
    }
    assert {r for f in late for r in f.request_ids} <= preempted
    assert postmortem(load_tape(TAPES / "0.26.0_spec_resets.tape")).findings  # its own kinds
    assert not [
        f
        for f in postmortem(load_tape(TAPES / "async_scheduler.tape")).findings
        if f.kind == "scheduled_past_stop"
    ]
