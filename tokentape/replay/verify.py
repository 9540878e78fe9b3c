"""verify: re-run the scheduler against a tape's recorded frames and check every event.

Like Temporal's replayer: the recorded commands (adds, aborts, pauses, resumes, resets) are
issued again at the same points, a replay runner hands back the recorded frames instead of
running a model, and every event the engine emits must equal the next recorded one. The
first mismatch is reported with the recorded events around it.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokentape.engine.llm_engine import LLMEngine
from tokentape.engine.runners.base import ScheduledBatch
from tokentape.events import schema as ev
from tokentape.events.store import MemoryTape, TapeError
from tokentape.replay.tape import Tape, load_tape

_CONTEXT = 4


@dataclass(slots=True)
class Divergence:
    seq: int  # position on the recorded tape
    message: str
    expected: ev.Event | None
    actual: ev.Event | None
    before: list[tuple[int, ev.Event]] = field(default_factory=list)
    after: list[tuple[int, ev.Event]] = field(default_factory=list)

    def format(self) -> str:
        lines = [f"first divergence at event {self.seq}: {self.message}"]
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

    def __init__(self, events: Iterator[tuple[int, ev.Event]]) -> None:
        self._events = events
        self._next: tuple[int, ev.Event] | None = next(events, None)
        self.history: deque[tuple[int, ev.Event]] = deque(maxlen=_CONTEXT)
        self.consumed = 0

    def peek(self) -> tuple[int, ev.Event] | None:
        return self._next

    def take(self) -> tuple[int, ev.Event]:
        item = self._next
        assert item is not None
        self.history.append(item)
        self._next = next(self._events, None)
        self.consumed += 1
        return item

    def lookahead(self, n: int = _CONTEXT) -> list[tuple[int, ev.Event]]:
        out = [self._next] if self._next is not None else []
        while len(out) < n and (item := next(self._events, None)) is not None:
            out.append(item)
        return out

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


def verify(source: str | os.PathLike[str] | MemoryTape | Tape) -> VerifyResult:
    """Re-run the scheduler over the tape's frames; ok when every recorded event reproduces."""
    tape = load_tape(source)
    stream = _RecordedStream(tape.events())
    engine = LLMEngine(
        tape.config, _StreamReplayRunner(stream, tape.header), _CheckingTape(stream, tape.header)
    )
    try:
        while (nxt := stream.peek()) is not None:
            event = nxt[1]
            kind = ev.kind_of(event)
            if isinstance(event, ev.EngineError):
                stream.take()
                return VerifyResult(True, stream.consumed, None, f"{event.error_type}: {event.message}")
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
            stream.take()
            return VerifyResult(True, stream.consumed, None, f"{nxt[1].error_type}: {nxt[1].message}")
        return VerifyResult(False, stream.consumed, d.divergence)
    return VerifyResult(True, stream.consumed)
