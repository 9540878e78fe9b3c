"""What verify reports and how it reads a tape: the first divergence with the recorded events
around it, the result, the recorded stream with one event of look-ahead, and the header's own
consistency. Shared by verify (tokentape's scheduler re-run) and verify_recorded (a tape
recorded from another engine, vLLM: folded and checked)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tokentape.events import schema as ev
from tokentape.events.store import TapeError
from tokentape.replay.tape import Tape

CONTEXT = 4  # recorded events shown on each side of a divergence


@dataclass(slots=True)
class Divergence:
    seq: int  # position on the recorded tape (0 for the header)
    message: str
    expected: ev.Event | None
    actual: ev.Event | None
    before: list[tuple[int, ev.Event]] = field(default_factory=list)
    after: list[tuple[int, ev.Event]] = field(default_factory=list)
    in_header: bool = False  # the header contradicts itself: no event was replayed
    actual_label: str = (
        "replayed"  # what `actual` is: the replay's event, or the fold's ("derived")
    )

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
        lines.append(f"  > {'':>8}  {self.actual_label + ':':<9} {self.actual!r}")
        for seq, event in self.after:
            lines.append(f"    {seq:>8}  {event!r}")
        return "\n".join(lines)


@dataclass(slots=True)
class VerifyResult:
    ok: bool
    num_events: int  # recorded events reproduced (or, for another engine's tape, checked)
    first_divergence: Divergence | None = None
    ended_with_error: str | None = None  # the recorded run stopped on an EngineError
    # For a tape another engine recorded (header source, e.g. vllm): what verify checked,
    # since it cannot re-run that engine's scheduler. None for tokentape's own tapes.
    statement: str | None = None
    recording_stopped: str | None = None  # another engine's recorder stopped (RecordingStopped)

    def __bool__(self) -> bool:
        return self.ok


class Diverged(Exception):
    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence.message)
        self.divergence = divergence


class RecordedStream:
    """The recorded events with one event of look-ahead and a little history for context."""

    def __init__(
        self, events: Iterator[tuple[int, ev.Event]], progress: Callable[[int], None] | None = None
    ) -> None:
        self._events = events
        self._next: tuple[int, ev.Event] | None = next(events, None)
        self._ahead: deque[tuple[int, ev.Event]] = deque()  # read for context, not yet taken
        self.history: deque[tuple[int, ev.Event]] = deque(maxlen=CONTEXT)
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

    def lookahead(self, n: int = CONTEXT) -> list[tuple[int, ev.Event]]:
        ahead = self._ahead
        try:
            while len(ahead) < n - 1 and (item := next(self._events, None)) is not None:
                ahead.append(item)
        except TapeError:
            pass  # context only: the divergence comes before the damage
        out = [self._next] if self._next is not None else []
        return out + list(ahead)[: n - len(out)]

    def diverged(
        self, message: str, actual: ev.Event | None, actual_label: str = "replayed"
    ) -> Diverged:
        if self._next is None:
            seq, expected = (self.history[-1][0] + 1 if self.history else 0), None
            after: list[tuple[int, ev.Event]] = []
        else:
            seq, expected = self._next
            after = self.lookahead(CONTEXT + 1)[1:]
        return Diverged(
            Divergence(
                seq, message, expected, actual, list(self.history), after, actual_label=actual_label
            )
        )

    def ended_with_error(self, statement: str | None = None) -> VerifyResult:
        """The recorded run stopped on an EngineError or RecordingStopped (next on the
        stream): nothing is recorded after either, so it must be the last event."""
        _, last = self.take()
        assert isinstance(last, (ev.EngineError, ev.RecordingStopped))
        if self.peek() is not None:
            d = self.diverged(
                f"an event follows the {ev.kind_of(last)} that ended the recording", None
            )
            return VerifyResult(False, self.consumed, d.divergence, statement=statement)
        if isinstance(last, ev.RecordingStopped):
            return VerifyResult(
                True, self.consumed, statement=statement, recording_stopped=last.reason
            )
        return VerifyResult(
            True,
            self.consumed,
            ended_with_error=f"{last.error_type}: {last.message}",
            statement=statement,
        )


def header_divergence(tape: Tape) -> Divergence | None:
    """What the header says twice must agree: the discard policy and seed of the header and of
    its engine config (the fold reads the first, the replayed engine the second)."""
    h, c = tape.header, tape.config
    for name, said, configured in (
        ("discard policy", h.discard_policy, c.discard_policy),
        ("seed", h.seed, c.seed),
    ):
        if said != configured:
            return Divergence(
                0,
                f"its {name} is {said!r} but its engine config's is {configured!r}",
                None,
                None,
                in_header=True,
            )
    return None
