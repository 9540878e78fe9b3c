"""The debugger, driven by scripted sessions on stdin, with its output asserted."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from tape_scenarios import busy, pause_resume

from tokentape import cli
from tokentape.events import schema as ev
from tokentape.replay import load_tape
from tokentape.replay.debugger import TapeDebugger
from tokentape.replay.tape import Tape


@pytest.fixture(scope="module")
def flag_tape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("debug") / "flag.tape"
    pause_resume("flag", path)
    return path


def session(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tape: Path,
    script: str,
    *options: str,
    failed: int = 0,
) -> list[str]:
    """The transcript of a scripted session; `failed` commands must have failed, and then the
    session exits 2 with one line on stderr naming the first failure."""
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    rc = cli.main(["debug", str(tape), *options])
    captured = capsys.readouterr()
    if not failed:
        assert rc == 0 and captured.err == ""
    else:
        assert rc == 2, captured
        (line,) = captured.err.splitlines()
        commands = "command failed" if failed == 1 else "commands failed"
        assert line.startswith(f"error: {failed} debugger {commands}; the first: "), line
    return captured.out.splitlines()


def script(*commands: str) -> str:
    return "".join(f"{c}\n" for c in commands)


def after(lines: list[str], command: str) -> list[str]:
    """The output of one command in a transcript (up to the next echoed command)."""
    start = lines.index(f"(tokentape) {command}") + 1
    end = next(
        (i for i in range(start, len(lines)) if lines[i].startswith("(tokentape) ")), len(lines)
    )
    return lines[start:end]


def events_of(tape: Path) -> list[ev.Event]:
    return [e for _, e in load_tape(tape).events()]


def test_breakpoints_on_a_kind_and_a_condition(monkeypatch, capsys, flag_tape) -> None:  # type: ignore[no-untyped-def]
    events = events_of(flag_tape)
    reset = next(i for i, e in enumerate(events) if isinstance(e, ev.PrefixCacheReset))
    first_preempt = next(i for i, e in enumerate(events) if isinstance(e, ev.RequestPreempted))
    lines = session(
        monkeypatch,
        capsys,
        flag_tape,
        script(
            "break kind=PrefixCacheReset",
            "break discard > 0",
            "continue",
            "diff",
            "continue",
            "print discard",
            "print req s",
            "break",
            "continue",
        ),
    )
    assert lines[0].startswith(
        f"tokentape debugger: {flag_tape}, {len(events)} events, discard policy flag"
    )
    assert after(lines, "break kind=PrefixCacheReset") == ["breakpoint 1: kind=PrefixCacheReset"]
    assert after(lines, "break discard > 0") == ["breakpoint 2: when discard > 0 becomes true"]
    hit = lines[lines.index("(tokentape) continue") + 1 :][:2]
    assert hit[0] == "breakpoint 1 hit: kind=PrefixCacheReset"
    assert hit[1].startswith(f"[{reset + 1}/{len(events)}]  event {reset}: PrefixCacheReset(step=")
    assert after(lines, "diff")[1:] == ["  num_prefix_cache_resets: 0 -> 1"]
    # The flag is set by the first preemption: discard becomes 1 for that request.
    second = lines.index("(tokentape) continue", lines.index("(tokentape) diff"))
    assert lines[second + 1] == "breakpoint 2 hit: when discard > 0 becomes true"
    assert f"event {first_preempt}: RequestPreempted" in lines[second + 2]
    preempted = events[first_preempt].req_id  # type: ignore[attr-defined]
    other = "r" if preempted == "s" else "s"
    assert after(lines, "print discard") == [
        f"{{r: {int(preempted == 'r')}, s: {int(preempted == 's')}}}"
    ]
    detail = after(lines, "print req s")
    assert detail[0] == "request s"
    assert any(
        line.split() == ["status", "preempted" if preempted == "s" else "running"]
        for line in detail
    )
    assert after(lines, "break") == [
        "1: kind=PrefixCacheReset (hit 1 time)",
        "2: when discard > 0 becomes true (hit 1 time)",
    ]
    # The second request's flag is set at the very next event.
    assert lines[-2] == "breakpoint 2 hit: when discard > 0 becomes true"
    assert f"req={other} reason=reset_prefix_cache" in lines[-1]


def test_moving_forwards_and_backwards_matches_a_fold(flag_tape: Path) -> None:
    tape = Tape(load_tape(flag_tape).reader, snapshot_interval=7)
    out = io.StringIO()
    dbg = TapeDebugger(tape, io.StringIO(), out, rich=False)
    n = len(tape)
    script = [
        "step 40",
        "back 13",
        "step",
        "back 1",
        "goto 5",
        "goto @60",
        "next FrameProduced",
        "back 30",
        "goto end",
        "back 100",
        "goto start",
        "step 3",
    ]
    expected_pos = [40, 27, 28, 27, None, 61, None, None, n, None, 0, 3]
    for command, pos in zip(script, expected_pos):
        dbg.onecmd(dbg.precmd(command))
        if pos is not None:
            assert dbg.pos == pos, command
        assert dbg.state == tape.fold(until_seq=dbg.pos), command
    assert "error" not in out.getvalue()


def test_next_and_reverse_continue_stop_on_the_right_events(flag_tape: Path) -> None:
    tape = load_tape(flag_tape)
    kinds = [ev.kind_of(e) for _, e in tape.events()]
    out = io.StringIO()
    dbg = TapeDebugger(tape, io.StringIO(), out, rich=False)
    dbg.onecmd("next RequestPreempted")
    first = kinds.index("RequestPreempted")
    assert dbg.pos == first + 1
    dbg.onecmd("next requestpreempted")  # kinds are case-insensitive
    assert dbg.pos == kinds.index("RequestPreempted", first + 1) + 1
    dbg.onecmd("break req=s")
    dbg.onecmd("goto end")
    dbg.onecmd(dbg.precmd("reverse-continue"))
    names_s = [i for i, (_, e) in enumerate(tape.events()) if "s" in _named(e)]
    assert dbg.pos == names_s[-1] + 1
    dbg.onecmd("rc")
    assert dbg.pos == names_s[-2] + 1
    dbg.onecmd("delete")
    dbg.onecmd("rc")
    assert dbg.pos == 0 and "reached the start of the tape" in out.getvalue()


def _named(event: ev.Event) -> list[str]:
    from tokentape.replay.render import event_requests

    return event_requests(event)


def test_events_where_requests_and_watch(monkeypatch, capsys, flag_tape) -> None:  # type: ignore[no-untyped-def]
    lines = session(
        monkeypatch,
        capsys,
        flag_tape,
        "step 3\nevents\nwhere\nrequests\nwatch output\nstep\nevents 0-1\n",
    )
    ev_lines = after(lines, "events")
    assert ev_lines[0].split()[:2] == ["0", "RequestAdded(step=0)"]
    assert ev_lines[2].startswith("->       2  StepScheduled(step=0)")
    assert len(ev_lines) == 8  # the current event and up to five either side
    assert after(lines, "where")[1].startswith(
        "  steps scheduled 1, paused no, waiting 0, running 2"
    )
    table = after(lines, "requests")
    assert table[0] == "requests (2)"
    assert table[1].split()[:4] == ["id", "status", "prompt", "output"]
    assert table[2].split()[:4] == ["r", "running", "20", "0"]
    assert after(lines, "watch output") == ["watch 1: output = {r: 0, s: 0}"]
    assert after(lines, "step")[-1] == "watch 1: output = {r: 0, s: 0}"
    assert [x.split()[0] for x in after(lines, "events 0-1")] == ["0", "1"]


def test_bad_input_is_one_line_and_the_debugger_stays_open(monkeypatch, capsys, flag_tape) -> None:  # type: ignore[no-untyped-def]
    n = len(load_tape(flag_tape))
    lines = session(
        monkeypatch,
        capsys,
        flag_tape,
        script(
            "frobnicate",
            "goto 9999",
            "goto @-1",
            "goto @99999",
            "print req nope",
            "break req=nope",
            "break",
            "back",
            "step -2",
            "next Nope",
            "break discard >",
            "break __import__('os')",
            "watch nosuch",
            "events 10-5",
            "diff",
            "goto end",
            "step",
            "where",
            "print 1 / 0",
            "print 'a' * 100000000000",
            "print [0] * 70000",
            "print '%0999999999d' % 1",
            "print " + " * ".join(["99999999999999999999"] * 30),
            "print " + "1 + " * 600 + "1",
        ),
        failed=21,
    )
    expected = {
        "frobnicate": "error: unknown command 'frobnicate' (type help for the commands)",
        "goto 9999": "error: step 9999 is out of range: the tape schedules steps 0..",
        "goto @-1": "error: event -1 is out of range: the tape has events 0..",
        "goto @99999": "error: event 99999 is out of range",
        "print req nope": "error: no request 'nope' on this tape",
        "break req=nope": "error: no request 'nope' on this tape",
        "back": "error: at the start of the tape",
        "step -2": "error: expected a positive number of events, got -2",
        "next Nope": "error: unknown event kind 'Nope'",
        "break discard >": "error: cannot parse 'discard >'",
        "break __import__('os')": "error: Call is not allowed",
        "watch nosuch": "error: unknown name 'nosuch'",
        "events 10-5": "error: empty range '10-5'",
        "diff": "error: at the start of the tape: no event applied yet",
        "step": f"error: at the end of the tape ({n} events)",
        "print 1 / 0": "error: '1 / 0' failed: ZeroDivisionError: division by zero",
        # What an expression may build is bounded: an error line, not a MemoryError.
        "print 'a' * 100000000000": "error: repeating a sequence 100000000000 times: an expression "
        "may build at most 65536 elements",
        "print [0] * 70000": "error: repeating a sequence 70000 times",
        "print '%0999999999d' % 1": "error: string formatting with % is not allowed",
        "print " + " * ".join(["99999999999999999999"] * 30): "error: a product this large",
        "print "
        + "1 + " * 600
        + "1": "error: the expression is 2401 characters long; at most 1000",
    }
    for command, message in expected.items():
        out = after(lines, command)
        assert len(out) == 1 and out[0].startswith(message), (command, out)
    assert after(lines, "break") == ["no breakpoints"]
    assert after(lines, "where")[0].startswith(f"[{n}/{n}]")


def test_unknown_request_before_it_is_added(flag_tape: Path) -> None:
    out = io.StringIO()
    dbg = TapeDebugger(load_tape(flag_tape), io.StringIO(), out, rich=False)
    dbg.onecmd("print req s")
    assert (
        out.getvalue().strip()
        == "error: no request 's' yet at this point of the tape (0 requests here)"
    )


def test_help_and_completion(flag_tape: Path) -> None:
    out = io.StringIO()
    dbg = TapeDebugger(load_tape(flag_tape), io.StringIO(), out, rich=False)
    dbg.onecmd("help")
    lines = out.getvalue().splitlines()
    for command in (
        "step",
        "back",
        "goto",
        "next",
        "continue",
        "reverse-continue",
        "break",
        "print",
        "requests",
        "events",
        "where",
        "diff",
        "watch",
    ):
        assert any(line.startswith(f"  {command}") for line in lines), command
    out.truncate(0)
    out.seek(0)
    dbg.onecmd("help reverse-continue")
    assert out.getvalue().startswith("reverse-continue: go backwards")
    assert dbg.complete_next("Fr", "next Fr", 5, 7) == ["FrameProduced"]
    assert dbg.complete_break("kind=Pre", "break kind=Pre", 6, 14) == ["kind=PrefixCacheReset"]
    dbg.onecmd("goto end")
    assert dbg.complete_print("", "print req ", 10, 10) == ["r", "s"]
    assert "discard" in dbg.complete_print("dis", "print dis", 6, 9)


def test_rich_output_on_a_terminal_draws_tables(flag_tape: Path) -> None:
    out = io.StringIO()
    dbg = TapeDebugger(load_tape(flag_tape), io.StringIO(), out, rich=True)
    dbg.onecmd("goto end")
    dbg.onecmd("requests")
    text = out.getvalue()
    assert "requests (2)" in text and "finished" in text and "─" in text


def test_debugging_a_busy_run_with_a_condition_on_kv_pressure(tmp_path: Path) -> None:
    path = tmp_path / "busy.tape"
    busy(path)
    out = io.StringIO()
    dbg = TapeDebugger(load_tape(path), io.StringIO(), out, rich=False)
    dbg.onecmd("break preemptions > 0 and status == 'preempted'")
    dbg.onecmd("continue")
    _, event = next(load_tape(path).events(dbg.pos - 1))
    assert isinstance(event, ev.RequestPreempted) and event.reason == "kv_pressure"


def test_cli_errors_before_the_session_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["debug", str(tmp_path / "missing.tape")])
    err = capsys.readouterr().err
    assert (
        rc == 2
        and err.count("\n") == 1
        and err.startswith("error: ")
        and "no such tape file" in err
    )
    (tmp_path / "notatape.tape").write_text("hello")
    rc = cli.main(["debug", str(tmp_path / "notatape.tape")])
    assert rc == 2 and "not a tokentape tape" in capsys.readouterr().err


def test_interrupting_a_long_command_keeps_the_debugger_open(
    flag_tape: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = io.StringIO()
    dbg = TapeDebugger(load_tape(flag_tape), io.StringIO(), out, rich=False)
    calls = iter(range(1000))

    def interrupt_at_10(*args: object) -> None:
        if next(calls) == 10:
            raise KeyboardInterrupt

    monkeypatch.setattr(
        "tokentape.replay.cursor.evolve",
        lambda state, event: (interrupt_at_10(), _evolve(state, event)),
    )
    dbg.onecmd("continue")
    assert "interrupted" in out.getvalue() and dbg.pos == 10
    assert dbg.state == load_tape(flag_tape).fold(until_seq=10)


def _evolve(state, event):  # type: ignore[no-untyped-def]
    from tokentape.events.reducer import evolve

    return evolve(state, event)


def first_failing_event(tape: Tape) -> int:
    from tokentape.events.fold_errors import ReducerError
    from tokentape.events.reducer import evolve

    state = tape.initial_state()
    for seq, event in tape.events():
        try:
            evolve(state, event)
        except ReducerError:
            return seq
    raise AssertionError("the tape folds")


def test_a_damaged_tape_is_debugged_up_to_the_damage() -> None:
    from tokentape.events.store import MemoryTape

    recording = load_tape(pause_resume("flag"))
    damaged = MemoryTape(recording.header)
    events = [e for _, e in recording.events()]
    dropped = next(
        i for i, e in enumerate(events) if isinstance(e, ev.StepScheduled) and e.step == 4
    )
    for i, event in enumerate(events):
        if i != dropped:  # then step 5 is scheduled when step 4 was expected
            damaged.append(event)
    frame = first_failing_event(load_tape(damaged))
    out = io.StringIO()
    dbg = TapeDebugger(load_tape(damaged), io.StringIO(), out, rich=False)
    dbg.onecmd("goto end")
    lines = out.getvalue().splitlines()
    refusal = (
        f"error: event {frame} (StepScheduled of step 5) cannot be applied to the state before it: "
    )
    assert lines[0].startswith(refusal)
    assert lines[1].startswith(f"[0/{frame}]")  # it stays where it was, the tape now ends there
    dbg.onecmd("goto end")
    assert out.getvalue().splitlines()[2].startswith(f"[{frame}/{frame}]")
    assert dbg.cursor.num_events == frame and dbg.state == load_tape(damaged).fold(until_seq=frame)
    out.truncate(0)
    out.seek(0)
    dbg.onecmd("back 3")
    dbg.onecmd("step 10")
    assert out.getvalue().splitlines()[1].startswith(f"[{frame}/{frame}]")
    assert dbg.state == load_tape(damaged).fold(until_seq=frame)
    # Stepping into the damage from a fresh session says so too.
    out2 = io.StringIO()
    dbg2 = TapeDebugger(load_tape(damaged), io.StringIO(), out2, rich=False)
    dbg2.onecmd("step 1000")
    assert out2.getvalue().startswith(refusal)
    assert dbg2.pos == frame and dbg2.state == load_tape(damaged).fold(until_seq=frame)
