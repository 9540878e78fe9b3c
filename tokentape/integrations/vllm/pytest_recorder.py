"""`pytest --tokentape-record-vllm DIR`: vLLM's own tests, recorded.

Every vLLM scheduler a test builds is recorded (session.py) onto a tape named after the test
id (`-0`, `-1`, ... when it builds several). When the test ends, the tapes of a failing test
are written to DIR, each with its postmortem report beside it (`.txt` and `.html`), and their
paths go into the test's JUnit XML properties; with `--tokentape-keep-all` every test's tapes
are written (reports only for the failing ones). Tapes of passing tests are otherwise never
written: recording costs memory for one test at a time and no disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tokentape.integrations.vllm.session import Recording, RecordingSession
from tokentape.postmortem.pytest_plugin import (
    note_failure,
    tape_name,
    test_failed,
    write_postmortem,
)


@dataclass(slots=True)
class _Kept:
    test: str
    tape: Path
    failed: bool
    summary: str  # what the postmortem says first, for the terminal


class VllmTapeKeeper:
    def __init__(self, directory: Path, keep_all: bool) -> None:
        self.directory = directory
        self.keep_all = keep_all
        self.session = RecordingSession()
        self.session.install()
        self.kept: list[_Kept] = []
        self.num_stopped = 0  # recordings that lost track of their run

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.session.uninstall()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
        self.session.start(item.nodeid)
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
        if call.when == "teardown":
            recordings = self.session.finish()
            failed = test_failed(item, call)
            if recordings and (failed or self.keep_all):
                # Before the teardown report is made: it carries them to JUnit XML.
                item.user_properties.extend(self._keep(item.nodeid, recordings, failed))
        note_failure(item, (yield))

    def _keep(self, test: str, recordings: list[Recording], failed: bool) -> list[tuple[str, str]]:
        from tokentape.events import schema as ev
        from tokentape.events.sqlite_store import remove_tape_files, write_tape

        self.directory.mkdir(parents=True, exist_ok=True)
        base = tape_name(test)
        properties = []
        for i, recording in enumerate(recordings):
            tape = self.directory / f"{base if len(recordings) == 1 else f'{base}-{i}'}.tape"
            events = [e for _, e in recording.tape.iter_events()]
            self.num_stopped += any(isinstance(e, ev.RecordingStopped) for e in events)
            try:
                remove_tape_files(tape)  # a tape kept by an earlier run of the same test
                write_tape(tape, recording.tape.header, events)
            except Exception as exc:  # keeping a tape must never break the test run
                properties.append(
                    ("tokentape_error", f"{tape.name}: the tape could not be kept: {exc}")
                )
                continue
            properties.append(("tokentape_tape", str(tape)))
            summary = ""
            if failed:
                try:
                    report = write_postmortem(
                        tape, html=tape.with_suffix(".html"), text=tape.with_suffix(".txt")
                    )
                except Exception as exc:
                    properties.append(
                        ("tokentape_error", f"{tape.name}: no postmortem report: {exc}")
                    )
                else:
                    properties.append(("tokentape_report", str(tape.with_suffix(".html"))))
                    summary = _first_finding(report)
            self.kept.append(_Kept(test, tape, failed, summary))
        return properties

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        session = self.session
        terminalreporter.section("tokentape: vLLM's schedulers, recorded")
        line = terminalreporter.write_line
        line(
            f"{session.num_recorded} scheduler(s) recorded; {len(self.kept)} tape(s) kept in "
            f"{self.directory}"
            + (
                f", {self.num_stopped} of them stopped where the recording lost track"
                if self.num_stopped
                else ""
            )
        )
        for reason, count in session.not_recorded_reasons.most_common():
            line(f"not recorded ({count}): {reason}")
        for kept in self.kept:
            if kept.failed:
                line(
                    f"FAILED {kept.test}: {kept.tape} (postmortem: {kept.tape.with_suffix('.txt')})"
                    + (f"\n  {kept.summary}" if kept.summary else "")
                )


def _first_finding(report: Any) -> str:
    """The postmortem's first error (else warning) in one line, with the bug it matches."""
    from tokentape.postmortem.findings import BUG_CLASSES

    for severity in ("error", "warning"):
        for f in report.findings:
            if f.severity == severity:
                bug = (
                    f" -- matches {BUG_CLASSES[f.bug_class]}" if f.bug_class in BUG_CLASSES else ""
                )
                return f"[{severity}] {f.kind}: {f.message}{bug}"
    return "the postmortem has no finding"
