"""verify: re-run the scheduler against a tape's recorded frames and check every event.

Like Temporal's replayer: the recorded commands (adds, aborts, pauses, resumes, resets) are
issued again at the same points, a replay runner hands back the recorded frames instead of
running a model, and every event the engine emits must equal the next recorded one. The
first mismatch is reported with the recorded events around it.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tokentape.engine.llm_engine import LLMEngine
from tokentape.engine.runners.base import ScheduledBatch
from tokentape.events import schema as ev
from tokentape.events.store import MemoryTape, TapeError
from tokentape.replay.tape import Tape, load_tape

_CONTEXT = 4


@dataclass(slots=True)
class Divergence:
    seq: int  # position on the recorded tape (0 for the header)
    message: str
    expected: ev.Event | None
    actual: ev.Event | None
    before: list[tuple[int, ev.Event]] = field(default_factory=list)
    after: list[tuple[int, ev.Event]] = field(default_factory=list)
    in_header: bool = False  # the header contradicts itself: no event was replayed

    def summary(self) -> str:
        """One line: where the tape stops reproducing and why."""
        if self.in_header:
            return f"the tape's header is inconsistent: {self.message}"
        return f"first divergence at event {self.seq}: {self.message}"

    def format(self) -> str:
        lines = [self.summary()]
        if self.in_header:
            return lines[0]
        for seq, event in self.before:
            lines.append(f"    {seq:>8}  {event!r}")
        lines.append(f"  > {self.seq:>8}  recorded: {self.expected!r}")
        lines.append(f"  > {'':>8}  replayed: {self.actual!r}")
        for seq, event in self.after:
            lines.append(f"    {seq:>8}  {event!r}")
        return "\n".join(lines)


@dataclass(slots=True)
class VerifyResult:
    ok: bool
    num_events: int  # recorded events reproduced
    first_divergence: Divergence | None = None
    ended_with_error: str | None = None  # the recorded run stopped on an EngineError

    def __bool__(self) -> bool:
        return self.ok


class _Diverged(Exception):
    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence.message)
        self.divergence = divergence


class _RecordedStream:
    """The recorded events with one event of look-ahead and a little history for context."""

    def __init__(self, events: Iterator[tuple[int, ev.Event]],
                 progress: Callable[[int], None] | None = None) -> None:
        self._events = events
        self._next: tuple[int, ev.Event] | None = next(events, None)
        self._ahead: deque[tuple[int, ev.Event]] = deque()  # read for context, not yet taken
        self.history: deque[tuple[int, ev.Event]] = deque(maxlen=_CONTEXT)
        self.consumed = 0
        self._progress = progress

    def peek(self) -> tuple[int, ev.Event] | None:
        return self._next

    def take(self) -> tuple[int, ev.Event]:
        item = self._next
        assert item is not None
        self.history.append(item)
        self._next = self._ahead.popleft() if self._ahead else next(self._events, None)
        self.consumed += 1
        if self._progress is not None and not self.consumed & 0xFFFF:
            self._progress(self.consumed)
        return item

    def lookahead(self, n: int = _CONTEXT) -> list[tuple[int, ev.Event]]:
        ahead = self._ahead
        try:
            while len(ahead) < n - 1 and (item := next(self._events, None)) is not None:
                ahead.append(item)
        except TapeError:
            pass  # context only: the divergence comes before the damage
        out = [self._next] if self._next is not None else []
        return out + list(ahead)[:n - len(out)]

    def diverged(self, message: str, actual: ev.Event | None) -> _Diverged:
        if self._next is None:
            seq, expected = (self.history[-1][0] + 1 if self.history else 0), None
            after: list[tuple[int, ev.Event]] = []
        else:
            seq, expected = self._next
            after = self.lookahead(_CONTEXT + 1)[1:]
        return _Diverged(Divergence(seq, message, expected, actual, list(self.history), after))


class _CheckingTape:
    """A tape writer that compares every appended event with the recording."""

    path = None

    def __init__(self, stream: _RecordedStream, header: ev.TapeHeader) -> None:
        self.stream = stream
        self.header = header

    def append(self, event: ev.Event) -> None:
        nxt = self.stream.peek()
        if nxt is None:
            raise self.stream.diverged("the replay emitted an event past the end of the tape", event)
        if nxt[1] != event:
            raise self.stream.diverged(f"the replay emitted a different {ev.kind_of(event)}", event)
        self.stream.take()

    def commit(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _StreamReplayRunner:
    """Hands back the frame the recording holds next; the engine then re-emits it."""

    def __init__(self, stream: _RecordedStream, header: ev.TapeHeader) -> None:
        self.stream = stream
        self.model_id = header.model_id
        self.eos_token_id = header.eos_token_id
        # Other EOS ids are already in each recorded request's stop_token_ids.
        self.extra_eos_token_ids: tuple[int, ...] = ()
        self.vocab_size = header.vocab_size

    def submit(self, batch: ScheduledBatch) -> None:
        pass

    def collect(self, step: int) -> list[ev.FrameEntry]:
        nxt = self.stream.peek()
        if nxt is None or not isinstance(nxt[1], ev.FrameProduced) or nxt[1].step != step:
            raise self.stream.diverged(f"the replay applies the frame of step {step} here", None)
        return nxt[1].entries

    def update_weights(self, weights_id: str) -> str:
        return weights_id  # no weights here: the recorded content hash stands for them

    def close(self) -> None:
        pass


def issue_command(engine: LLMEngine, event: ev.Event) -> None:
    """Make the client call that a recorded command event stands for."""
    match event:
        case ev.RequestAdded(req_id=req_id, prompt_token_ids=prompt, params=params):
            engine.add_request(req_id, prompt, params)
        case ev.RequestAborted(req_id=req_id):
            engine.abort_request(req_id)
        case ev.GenerationPaused(mode=mode, clear_cache=clear_cache):
            engine.pause_generation(mode, clear_cache)
        case ev.GenerationResumed():
            engine.resume_generation()
        case ev.PrefixCacheReset(reset_running_requests=reset_running):
            engine.reset_prefix_cache(reset_running)
        case ev.WeightsUpdated(weights_id=weights_id):
            engine.update_weights(weights_id)
        case _:
            raise TypeError(f"cannot replay command {ev.kind_of(event)}")


class TapeInconsistentError(ValueError):
    """A tape that fails verify's consistency checks, given to a reader that needs a consistent
    one (diff): it would draw conclusions from events that cannot follow each other."""


def check_consistent(source: str | os.PathLike[str] | MemoryTape | Tape,
                     progress: Callable[[int], None] | None = None) -> Tape:
    """The tape, once `verify` passes on it; TapeInconsistentError naming where it fails."""
    tape = load_tape(source)
    result = verify(tape, progress)
    if not result.ok:
        where = result.first_divergence.summary() if result.first_divergence else "it does not replay"
        raise TapeInconsistentError(
            f"{tape.path or '<memory tape>'} is not internally consistent ({where}); "
            "'tokentape replay verify' shows the events around it")
    return tape


def header_divergence(tape: Tape) -> Divergence | None:
    """What the header says twice must agree: the discard policy and seed of the header and of
    its engine config (the fold reads the first, the replayed engine the second)."""
    h, c = tape.header, tape.config
    for name, said, configured in (("discard policy", h.discard_policy, c.discard_policy),
                                   ("seed", h.seed, c.seed)):
        if said != configured:
            return Divergence(0, f"its {name} is {said!r} but its engine config's is {configured!r}",
                              None, None, in_header=True)
    return None


def verify(source: str | os.PathLike[str] | MemoryTape | Tape,
           progress: Callable[[int], None] | None = None) -> VerifyResult:
    """Re-run the scheduler over the tape's frames; ok when every recorded event reproduces.
    These are the tape's consistency checks: `diff` and `postmortem` run them too. A tape that
    cannot be read raises TapeError. `progress`, if given, is called with the number of events
    checked, every 65536 events."""
    tape = load_tape(source)
    bad_header = header_divergence(tape)
    if bad_header is not None:
        return VerifyResult(False, 0, bad_header)
    stream = _RecordedStream(tape.events(), progress)
    engine = LLMEngine(
        tape.config, _StreamReplayRunner(stream, tape.header), _CheckingTape(stream, tape.header)
    )
    try:
        while (nxt := stream.peek()) is not None:
            event = nxt[1]
            kind = ev.kind_of(event)
            if isinstance(event, ev.EngineError):
                return _ended_with_error(stream)
            before = stream.consumed
            try:
                if kind in ev.COMMAND_KINDS:
                    issue_command(engine, event)
                else:
                    engine.step()
            except _Diverged:
                raise
            except TapeError:
                raise
            except Exception as exc:
                raise stream.diverged(f"the replay raised {type(exc).__name__}: {exc}", None) from exc
            if stream.consumed == before:
                raise stream.diverged("the replay emitted nothing where the tape has an event", None)
    except _Diverged as d:
        nxt = stream.peek()
        if nxt is not None and isinstance(nxt[1], ev.EngineError):
            # The recorded run failed at this point (inside a step: a runner failure the
            # replay runner cannot repeat); everything before it reproduced.
            return _ended_with_error(stream)
        return VerifyResult(False, stream.consumed, d.divergence)
    return VerifyResult(True, stream.consumed)


def _ended_with_error(stream: _RecordedStream) -> VerifyResult:
    """The recorded run stopped on an EngineError (next on the stream): a failed engine records
    nothing more, so it must be the last event."""
    _, error = stream.take()
    assert isinstance(error, ev.EngineError)
    if stream.peek() is not None:
        d = stream.diverged("an event follows the EngineError that ended the recorded run", None)
        return VerifyResult(False, stream.consumed, d.divergence)
    return VerifyResult(True, stream.consumed, None, f"{error.error_type}: {error.message}")
