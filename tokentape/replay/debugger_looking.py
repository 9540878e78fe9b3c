"""The debugger's commands that look without moving (where, print, requests, events, diff,
names) and its tab completion: a mixin of `TapeDebugger` (tokentape.replay.debugger)."""

from __future__ import annotations

from collections.abc import Callable

from tokentape.replay import conditions
from tokentape.replay.breakpoints import KINDS, DebuggerError, format_value, parse_int
from tokentape.replay.conditions import ALL_NAMES, StateExpression
from tokentape.replay.cursor import TapeCursor
from tokentape.replay.render import REQUEST_COLUMNS, Output, describe_event, request_row, state_view
from tokentape.replay.summaries import request_detail, state_changes

_CONTEXT = 5  # events shown either side of the current one


class LookingCommands:
    # TapeDebugger's:
    cursor: TapeCursor
    out: Output
    _show_position: Callable[[], None]

    def do_where(self, arg: str) -> None:
        """where: the current event and a summary of the engine state. Alias: w."""
        self._show_position()
        s = self.cursor.state
        in_flight = [x.step for x in s.in_flight_steps]
        self.out.line(
            f"  steps scheduled {s.step}, paused {s.paused or 'no'}, waiting {len(s.waiting)}, "
            f"running {len(s.running)}, in flight {in_flight}, prefix cache resets "
            f"{s.num_prefix_cache_resets}, requests {len(s.requests)} "
            f"({sum(r.is_finished for r in s.requests.values())} finished)"
        )

    do_w = do_where

    def do_print(self, arg: str) -> None:
        """print req ID: the derived state of one request. print EXPR: the value of an
        expression over the state (per request when it names a request field). Alias: p."""
        words = arg.split(maxsplit=1)
        if not words:
            raise DebuggerError("print req ID, or print EXPR")
        if words[0] in ("req", "request") and len(words) == 2 and words[1].strip() not in ALL_NAMES:
            self._print_request(words[1].strip())
            return
        self.out.line(format_value(StateExpression(arg).value(self.cursor.state)))

    do_p = do_print

    def _print_request(self, req_id: str) -> None:
        state = self.cursor.state
        req = state.requests.get(req_id)
        if req is None:
            known = list(state.requests)
            later = req_id in self.cursor.all_request_ids()
            raise DebuggerError(
                f"no request {req_id!r} "
                + ("yet at this point of the tape" if later else "on this tape")
                + f" ({len(known)} request{'' if len(known) == 1 else 's'} here"
                + f"{': ' + ', '.join(known[:10]) if known else ''})"
            )
        detail = request_detail(state, req)
        width = max(map(len, detail))
        self.out.line(f"request {req_id}", style="bold")
        for key, value in detail.items():
            self.out.line(f"  {key:<{width}}  {value}")

    def do_requests(self, arg: str) -> None:
        """requests: a table of every request's derived state."""
        state = self.cursor.state
        rows = [request_row(state, r) for r in state.requests.values()]
        if not rows:
            self.out.line("no requests yet")
            return
        # The same table as `tokentape inspect`: fits 80 columns on a terminal.
        state_view(self.out.stream, self.out.rich).table(
            f"requests ({len(rows)})", REQUEST_COLUMNS, rows
        )

    def do_events(self, arg: str) -> None:
        """events [A-B | A | step=S]: list events by sequence number (default: around the
        current one; A alone: ten from A; step=S: the events of engine step S)."""
        cursor = self.cursor
        arg = arg.strip()
        if not arg:
            first = max(0, cursor.pos - 1 - _CONTEXT)
            last = min(cursor.num_events, cursor.pos + _CONTEXT)
        elif arg.startswith("step="):
            first, last = self._events_of_step(parse_int(arg[5:], "a step number"))
        else:
            a, sep, b = arg.replace(":", "-").partition("-")
            first = parse_int(a, "a sequence number")
            last = parse_int(b, "a sequence number") + 1 if sep else first + 10
            if first < 0 or first >= cursor.num_events:
                raise DebuggerError(cursor.event_out_of_range(first))
            if last <= first:
                raise DebuggerError(f"empty range {arg!r}")
            last = min(last, cursor.num_events)
        for seq, event in cursor.tape.events(first):
            if seq >= last:
                break
            mark = "->" if seq == cursor.pos - 1 else "  "
            self.out.line(
                f"{mark} {seq:>7}  {describe_event(event)}", style="bold" if mark == "->" else None
            )

    def _events_of_step(self, step: int) -> tuple[int, int]:
        seq = self.cursor.seq_of_step(step)
        if seq is None:
            raise DebuggerError(self.cursor.step_out_of_range(step))
        nxt = self.cursor.seq_of_step(step + 1)
        return seq, self.cursor.num_events if nxt is None else nxt

    def do_diff(self, arg: str) -> None:
        """diff: what the current event changed in the derived state."""
        current = self.cursor.current_event()
        if current is None:
            raise DebuggerError("at the start of the tape: no event applied yet")
        seq, event = current
        before = self.cursor.tape.state_at(self.cursor.pos - 1)
        self.out.line(f"event {seq}: {describe_event(event)}", style="bold")
        changes = state_changes(before, self.cursor.state)
        if not changes:
            self.out.line("  no change to the derived state")
        for line in changes:
            self.out.line(f"  {line}", style="green" if line.startswith("+") else None)

    def do_names(self, arg: str) -> None:
        """names: the names conditions, watches and print may use."""
        self.out.line("request-level: " + ", ".join(conditions.REQUEST_NAMES))
        self.out.line("engine-level:  " + ", ".join(conditions.ENGINE_NAMES))

    def help_names(self) -> None:
        self.do_names("")

    # -- completion ----------------------------------------------------------------------------

    def complete_next(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        return [k for k in KINDS if k.lower().startswith(text.lower())]

    def complete_break(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        if text.startswith("kind="):
            return ["kind=" + k for k in KINDS if k.lower().startswith(text[5:].lower())]
        if text.startswith("req="):
            return ["req=" + r for r in self.cursor.state.requests if r.startswith(text[4:])]
        options = ["kind=", "req=", *KINDS, *ALL_NAMES]
        return [o for o in options if o.startswith(text)]

    def complete_print(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        words = line.split()
        if len(words) >= 2 and words[1] in ("req", "request") and (len(words) > 2 or not text):
            return [r for r in self.cursor.state.requests if r.startswith(text)]
        return [o for o in ("req", *ALL_NAMES) if o.startswith(text)]

    complete_p = complete_print
    complete_watch = complete_print

    def complete_goto(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        return [o for o in ("start", "end", "@") if o.startswith(text)]
