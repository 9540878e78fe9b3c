"""`tokentape debug TAPE`: step through a recorded run, forwards and backwards, in pdb's style.

The position and the state are a `TapeCursor`'s (tokentape.replay.cursor): after the first
`pos` events, so the *current event* is the one at sequence number `pos - 1`. Breakpoints and
watches are in tokentape.replay.breakpoints, their commands in debugger_breaking.py, the
commands that only look in debugger_looking.py; this file holds the session and moving.

It reads commands from a terminal (with tab completion) or, scripted, from any stream:

    printf 'break kind=PrefixCacheReset\\ncontinue\\nrequests\\n' | tokentape debug run.tape
"""

from __future__ import annotations

import cmd
import itertools
import re
import sys
from typing import TextIO

from tokentape.events import schema as ev
from tokentape.events.fold_errors import ReducerError
from tokentape.events.state import EngineState
from tokentape.events.store import TapeError
from tokentape.progress import is_terminal
from tokentape.replay.breakpoints import (
    KINDS,
    Breakpoint,
    DebuggerError,
    Scanner,
    Watch,
    parse_int,
    parse_kind,
)
from tokentape.replay.conditions import ExpressionError
from tokentape.replay.cursor import TapeCursor
from tokentape.replay.debugger_breaking import BreakpointCommands
from tokentape.replay.debugger_looking import LookingCommands
from tokentape.replay.render import Output, describe_event
from tokentape.replay.tape import Tape

_HELP_GROUPS = {
    "moving": ("step", "back", "goto", "next", "continue", "reverse-continue"),
    "breakpoints and watches": ("break", "delete", "watch", "unwatch"),
    "looking": ("where", "print", "requests", "events", "diff", "names"),
    "other": ("help", "quit"),
}
_SENTENCE_END = re.compile(r"[.]\s+(?=[A-Z])")  # not inside "e.g. next"
_ALIASES = (
    "s = step, c = continue, rc = reverse-continue, b = break, p = print, w = where, q = quit"
)


class TapeDebugger(BreakpointCommands, LookingCommands, cmd.Cmd):
    """The debugger over one tape. `run()` reads commands until `quit` or end of input."""

    doc_header = "commands (help COMMAND for more)"

    def __init__(
        self,
        tape: Tape,
        stdin: TextIO | None = None,
        stdout: TextIO | None = None,
        rich: bool | None = None,
    ) -> None:
        stdin = stdin if stdin is not None else sys.stdin
        stdout = stdout if stdout is not None else sys.stdout
        super().__init__(stdin=stdin, stdout=stdout)
        self.tape = tape
        self.cursor = TapeCursor(tape)
        self.out = Output(stdout, rich)
        self.interactive = is_terminal(stdin) and is_terminal(stdout)
        self.use_rawinput = self.interactive
        self.prompt = "(tokentape) " if self.interactive else ""
        self.errors: list[str] = []  # of the commands that failed: a scripted session fails too
        self.breakpoints: list[Breakpoint] = []
        self.watches: list[Watch] = []
        self._numbers = itertools.count(1)
        self._watch_numbers = itertools.count(1)
        self.intro = (
            f"tokentape debugger: {tape.path or '<memory tape>'}, {len(tape)} events, "
            f"discard policy {tape.header.discard_policy}. Type help for the commands."
        )

    @property
    def pos(self) -> int:
        return self.cursor.pos

    @property
    def state(self) -> EngineState:
        return self.cursor.state

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
            return "reverse_continue" + stripped[len("reverse-continue") :]
        return line

    def onecmd(self, line: str) -> bool:
        try:
            return super().onecmd(line)
        except ReducerError as exc:  # a damaged tape: the debugger works up to the damage
            self._error(str(exc))
            self.cursor.clip_to_damage()
            self._show_position()
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

    def do_help(self, arg: str) -> None:
        """help [COMMAND]: the commands, or what one does."""
        if arg.strip():
            super().do_help(arg.strip().replace("-", "_"))
            return
        for group, names in _HELP_GROUPS.items():
            self.out.line(f"{group}:", style="bold")
            for name in names:
                doc = " ".join(
                    (getattr(self, "do_" + name.replace("-", "_")).__doc__ or "").split()
                )
                first_sentence = _SENTENCE_END.split(doc)[0].rstrip(".")
                self.out.line(f"  {first_sentence}")
        self.out.line(f"aliases: {_ALIASES}")
        self.out.line(
            "help COMMAND says more; names lists what conditions, watch and print can use."
        )

    def do_EOF(self, arg: str) -> bool:
        """End of input: leave the debugger."""
        if self.interactive:
            self.out.line()
        return True

    def do_quit(self, arg: str) -> bool:
        """quit: leave the debugger (also q, exit, or end of input)."""
        return True

    do_q = do_exit = do_quit

    def _show_position(self) -> None:
        current = self.cursor.current_event()
        where = f"[{self.cursor.pos}/{self.cursor.num_events}]"
        if current is None:
            self.out.line(
                f"{where}  at the start of the tape (no event applied)", style="bold cyan"
            )
        else:
            seq, event = current
            self.out.line(f"{where}  event {seq}: {describe_event(event)}", style="bold cyan")
        for w in self.watches:
            self._show_watch(w)

    # -- moving ------------------------------------------------------------------------------------

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
        if self.cursor.pos >= self.cursor.num_events:
            raise DebuggerError(f"at the end of the tape ({self.cursor.num_events} events)")
        self.cursor.run_forward(lambda *_: None, limit=n)
        self._show_position()

    def do_back(self, arg: str) -> None:
        """back [N]: go back N events (default 1), through the snapshots."""
        n = self._parse_count(arg)
        if self.cursor.pos == 0:
            raise DebuggerError("at the start of the tape")
        self.cursor.seek(max(0, self.cursor.pos - n))
        self._show_position()

    def do_goto(self, arg: str) -> None:
        """goto STEP | goto @SEQ | goto start | goto end: jump to the event that schedules engine
        step STEP, to the event with sequence number SEQ, or to either end of the tape."""
        cursor = self.cursor
        arg = arg.strip()
        if arg == "start":
            cursor.seek(0)
        elif arg == "end":
            cursor.seek(cursor.num_events)
        elif arg.startswith(("@", "#")):
            seq = parse_int(arg[1:], "a sequence number")
            if not 0 <= seq < cursor.num_events:
                raise DebuggerError(cursor.event_out_of_range(seq))
            cursor.seek(seq + 1)
        else:
            step = parse_int(arg, "a step number, @SEQ, start or end")
            step_seq = cursor.seq_of_step(step)
            if step_seq is None:
                raise DebuggerError(cursor.step_out_of_range(step))
            cursor.seek(step_seq + 1)
        self._show_position()

    def do_next(self, arg: str) -> None:
        """next KIND: go forwards to the next event of that kind (e.g. next FrameProduced)."""
        if not arg.strip():
            raise DebuggerError("next needs an event kind: " + ", ".join(KINDS))
        kind = parse_kind(arg.strip())
        reason = self.cursor.run_forward(lambda seq, e, s: kind if ev.kind_of(e) == kind else None)
        if reason is None:
            self.out.line(f"no {kind} after this point; at the end of the tape")
        self._show_position()

    def do_continue(self, arg: str) -> None:
        """continue: go forwards until a breakpoint is hit or the tape ends. Alias: c."""
        if self.cursor.pos >= self.cursor.num_events:
            raise DebuggerError(f"at the end of the tape ({self.cursor.num_events} events)")
        scanner = Scanner(self.breakpoints, self.cursor.state)
        hit: list[Breakpoint] = []

        def stop(seq: int, event: ev.Event, state: EngineState) -> str | None:
            bp = scanner.check(event, state)
            if bp is not None:
                hit.append(bp)
                return "hit"
            return None

        if self.cursor.run_forward(stop) is None:
            self.out.line("reached the end of the tape")
        else:
            self._report_hit(hit[0])
        self._show_position()

    def do_reverse_continue(self, arg: str) -> None:
        """reverse-continue: go backwards to the latest earlier place where a breakpoint is
        hit, or to the start of the tape. Alias: rc."""
        if self.cursor.pos == 0:
            raise DebuggerError("at the start of the tape")
        found = self.cursor.last_hit_before(self.breakpoints)
        if found is not None:
            pos, bp = found
            self.cursor.seek(pos)
            self._report_hit(bp)
        else:
            self.cursor.seek(0)
            self.out.line("reached the start of the tape")
        self._show_position()

    do_s, do_c, do_rc = do_step, do_continue, do_reverse_continue


def run_debugger(
    tape: Tape, stdin: TextIO | None = None, stdout: TextIO | None = None
) -> list[str]:
    """Run a session to its end; returns the errors of the commands that failed."""
    debugger = TapeDebugger(tape, stdin, stdout)
    debugger.run()
    return debugger.errors
