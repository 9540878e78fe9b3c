"""The debugger's breakpoints and watches: parsing them, and checking breakpoints as events
are folded (a condition fires where it becomes true, not while it stays true).

- `break KIND` or `break kind=KIND`: at every event of that kind;
- `break req=ID`: at every event that names the request;
- `break EXPR`: where a condition over the derived state becomes true (it was false before
  the event, for some request): `break discard > 0`, `break req=r3 placeholders < 0`,
  `break paused == 'keep'`. See `tokentape.replay.conditions` for the names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokentape.events import schema as ev
from tokentape.events.state import EngineState
from tokentape.replay.conditions import StateExpression
from tokentape.replay.render import event_requests

KINDS = sorted(ev.EVENT_KINDS)
_KINDS_LOWER = {k.lower(): k for k in KINDS}


class DebuggerError(Exception):
    """A command that cannot be carried out; printed as one line, the debugger stays open."""


def parse_kind(text: str) -> str:
    kind = _KINDS_LOWER.get(text.lower())
    if kind is None:
        raise DebuggerError(f"unknown event kind {text!r} (kinds: {', '.join(KINDS)})")
    return kind


def parse_int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise DebuggerError(f"expected {what}, got {text.strip()!r}") from None


def format_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v!r}" for k, v in value.items()) + "}"
    return repr(value)


@dataclass(slots=True)
class Breakpoint:
    number: int
    kind: str | None = None
    req_id: str | None = None
    condition: StateExpression | None = None
    hits: int = 0

    def describe(self) -> str:
        parts = []
        if self.kind:
            parts.append(f"kind={self.kind}")
        if self.req_id is not None:
            parts.append(f"req={self.req_id}")
        if self.condition is not None:
            parts.append(f"when {self.condition.text} becomes true")
        return " ".join(parts)


def parse_breakpoint(number: int, arg: str) -> Breakpoint:
    bp = Breakpoint(number)
    rest = arg.strip()
    while rest:
        head, _, tail = rest.partition(" ")
        if head.startswith("kind="):
            bp.kind = parse_kind(head[5:])
        elif head.startswith("req="):
            if not head[4:]:
                raise DebuggerError("req= needs a request id")
            bp.req_id = head[4:]
        elif head.lower() in _KINDS_LOWER and not tail:
            bp.kind = _KINDS_LOWER[head.lower()]
        else:
            bp.condition = StateExpression(rest)
            break
        rest = tail.strip()
    if bp.kind is None and bp.req_id is None and bp.condition is None:
        raise DebuggerError("break needs an event kind, req=ID or a condition")
    return bp


class Scanner:
    """Checks the breakpoints after each event; conditions fire when they become true."""

    def __init__(self, breakpoints: list[Breakpoint], state: EngineState) -> None:
        self.breakpoints = breakpoints
        self.holding: dict[int, set[str]] = {}
        for bp in breakpoints:
            if bp.condition is not None:
                self.holding[bp.number] = bp.condition.holds_for(state, self._scope(bp, None))

    @staticmethod
    def _scope(bp: Breakpoint, named: list[str] | None) -> list[str] | None:
        if bp.req_id is not None:
            return [bp.req_id] if named is None or bp.req_id in named else []
        return named

    def check(self, event: ev.Event, state: EngineState) -> Breakpoint | None:
        kind = ev.kind_of(event)
        named = event_requests(event)
        hit: Breakpoint | None = None
        for bp in self.breakpoints:
            if bp.condition is None:
                if (bp.kind is None or bp.kind == kind) and (
                    bp.req_id is None or bp.req_id in named
                ):
                    hit = hit or bp
                continue
            # Re-evaluate for the requests the event names; for all at an engine-wide event.
            ids = self._scope(bp, named or None)
            now = bp.condition.holds_for(state, ids)
            before = self.holding[bp.number]
            became = now - before
            if ids is None or not bp.condition.per_request:
                self.holding[bp.number] = now
            else:
                self.holding[bp.number] = (before - set(ids)) | now
            if became and (bp.kind is None or bp.kind == kind):
                hit = hit or bp
        return hit


@dataclass(slots=True)
class Watch:
    number: int
    expression: StateExpression
    last: Any = field(default=None)
