"""Progress bars: on stderr and only on a terminal, redrawn a few times a second at most;
`LLM.generate(use_tqdm=True)` as vLLM's, and folds that report how far they got."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from tape_scenarios import busy

from tokentape import LLM, SamplingParams, cli
from tokentape.progress import RequestProgress, progress
from tokentape.replay import load_tape


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal and counts its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_a_bar_is_drawn_only_on_a_terminal_and_rarely() -> None:
    piped = io.StringIO()
    with progress(10**6, "reading", stream=piped, minimum=0) as update:
        update(5)
    assert piped.getvalue() == ""
    term = FakeTerminal()
    with progress(10**6, "reading", stream=term, minimum=0) as update:
        for done in range(200_000):  # far faster than REFRESH_S between calls
            update(done)
    assert "reading" in term.getvalue()
    assert term.writes < 20  # redrawn at the start, the end and at most every REFRESH_S
    short = FakeTerminal()
    with progress(10, "reading", stream=short) as update:  # under the minimum: no bar
        update(5)
    assert short.getvalue() == ""


def test_request_progress_asks_for_the_token_count_only_when_it_redraws() -> None:
    asked = 0

    def tokens() -> int:
        nonlocal asked
        asked += 1
        return 123

    term = FakeTerminal()
    with RequestProgress(4, stream=term) as bar:
        assert bar.shown
        for _ in range(100_000):
            bar.update(1, tokens)
        bar.update(4, tokens, force=True)
    assert asked < 10
    assert "Processed prompts" in term.getvalue() and "4/4" in term.getvalue()
    assert "(123 tokens)" in term.getvalue()
    assert not RequestProgress(4, stream=io.StringIO()).shown
    assert not RequestProgress(4, stream=FakeTerminal(), enabled=False).shown


def test_llm_generate_shows_vllms_bar_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    llm = LLM(model="oracle", tape=None)
    params = SamplingParams(max_tokens=8)
    llm.generate(["a", "b", "c"], params)  # stderr is not a terminal here: nothing drawn
    assert capsys.readouterr() == ("", "")
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    llm.generate(["a", "b", "c"], params)
    assert "Processed prompts" in term.getvalue() and "3/3" in term.getvalue()
    assert "toks/s" in term.getvalue()
    quiet = FakeTerminal()
    monkeypatch.setattr("sys.stderr", quiet)
    llm.generate(["a"], params, use_tqdm=False)
    assert quiet.getvalue() == ""
    assert capsys.readouterr().out == ""  # progress never goes to stdout


def test_the_cli_keeps_stdout_clean_and_draws_on_a_terminal_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["generate", "Hi", "--model", "oracle", "--json", "--no-tape"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.err == "tape: none (--no-tape)\n"
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    rc = cli.main(["generate", "Hi", "--model", "oracle", "--json", "--no-tape"])
    out = capsys.readouterr().out
    assert rc == 0 and "Processed prompts" in term.getvalue()
    assert "\x1b" not in out and out.startswith('{"request_id": "0"')


def test_fold_reports_its_progress_and_gives_the_same_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tape = load_tape(busy())
    monkeypatch.setattr("tokentape.replay.tape.PROGRESS_EVERY", 7)
    seen: list[int] = []
    assert tape.fold(progress=seen.append) == tape.fold()
    assert seen == list(range(7, len(tape) + 1, 7))[: len(seen)] and len(seen) >= len(tape) // 7 - 1
    half = len(tape) // 2
    assert tape.fold(until_seq=half, progress=lambda n: None) == tape.fold(until_seq=half)
    indexed: list[int] = []
    steps = tape.fold().step
    assert tape.at(steps - 1, progress=indexed.append) == tape.fold()
