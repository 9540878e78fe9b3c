"""The debugger's breakpoint and watch commands (break, delete, watch, unwatch): a mixin of
`TapeDebugger` (tokentape.replay.debugger); the breakpoints themselves are in
tokentape.replay.breakpoints."""

from __future__ import annotations

import itertools

from tokentape.replay.breakpoints import (
    Breakpoint,
    DebuggerError,
    Watch,
    format_value,
    parse_breakpoint,
    parse_int,
)
from tokentape.replay.conditions import StateExpression
from tokentape.replay.cursor import TapeCursor
from tokentape.replay.render import Output


class BreakpointCommands:
    # TapeDebugger's:
    cursor: TapeCursor
    out: Output
    breakpoints: list[Breakpoint]
    watches: list[Watch]
    _numbers: itertools.count[int]
    _watch_numbers: itertools.count[int]

    def _report_hit(self, bp: Breakpoint) -> None:
        bp.hits += 1
        self.out.line(f"breakpoint {bp.number} hit: {bp.describe()}", style="bold yellow")

    def do_break(self, arg: str) -> None:
        """break [KIND | kind=KIND | req=ID | CONDITION]: set a breakpoint (no argument: list
        them). A CONDITION stops where it becomes true, e.g. break discard > 0,
        break req=r3 placeholders < 0, break paused == 'keep'. Names: help names."""
        if not arg.strip():
            if not self.breakpoints:
                self.out.line("no breakpoints")
            for bp in self.breakpoints:
                self.out.line(
                    f"{bp.number}: {bp.describe()} "
                    f"(hit {bp.hits} time{'s' if bp.hits != 1 else ''})"
                )
            return
        bp = parse_breakpoint(next(self._numbers), arg)
        if bp.req_id is not None and bp.req_id not in self.cursor.all_request_ids():
            raise DebuggerError(f"no request {bp.req_id!r} on this tape")
        self.breakpoints.append(bp)
        self.out.line(f"breakpoint {bp.number}: {bp.describe()}")

    do_b = do_break

    def do_delete(self, arg: str) -> None:
        """delete [N]: delete breakpoint N, or every breakpoint."""
        if not arg.strip():
            self.breakpoints.clear()
            self.out.line("deleted every breakpoint")
            return
        n = parse_int(arg, "a breakpoint number")
        if not any(bp.number == n for bp in self.breakpoints):
            raise DebuggerError(f"no breakpoint {n}")
        self.breakpoints = [bp for bp in self.breakpoints if bp.number != n]
        self.out.line(f"deleted breakpoint {n}")

    def do_watch(self, arg: str) -> None:
        """watch [EXPR]: show EXPR after every move (no argument: show the watches).
        e.g. watch discard, watch placeholders, watch running + waiting."""
        if arg.strip():
            self.watches.append(Watch(next(self._watch_numbers), StateExpression(arg)))
        if not self.watches:
            self.out.line("no watches")
        for w in self.watches:
            self._show_watch(w)

    def do_unwatch(self, arg: str) -> None:
        """unwatch [N]: remove watch N, or every watch."""
        if not arg.strip():
            self.watches.clear()
            return
        n = parse_int(arg, "a watch number")
        if not any(w.number == n for w in self.watches):
            raise DebuggerError(f"no watch {n}")
        self.watches = [w for w in self.watches if w.number != n]

    def _show_watch(self, w: Watch) -> None:
        value = w.expression.value(self.cursor.state)
        changed = w.last is not None and value != w.last
        w.last = value
        text = f"watch {w.number}: {w.expression.text} = {format_value(value)}"
        self.out.line(
            text + "  (changed)" if changed else text, style="magenta" if changed else None
        )
