"""The postmortem driver: one streaming pass over a tape, the reducer deriving the state and
the checkers reading it around each event, then a report.

    report = postmortem("run.tape")                  # Report(findings, summary)
    report = postmortem("run.tape", reference="good.tape")

A tape that cannot be read to its end (truncated, damaged) or whose events cannot follow each
other gets a finding naming the event where it breaks; everything before it is analysed.
A tape of a newer format version is refused (TapeFormatError).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from tokentape.engine.model_registry import ORACLE_MODELS
from tokentape.events import schema as ev
from tokentape.events.fold_errors import FOLD_ERRORS, event_refused
from tokentape.events.reducer import evolve
from tokentape.events.segmented_reader import SegmentedTapeReader
from tokentape.events.store import MemoryTape, TapeError, TapeFormatError
from tokentape.postmortem.admission import AdmissionChecker
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context, Item
from tokentape.postmortem.findings import Finding, Report, Summary
from tokentape.postmortem.frames import CountChecker, FrameChecker, HistoryChecker
from tokentape.postmortem.kv import KVChecker
from tokentape.postmortem.outputs import OutputChecker, ReferenceChecker
from tokentape.postmortem.positions import PositionChecker
from tokentape.postmortem.schedule import ScheduleChecker
from tokentape.postmortem.sleep import SleepChecker
from tokentape.postmortem.stuck import StuckChecker
from tokentape.postmortem.weights import WeightsChecker
from tokentape.replay.render import describe_event, event_requests
from tokentape.replay.tape import Tape, load_tape
from tokentape.replay.verify import verify

PROGRESS_EVERY = 1 << 14  # events between progress callbacks

TapeSource = str | os.PathLike[str] | MemoryTape | Tape
Progress = Callable[[int], None]  # called with the number of events analysed so far


# The exceptions that end a run from outside it (an EngineError records their type): an
# `interrupted` warning, not an `engine_error`.
INTERRUPTIONS = frozenset({"KeyboardInterrupt"})


class EngineErrorChecker(Checker):
    _frame: tuple[int, ev.FrameProduced, list[str]] | None = (
        None  # the latest frame, its aborted requests
    )

    def after(self) -> dict[type, Hook]:
        return {
            ev.EngineError: self._error,
            ev.FrameProduced: self._frame_applied,
            ev.RecordingStopped: self._stopped,
        }

    def _stopped(self, seq: int, e: ev.RecordingStopped) -> None:
        """Not a failure of the run: the recorder lost track of it, and says where and why."""
        self.ctx.report(
            "recording_stopped",
            "warning",
            sorted(self.state.running)[:8],
            e.step,
            f"the recording stops at step {e.step}, the run went on unrecorded: "
            f"{' '.join(e.reason.split())}",
            [(seq, e)],
            None,
            seq,
            per_request=False,
        )

    def _frame_applied(self, seq: int, e: ev.FrameProduced) -> None:
        requests = self.state.requests
        self._frame = (
            seq,
            e,
            [x.req_id for x in e.entries if requests[x.req_id].finish_reason == "abort"],
        )

    def _error(self, seq: int, e: ev.EngineError) -> None:
        # The requests it ran, or failing that those of its steps in flight (after a sleep
        # that kept them waiting, with a step still in flight: vLLM #45520).
        names = (
            sorted(self.state.running)[:8]
            or list(dict.fromkeys(x.req_id for s in self.state.in_flight_steps for x in s.entries))[
                :8
            ]
        )
        if e.error_type in INTERRUPTIONS:  # stopped from outside: not a failure of the engine
            self.ctx.report(
                "interrupted",
                "warning",
                names,
                e.step,
                f"the run was interrupted at step {e.step} ({e.error_type}: a Ctrl-C, or "
                f"SIGINT), with {len(self.state.running)} request(s) running",
                [(seq, e)],
                None,
                seq,
            )
            return
        bug, cause, excerpt = None, "", [(seq, e)]
        if self._frame is not None and self._frame[0] == seq - 1 and self._frame[2]:
            # It failed on a frame holding output of requests aborted while it was in flight.
            names, bug, excerpt = self._frame[2][:8], "vllm#52969", [self._frame[:2], (seq, e)]
            cause = f", on the output of aborted request(s) {', '.join(map(repr, names))}"
        else:  # a failure that follows a finding (a block freed twice) carries its class
            bug = next((c for r in names if (c := self.ctx.bug_class_of(r)) is not None), None)
        self.ctx.report(
            "engine_error",
            "error",
            names,
            e.step,
            f"the engine failed at step {e.step}{cause}: "
            f"{e.error_type}: {' '.join(e.message.split())}",
            excerpt,
            bug,
            seq,
        )


def reference_outputs(source: TapeSource) -> dict[str, tuple[list[int], list[int], str | None]]:
    """(prompt, delivered tokens, finish reason) of every request of a reference tape."""
    state = load_tape(source).fold()
    return {
        r.req_id: (r.prompt_token_ids, r.output_token_ids, r.finish_reason)
        for r in state.requests.values()
    }


def _dispatch(checkers: list[Checker], which: str) -> dict[type, tuple[Hook, ...]]:
    table: dict[type, list[Hook]] = {t: [] for t in ev.EVENT_TYPES}
    for checker in checkers:
        for t, hook in getattr(checker, which)().items():
            table[t].append(hook)
    return {t: tuple(hooks) for t, hooks in table.items()}


def postmortem(
    source: TapeSource,
    reference: TapeSource | None = None,
    progress: Progress | None = None,
) -> Report:
    """Run every checker over the tape in one pass and report what they found."""
    tape = load_tape(source)
    ctx = Context(tape, tape.initial_state())
    checkers: list[Checker] = [
        HistoryChecker(ctx),
        FrameChecker(ctx),
        CountChecker(ctx),
        PositionChecker(ctx),
        KVChecker(ctx),
        WeightsChecker(ctx),
        ScheduleChecker(ctx),
        StuckChecker(ctx),
        AdmissionChecker(ctx),
        SleepChecker(ctx),
        OutputChecker(ctx),
        EngineErrorChecker(ctx),
    ]
    ref_name: str | None = None
    if reference is not None:
        ref_tape = load_tape(reference)
        ref_name = f"reference tape {ref_tape.path or '<memory>'}"
        checkers.append(ReferenceChecker(ctx, reference_outputs(ref_tape), ref_name))
    elif tape.header.model_id in ORACLE_MODELS:
        ref_name = "oracle"
        checkers.append(ReferenceChecker(ctx, None, "oracle's expected"))
    complete, last = _run(tape, ctx, checkers, progress)
    for checker in checkers:
        checker.finish()
    if complete:
        _check_end(ctx, last)
    _check_replay(tape, ctx, None if complete else ctx.state.num_events, progress)
    findings = ctx.findings()
    state = ctx.state
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    summary = Summary(
        tape=tape.path or "<memory tape>",
        num_events=state.num_events,
        num_steps=state.step,
        num_requests=len(state.requests),
        discard_policy=tape.header.discard_policy,
        model_id=tape.header.model_id,
        reference=ref_name,
        errors=sum(f.severity == "error" for f in findings),
        warnings=sum(f.severity == "warning" for f in findings),
        counts=counts,
        tokens={
            k: ctx.tokens.get(k, 0)
            for k in ("produced", "applied", "dropped_stale", "dropped_fresh", "after_stop", "lost")
        },
        complete=complete and "tape_truncated" not in counts,
        read_to_end=complete,
        **_segmented_summary(tape),
    )
    return Report(findings, summary)


def run_checkers(source: TapeSource, kinds: Sequence[type[Checker]]) -> list[Finding]:
    """The findings of the given checkers alone, in one pass (with the history they cite),
    without the rest of the postmortem or its replay: one question asked of many tapes."""
    tape = load_tape(source)
    ctx = Context(tape, tape.initial_state())
    checkers: list[Checker] = [HistoryChecker(ctx), *(kind(ctx) for kind in kinds)]
    _run(tape, ctx, checkers, None)
    for checker in checkers:
        checker.finish()
    return ctx.findings()


def _run(
    tape: Tape, ctx: Context, checkers: list[Checker], progress: Progress | None
) -> tuple[bool, Item | None]:
    """The pass itself: whether it read the tape to its end, and the last event it analysed."""
    before, after = _dispatch(checkers, "before"), _dispatch(checkers, "after")
    state = ctx.state
    seq = -1
    event: ev.Event | None = None
    next_progress = PROGRESS_EVERY
    try:
        for seq, event in tape.events():
            t = type(event)
            try:
                for hook in before[t]:
                    hook(seq, event)
                evolve(state, event)
                for hook in after[t]:
                    hook(seq, event)
            except FOLD_ERRORS as exc:
                if ctx.has_error_at(seq):
                    return False, None  # a checker named the cause (a frame after a sleep)
                # The event cannot follow the ones before it (a damaged or hand-edited tape):
                # the reducer refuses it, or it holds what no engine records (a token id the
                # oracle cannot place, a block the checkers cannot count).
                ctx.report(
                    "tape_inconsistent",
                    "error",
                    [],
                    event.step,
                    f"{event_refused(seq, event, exc)}; the {seq} events before it were analysed",
                    [(seq, event)],
                    None,
                    seq,
                )
                return False, None
            if progress is not None and seq >= next_progress:
                progress(seq + 1)
                next_progress += PROGRESS_EVERY
    except TapeFormatError:
        raise
    except TapeError as exc:
        where = exc.position if exc.position is not None else seq + 1
        ctx.report(
            "tape_damaged",
            "error",
            [],
            state.step,
            f"the tape cannot be read from event {where} on ({_reason(exc, ctx.tape.path)}); "
            f"the {where} events before it were analysed",
            [],
            None,
            where,
        )
        return False, None
    finally:
        if progress is not None:
            progress(seq + 1)
    return True, (seq, event) if event is not None else None


def _goes_on(tape: Tape) -> bool:
    """Whether a tape that ends with SegmentClosed is followed by its next segment: a segment
    file read alone is taken at its word; a directory read to its last segment, whose next
    one never opened (the engine killed as it changed segments), is not."""
    reader = tape.reader
    return not isinstance(reader, SegmentedTapeReader) or reader.continues


def _segmented_summary(tape: Tape) -> dict[str, object]:
    """The segment files a segmented tape's directory was read from, and the run's end as
    its manifest records it; nothing for a tape file."""
    reader = tape.reader
    if not isinstance(reader, SegmentedTapeReader):
        return {}
    ended = reader.manifest.get("ended")
    how = f"{ended.get('how')} (at {ended.get('at')})" if isinstance(ended, dict) else None
    return {"segments": [os.path.basename(s.path) for s in reader.segments], "ended": how}


def _check_end(ctx: Context, last: Item | None) -> None:
    """A tape read to its end that stops mid-run, without the EngineError a failing engine
    records: say where it ends and why (a killed engine or tape writer leaves exactly this)."""
    state = ctx.state
    if state.error is not None or state.recording_stopped is not None or last is None:
        return  # an engine_error or recording_stopped finding says why it ended
    if isinstance(last[1], ev.SegmentClosed) and _goes_on(ctx.tape):
        return  # a segment of a segmented tape: the run goes on in the next one
    unfinished = [r.req_id for r in state.unfinished]
    in_flight = [s.step for s in state.in_flight_steps]
    if not unfinished and not in_flight and not state.pending_output:
        return  # every request finished and was delivered: a complete run
    seq, event = last
    parts = [f"{len(unfinished)} request(s) unfinished" if unfinished else "every request finished"]
    if in_flight:
        parts.append(f"the frames of step(s) {', '.join(map(str, in_flight))} never recorded")
    if state.pending_output:
        parts.append(f"output of {len(state.pending_output)} request(s) never delivered")
    paused = f", generation paused ({state.paused})" if state.paused is not None else ""
    _check_phantom_placeholders(ctx, last)
    ctx.report(
        "tape_truncated",
        "warning",
        unfinished,
        max(state.step - 1, 0),
        f"the tape ends at event {seq} ({ev.kind_of(event)} of step {event.step}) after step "
        f"{state.step - 1} was scheduled, with {'; '.join(parts)}{paused}, and no EngineError: "
        "the recording stopped mid-run (the engine process or its tape writer was killed, or the "
        "engine was closed before its requests finished)",
        [last],
        None,
        seq,
        per_request=False,
    )


def _check_phantom_placeholders(ctx: Context, last: Item) -> None:
    """Running requests left with output placeholders but no step in flight when the tape
    ends: the placeholders stand for a token that never comes (a dropped fresh frame does not
    return its placeholder), and vLLM's async scheduler does not schedule a request whose
    placeholders already reach max_tokens, so such a request hangs one token short."""
    state = ctx.state
    for req_id in state.running:
        req = state.requests[req_id]
        if req.num_in_flight or req.num_output_placeholders <= 0:
            continue
        short = req.max_output_tokens - len(req.output_token_ids)
        hangs = 0 < short <= req.num_output_placeholders
        message = (
            f"request {req_id!r} is running at the end of the tape with nothing in flight "
            f"but {req.num_output_placeholders} output placeholder(s), for tokens that "
            "never come"
        )
        if hangs:
            message += (
                f"; {short} token(s) short of its limit, which the placeholders reach, so "
                "vLLM's async scheduler never schedules it again and it hangs"
            )
        ctx.report(
            "phantom_placeholders",
            "error" if hangs else "warning",
            [req_id],
            state.step,
            message,
            [last],
            ctx.bug_class_of(req_id),
            last[0],
        )


def _check_replay(
    tape: Tape, ctx: Context, stopped_at: int | None, progress: Progress | None
) -> None:
    """Run verify's consistency checks: a tape whose events are not what the scheduler decides
    from the ones before them (an edited entry, swapped or missing events, a header that
    contradicts itself) gets a finding, unless the pass already reported that very event or
    stopped before it."""
    done = ctx.state.num_events
    try:
        result = verify(tape, None if progress is None else (lambda n: progress(done + n)))
    except TapeError:
        return  # unreadable: the pass reported where (tape_damaged)
    d = result.first_divergence
    if result.ok or d is None:
        return
    if (stopped_at is not None and d.seq >= stopped_at) or ctx.has_error_at(d.seq):
        return  # the same cause, already a finding
    if d.in_header:
        message, step, excerpt = f"the tape does not replay: {d.summary()}", 0, []
    else:
        event = d.expected
        step = event.step if event is not None else ctx.state.step
        recorded = describe_event(event) if event is not None else "nothing"
        replayed = describe_event(d.actual) if d.actual is not None else "nothing"
        if result.statement is None:
            message = (
                f"the tape does not replay: at event {d.seq} the scheduler, re-run against the "
                f"recorded frames, {d.message.removeprefix('the replay ')} (recorded: {recorded}; "
                f"replayed: {replayed}); the tape was edited or damaged, or recorded by an engine "
                "that decides otherwise"
            )
        else:  # another engine's tape: its decisions are folded and checked, not re-run
            message = (
                f"the tape is not consistent: at event {d.seq} {d.message} (recorded: "
                f"{recorded}; derived: {replayed}); the tape was edited or damaged, or the "
                f"{tape.header.source} run it records broke the '{tape.header.discard_policy}' "
                "policy's rules"
            )
        excerpt = [*d.before[-2:], (d.seq, event)] if event is not None else d.before[-3:]
    names = list(
        dict.fromkeys(r for x in (d.expected, d.actual) if x is not None for r in event_requests(x))
    )
    ctx.report(
        "replay_diverged",
        "error",
        names[:16],
        step,
        " ".join(message.split()),
        list(excerpt),
        None,
        d.seq,
        per_request=False,
    )


def _reason(exc: TapeError, tape_path: str | None) -> str:
    """The error without the tape's path; a segment of a segmented tape read whole is named."""
    text = str(exc).removeprefix(f"{exc.path or '<memory tape>'}: ")
    if exc.position is not None:
        text = text.removesuffix(f" at event {exc.position}")
    segment = f"{os.path.basename(exc.path)}: " if exc.path and exc.path != tape_path else ""
    return segment + (" ".join(text.split()) or type(exc).__name__)
