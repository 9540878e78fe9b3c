"""`tokentape debug TAPE`: step through a recorded run, forwards and backwards, in pdb's style.

The debugger's position is a place on the tape: after the first `pos` events, so the
*current event* is the one at sequence number `pos - 1` and the state shown is the state just
after it. Moving forwards folds events into the state; moving backwards (and any jump) goes
through the tape's periodic snapshots, so it costs at most one snapshot interval of events.

It reads commands from a terminal (with tab completion) or, scripted, from any stream:

    printf 'break kind=PrefixCacheReset\\ncontinue\\nrequests\\n' | tokentape debug run.tape

Breakpoints stop `continue` (forwards) and `reverse-continue` (backwards):
- `break KIND` or `break kind=KIND`: at every event of that kind;
- `break req=ID`: at every event that names the request;
- `break EXPR`: where a condition over the derived state becomes true (it was false before
  the event, for some request): `break discard > 0`, `break req=r3 placeholders < 0`,
  `break paused == 'keep'`. See `tokentape.replay.conditions` for the names.
"""

from __future__ import annotations

import cmd
import itertools
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from tokentape.events import schema as ev
from tokentape.events.errors import FOLD_ERRORS, ReducerError, event_refused
from tokentape.events.reducer import evolve
from tokentape.events.state import EngineState
from tokentape.events.store import TapeError
from tokentape.replay.conditions import ALL_NAMES, ExpressionError, StateExpression
from tokentape.replay.render import Output, describe_event, event_requests, is_terminal, progress
from tokentape.replay.tape import Tape

KINDS = sorted(ev.EVENT_KINDS)
_HELP_GROUPS = {
    "moving": ("step", "back", "goto", "next", "continue", "reverse-continue"),
    "breakpoints and watches": ("break", "delete", "watch", "unwatch"),
    "looking": ("where", "print", "requests", "events", "diff", "names"),
    "other": ("help", "quit"),
}
_SENTENCE_END = re.compile(r"[.]\s+(?=[A-Z])")  # not inside "e.g. next"
_ALIASES = "s = step, c = continue, rc = reverse-continue, b = break, p = print, w = where, q = quit"
_KINDS_LOWER = {k.lower(): k for k in KINDS}
_CONTEXT = 5  # events shown either side of the current one


class DebuggerError(Exception):
    """A command that cannot be carried out; printed as one line, the debugger stays open."""


def parse_kind(text: str) -> str:
    kind = _KINDS_LOWER.get(text.lower())
    if kind is None:
        raise DebuggerError(f"unknown event kind {text!r} (kinds: {', '.join(KINDS)})")
    return kind


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


class _Scanner:
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
                if (bp.kind is None or bp.kind == kind) and (bp.req_id is None or bp.req_id in named):
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
class _Watch:
    number: int
    expression: StateExpression
    last: Any = field(default=None)


class TapeDebugger(cmd.Cmd):
    """The debugger over one tape. `run()` reads commands until `quit` or end of input."""

    doc_header = "commands (help COMMAND for more)"

    def __init__(self, tape: Tape, stdin: TextIO | None = None, stdout: TextIO | None = None,
                 rich: bool | None = None) -> None:
        stdin = stdin if stdin is not None else sys.stdin
        stdout = stdout if stdout is not None else sys.stdout
        super().__init__(stdin=stdin, stdout=stdout)
        self.tape = tape
        self.out = Output(stdout, rich)
        self.interactive = is_terminal(stdin) and is_terminal(stdout)
        self.use_rawinput = self.interactive
        self.prompt = "(tokentape) " if self.interactive else ""
        self.num_events = len(tape)
        self.errors: list[str] = []  # of the commands that failed: a scripted session fails too
        self.pos = 0
        self._last_applied: tuple[int, ev.Event] | None = None
        self.state = tape.state_at(0)
        self.breakpoints: list[Breakpoint] = []
        self.watches: list[_Watch] = []
        self._numbers = itertools.count(1)
        self._watch_numbers = itertools.count(1)
        self.intro = (
            f"tokentape debugger: {tape.path or '<memory tape>'}, {self.num_events} events, "
            f"discard policy {tape.header.discard_policy}. Type help for the commands."
        )

    # -- plumbing ----------------------------------------------------------------------------------

    def run(self) -> None:
        self.out.line(str(self.intro))
        self.intro = None  # type: ignore[assignment]
        while True:
            try:
                self.cmdloop()
                return
            except KeyboardInterrupt:  # at the prompt: stay open, as pdb does
                self.out.line("\n(interrupted; quit leaves the debugger)")

    def precmd(self, line: str) -> str:
        if not self.interactive and line.strip() and line.strip() != "EOF":
            self.out.line(f"(tokentape) {line.rstrip()}", style="dim")
        stripped = line.lstrip()
        if stripped.startswith("reverse-continue"):
            return "reverse_continue" + stripped[len("reverse-continue"):]
        return line

    def onecmd(self, line: str) -> bool:
        try:
            return super().onecmd(line)
        except ReducerError as exc:  # a damaged tape: the debugger works up to the damage
            self._error(str(exc))
            self._after_damage()
            return False
        except (DebuggerError, ExpressionError, TapeError, ValueError, IndexError) as exc:
            self._error(str(exc))
            return False
        except KeyboardInterrupt:  # a long continue or next: stop where it got to
            self.out.line("interrupted")
            self._show_position()
            return False

    def _error(self, message: str) -> None:
        """Print a command's error; the session then ends with exit status 2."""
        self.errors.append(" ".join(message.split()))
        self.out.error(message)

    def emptyline(self) -> bool:
        return super().emptyline() if self.interactive else False

    def default(self, line: str) -> None:
        raise DebuggerError(f"unknown command {line.split()[0]!r} (type help for the commands)")

    def _after_damage(self) -> None:
        """Keep to the part of the tape the index could fold, with a clean state."""
        index = self.tape.snapshots
        if index.error is None:
            try:
                self._index_to(self.num_events)  # to find where the damage starts
            except ReducerError:
                pass  # index.error says where
        self.num_events = min(self.num_events, index.num_events)
        self.pos = min(self.pos, self.num_events)
        self.state = self.tape.state_at(self.pos)
        self._show_position()

    def do_help(self, arg: str) -> None:
        """help [COMMAND]: the commands, or what one does."""
        if arg.strip():
            super().do_help(arg.strip().replace("-", "_"))
            return
        for group, names in _HELP_GROUPS.items():
            self.out.line(f"{group}:", style="bold")
            for name in names:
                doc = " ".join((getattr(self, "do_" + name.replace("-", "_")).__doc__ or "").split())
                first_sentence = _SENTENCE_END.split(doc)[0].rstrip(".")
                self.out.line(f"  {first_sentence}")
        self.out.line(f"aliases: {_ALIASES}")
        self.out.line("help COMMAND says more; names lists what conditions, watch and print can use.")

    def do_EOF(self, arg: str) -> bool:
        """End of input: leave the debugger."""
        if self.interactive:
            self.out.line()
        return True

    def do_quit(self, arg: str) -> bool:
        """quit: leave the debugger (also q, exit, or end of input)."""
        return True

    do_q = do_exit = do_quit

    # -- moving ------------------------------------------------------------------------------------

    def _index_to(self, pos: int) -> None:
        """Run the snapshot index's pass up to `pos`, with a progress bar when it is long."""
        index = self.tape.snapshots
        with progress(pos - index.indexed_to, "indexing the tape") as update:
            start = index.indexed_to
            index.extend_to(pos, lambda done: update(done - start))

    def _event_out_of_range(self, seq: int) -> str:
        return f"event {seq} is out of range: the tape has events 0..{self.num_events - 1}"

    def _step_out_of_range(self, step: int) -> str:
        self._index_to(self.num_events)  # the last step is known once the whole tape is indexed
        last = len(self.tape.snapshots.step_seqs) - 1
        return f"step {step} is out of range: the tape schedules steps 0..{last}"

    def _seq_of_step(self, step: int) -> int | None:
        """The position of StepScheduled(step), indexing on (with a progress bar) to find it."""
        index = self.tape.snapshots
        start = index.indexed_to
        with progress(self.num_events - start, "indexing the tape") as update:
            return index.seq_of_step(step, lambda done: update(done - start))

    def _seek(self, pos: int) -> None:
        if not 0 <= pos <= self.num_events:
            raise DebuggerError(f"position {pos} is outside the tape (0..{self.num_events})")
        self._index_to(pos)
        self.state = self.tape.state_at(pos)
        self.pos = pos

    def _run_forward(self, stop: Callable[[int, ev.Event, EngineState], str | None],
                     limit: int | None = None) -> str | None:
        """Fold events forwards until `stop` returns a reason (after applying the event), or
        `limit` events, or the end of the tape."""
        remaining = self.num_events - self.pos
        todo = remaining if limit is None else min(limit, remaining)
        if todo <= 0:
            return None
        state = self.state
        with progress(todo, "reading the tape") as update:
            for n, (seq, event) in enumerate(self.tape.events(self.pos), 1):
                try:
                    evolve(state, event)
                except FOLD_ERRORS as exc:
                    raise event_refused(seq, event, exc) from None
                self.pos = seq + 1
                self._last_applied = (seq, event)
                reason = stop(seq, event, state)
                if reason is not None:
                    return reason
                if n >= todo:
                    break
                if not n & 0xFFFF:
                    update(n)
        return None

    def _parse_count(self, arg: str) -> int:
        arg = arg.strip()
        if not arg:
            return 1
        try:
            n = int(arg)
        except ValueError:
            raise DebuggerError(f"expected a number of events, got {arg!r}") from None
        if n < 1:
            raise DebuggerError(f"expected a positive number of events, got {n}")
        return n

    def do_step(self, arg: str) -> None:
        """step [N]: apply the next N events (default 1). Alias: s."""
        n = self._parse_count(arg)
        if self.pos >= self.num_events:
            raise DebuggerError(f"at the end of the tape ({self.num_events} events)")
        self._run_forward(lambda *_: None, limit=n)
        self._show_position()

    def do_back(self, arg: str) -> None:
        """back [N]: go back N events (default 1), through the snapshots."""
        n = self._parse_count(arg)
        if self.pos == 0:
            raise DebuggerError("at the start of the tape")
        self._seek(max(0, self.pos - n))
        self._show_position()

    def do_goto(self, arg: str) -> None:
        """goto STEP | goto @SEQ | goto start | goto end: jump to the event that schedules engine
        step STEP, to the event with sequence number SEQ, or to either end of the tape."""
        arg = arg.strip()
        if arg == "start":
            self._seek(0)
        elif arg == "end":
            self._seek(self.num_events)
        elif arg.startswith(("@", "#")):
            seq = _int(arg[1:], "a sequence number")
            if not 0 <= seq < self.num_events:
                raise DebuggerError(self._event_out_of_range(seq))
            self._seek(seq + 1)
        else:
            step = _int(arg, "a step number, @SEQ, start or end")
            step_seq = self._seq_of_step(step)
            if step_seq is None:
                raise DebuggerError(self._step_out_of_range(step))
            self._seek(step_seq + 1)
        self._show_position()

    def do_next(self, arg: str) -> None:
        """next KIND: go forwards to the next event of that kind (e.g. next FrameProduced)."""
        if not arg.strip():
            raise DebuggerError("next needs an event kind: " + ", ".join(KINDS))
        kind = parse_kind(arg.strip())
        reason = self._run_forward(lambda seq, e, s: kind if ev.kind_of(e) == kind else None)
        if reason is None:
            self.out.line(f"no {kind} after this point; at the end of the tape")
        self._show_position()

    def do_continue(self, arg: str) -> None:
        """continue: go forwards until a breakpoint is hit or the tape ends. Alias: c."""
        if self.pos >= self.num_events:
            raise DebuggerError(f"at the end of the tape ({self.num_events} events)")
        scanner = _Scanner(self.breakpoints, self.state)
        hit: list[Breakpoint] = []

        def stop(seq: int, event: ev.Event, state: EngineState) -> str | None:
            bp = scanner.check(event, state)
            if bp is not None:
                hit.append(bp)
                return "hit"
            return None

        if self._run_forward(stop) is None:
            self.out.line("reached the end of the tape")
        else:
            self._report_hit(hit[0])
        self._show_position()

    def do_reverse_continue(self, arg: str) -> None:
        """reverse-continue: go backwards to the latest earlier place where a breakpoint is
        hit, or to the start of the tape. Alias: rc."""
        if self.pos == 0:
            raise DebuggerError("at the start of the tape")
        index = self.tape.snapshots
        end = self.pos - 1  # hits must be at positions before the current one
        positions = index.positions
        i = max(j for j, p in enumerate(positions) if p <= end)
        while i >= 0:
            start = positions[i]
            found = self._last_hit_between(start, end)
            if found is not None:
                pos, bp = found
                self._seek(pos)
                self._report_hit(bp)
                self._show_position()
                return
            end, i = start, i - 1
        self._seek(0)
        self.out.line("reached the start of the tape")
        self._show_position()

    def _last_hit_between(self, start: int, end: int) -> tuple[int, Breakpoint] | None:
        """The last position in (start, end] where a breakpoint is hit, folding from `start`."""
        if end <= start:
            return None
        state = self.tape.state_at(start)
        scanner = _Scanner(self.breakpoints, state)
        last = None
        for seq, event in self.tape.events(start):
            if seq >= end:
                break
            try:
                evolve(state, event)
            except FOLD_ERRORS as exc:
                raise event_refused(seq, event, exc) from None
            bp = scanner.check(event, state)
            if bp is not None:
                last = (seq + 1, bp)
        return last

    do_s, do_c, do_rc = do_step, do_continue, do_reverse_continue

    def _report_hit(self, bp: Breakpoint) -> None:
        bp.hits += 1
        self.out.line(f"breakpoint {bp.number} hit: {bp.describe()}", style="bold yellow")

    # -- breakpoints and watches ---------------------------------------------------------------

    def do_break(self, arg: str) -> None:
        """break [KIND | kind=KIND | req=ID | CONDITION]: set a breakpoint (no argument: list
        them). A CONDITION stops where it becomes true, e.g. break discard > 0,
        break req=r3 placeholders < 0, break paused == 'keep'. Names: help names."""
        if not arg.strip():
            if not self.breakpoints:
                self.out.line("no breakpoints")
            for bp in self.breakpoints:
                self.out.line(f"{bp.number}: {bp.describe()} (hit {bp.hits} times)")
            return
        bp = parse_breakpoint(next(self._numbers), arg)
        if bp.req_id is not None and bp.req_id not in self._all_request_ids():
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
        n = _int(arg, "a breakpoint number")
        if not any(bp.number == n for bp in self.breakpoints):
            raise DebuggerError(f"no breakpoint {n}")
        self.breakpoints = [bp for bp in self.breakpoints if bp.number != n]
        self.out.line(f"deleted breakpoint {n}")

    def do_watch(self, arg: str) -> None:
        """watch [EXPR]: show EXPR after every move (no argument: show the watches).
        e.g. watch discard, watch placeholders, watch running + waiting."""
        if arg.strip():
            w = _Watch(next(self._watch_numbers), StateExpression(arg))
            self.watches.append(w)
        if not self.watches:
            self.out.line("no watches")
        for w in self.watches:
            self._show_watch(w)

    def do_unwatch(self, arg: str) -> None:
        """unwatch [N]: remove watch N, or every watch."""
        if not arg.strip():
            self.watches.clear()
            return
        n = _int(arg, "a watch number")
        if not any(w.number == n for w in self.watches):
            raise DebuggerError(f"no watch {n}")
        self.watches = [w for w in self.watches if w.number != n]

    def _show_watch(self, w: _Watch) -> None:
        value = w.expression.value(self.state)
        changed = w.last is not None and value != w.last
        w.last = value
        shown = _format_value(value)
        text = f"watch {w.number}: {w.expression.text} = {shown}"
        self.out.line(text + "  (changed)" if changed else text, style="magenta" if changed else None)

    # -- looking -------------------------------------------------------------------------------

    def _current_event(self) -> tuple[int, ev.Event] | None:
        if self.pos == 0:
            return None
        last = self._last_applied  # the event a forward move just applied: no second read
        if last is not None and last[0] == self.pos - 1:
            return last
        return next(self.tape.events(self.pos - 1), None)

    def _show_position(self) -> None:
        current = self._current_event()
        where = f"[{self.pos}/{self.num_events}]"
        if current is None:
            self.out.line(f"{where}  at the start of the tape (no event applied)", style="bold cyan")
        else:
            seq, event = current
            self.out.line(f"{where}  event {seq}: {describe_event(event)}", style="bold cyan")
        for w in self.watches:
            self._show_watch(w)

    def do_where(self, arg: str) -> None:
        """where: the current event and a summary of the engine state. Alias: w."""
        self._show_position()
        s = self.state
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
        self.out.line(_format_value(StateExpression(arg).value(self.state)))

    do_p = do_print

    def _print_request(self, req_id: str) -> None:
        from tokentape.cli import _request_detail

        req = self.state.requests.get(req_id)
        if req is None:
            known = list(self.state.requests)
            later = req_id in self._all_request_ids()
            raise DebuggerError(
                f"no request {req_id!r} "
                + ("yet at this point of the tape" if later else "on this tape")
                + f" ({len(known)} requests here{': ' + ', '.join(known[:10]) if known else ''})"
            )
        detail = _request_detail(self.state, req)
        width = max(map(len, detail))
        self.out.line(f"request {req_id}", style="bold")
        for key, value in detail.items():
            self.out.line(f"  {key:<{width}}  {value}")

    def do_requests(self, arg: str) -> None:
        """requests: a table of every request's derived state."""
        from tokentape.cli import _REQUEST_COLUMNS, _PlainView, _request_row, _RichView

        rows = [_request_row(self.state, r) for r in self.state.requests.values()]
        if not rows:
            self.out.line("no requests yet")
            return
        # The same table as `tokentape inspect`: fits 80 columns on a terminal.
        view = _RichView(self.out.stream) if self.out.rich else _PlainView(self.out.stream)
        view.table(f"requests ({len(rows)})", _REQUEST_COLUMNS, rows)

    def do_events(self, arg: str) -> None:
        """events [A-B | A | step=S]: list events by sequence number (default: around the
        current one; A alone: ten from A; step=S: the events of engine step S)."""
        arg = arg.strip()
        if not arg:
            first = max(0, self.pos - 1 - _CONTEXT)
            last = min(self.num_events, self.pos + _CONTEXT)
        elif arg.startswith("step="):
            step = _int(arg[5:], "a step number")
            first, last = self._events_of_step(step)
        else:
            a, sep, b = arg.replace(":", "-").partition("-")
            first = _int(a, "a sequence number")
            last = _int(b, "a sequence number") + 1 if sep else first + 10
            if first < 0 or first >= self.num_events:
                raise DebuggerError(self._event_out_of_range(first))
            if last <= first:
                raise DebuggerError(f"empty range {arg!r}")
            last = min(last, self.num_events)
        for seq, event in self.tape.events(first):
            if seq >= last:
                break
            mark = "->" if seq == self.pos - 1 else "  "
            self.out.line(f"{mark} {seq:>7}  {describe_event(event)}",
                          style="bold" if mark == "->" else None)

    def _events_of_step(self, step: int) -> tuple[int, int]:
        seq = self._seq_of_step(step)
        if seq is None:
            raise DebuggerError(self._step_out_of_range(step))
        nxt = self._seq_of_step(step + 1)
        return seq, self.num_events if nxt is None else nxt

    def do_diff(self, arg: str) -> None:
        """diff: what the current event changed in the derived state."""
        current = self._current_event()
        if current is None:
            raise DebuggerError("at the start of the tape: no event applied yet")
        seq, event = current
        before = self.tape.state_at(self.pos - 1)
        self.out.line(f"event {seq}: {describe_event(event)}", style="bold")
        changes = state_changes(before, self.state)
        if not changes:
            self.out.line("  no change to the derived state")
        for line in changes:
            self.out.line(f"  {line}", style="green" if line.startswith("+") else None)

    def do_names(self, arg: str) -> None:
        """names: the names conditions, watches and print may use."""
        from tokentape.replay import conditions

        self.out.line("request-level: " + ", ".join(conditions.REQUEST_NAMES))
        self.out.line("engine-level:  " + ", ".join(conditions.ENGINE_NAMES))

    def help_names(self) -> None:
        self.do_names("")

    # -- completion ----------------------------------------------------------------------------

    def _all_request_ids(self) -> list[str]:
        self._index_to(self.num_events)
        return [r.req_id for r in self.tape.snapshots.arrivals]

    def complete_next(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        return [k for k in KINDS if k.lower().startswith(text.lower())]

    def complete_break(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        if text.startswith("kind="):
            return ["kind=" + k for k in KINDS if k.lower().startswith(text[5:].lower())]
        if text.startswith("req="):
            return ["req=" + r for r in self.state.requests if r.startswith(text[4:])]
        options = ["kind=", "req=", *KINDS, *ALL_NAMES]
        return [o for o in options if o.startswith(text)]

    def complete_print(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        words = line.split()
        if len(words) >= 2 and words[1] in ("req", "request") and (len(words) > 2 or not text):
            return [r for r in self.state.requests if r.startswith(text)]
        return [o for o in ("req", *ALL_NAMES) if o.startswith(text)]

    complete_p = complete_print
    complete_watch = complete_print

    def complete_goto(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        return [o for o in ("start", "end", "@") if o.startswith(text)]


def state_changes(before: EngineState, after: EngineState) -> list[str]:
    """Lines naming every derived field that differs: engine-level, then per request."""
    from tokentape.cli import _request_detail

    lines: list[str] = []
    engine = {
        "step": lambda s: s.step, "paused": lambda s: s.paused, "waiting": lambda s: list(s.waiting),
        "running": lambda s: list(s.running),
        "in_flight_steps": lambda s: [x.step for x in s.in_flight_steps],
        "pending_output": lambda s: list(s.pending_output),
        "num_prefix_cache_resets": lambda s: s.num_prefix_cache_resets,
        "weights_id": lambda s: s.weights_id, "error": lambda s: s.error,
    }
    for name, get in engine.items():
        old, new = get(before), get(after)
        if old != new:
            lines.append(f"{name}: {old} -> {new}")
    for req_id, req in after.requests.items():
        new_detail = _request_detail(after, req)
        old_req = before.requests.get(req_id)
        if old_req is None:
            lines.append(f"+ request {req_id} added ({new_detail['num_prompt_tokens']} prompt tokens)")
            continue
        old_detail = _request_detail(before, old_req)
        for key, new in new_detail.items():
            old = old_detail[key]
            if old == new:
                continue
            if key == "output_token_ids" and isinstance(old, list) and new[:len(old)] == old:
                lines.append(f"{req_id}.output_token_ids: + {new[len(old):]}")
            else:
                lines.append(f"{req_id}.{key}: {old} -> {new}")
    return lines


def _int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise DebuggerError(f"expected {what}, got {text.strip()!r}") from None



def _format_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v!r}" for k, v in value.items()) + "}"
    return repr(value)


def run_debugger(tape: Tape, stdin: TextIO | None = None, stdout: TextIO | None = None) -> list[str]:
    """Run a session to its end; returns the errors of the commands that failed."""
    debugger = TapeDebugger(tape, stdin, stdout)
    debugger.run()
    return debugger.errors
