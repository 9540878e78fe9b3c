"""The postmortem's pytest keepers: `--tokentape-dir DIR` keeps, for every failing test, the
tape of every engine the test built (through the engine factory: `LLM`, an in-process
`AsyncLLM`), with the postmortem's HTML report beside it, and adds both paths to the test's
JUnit XML properties (`record_property`), so CI shows them. The
options are added by the plugin, tokentape/pytest_plugin.py; the helpers below serve the vLLM
recorder's keeper too (tokentape/integrations/vllm/pytest_recorder.py).

Engines with an in-memory tape (the default, `tape=None`) are written out as SQLite tapes;
a file tape is copied; `tape=False` records nothing and keeps nothing. Tapes of passing tests
are never written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tokentape.engine.core.engine_core import EngineCore
    from tokentape.postmortem.findings import Report

# tokentape itself is imported only when an option is on: the plugin loads in every pytest
# run of an environment where tokentape is installed.

FAILED = pytest.StashKey[bool]()


def test_failed(item: pytest.Item, call: pytest.CallInfo[None]) -> bool:
    """Whether the test failed in any phase so far (called as its teardown report is made)."""
    return item.stash.get(FAILED, False) or call.excinfo is not None


def note_failure(item: pytest.Item, outcome: object) -> None:
    if outcome.get_result().failed:  # type: ignore[attr-defined]
        item.stash[FAILED] = True


def tape_name(nodeid: str) -> str:
    """A file name for a test's tapes: its id, with what a path cannot hold replaced."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[-120:]


class TapeKeeper:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.engines: list[EngineCore] = []
        self.kept: list[tuple[str, Path, Path | None]] = []  # (test, tape, report)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
        from tokentape.engine.factory import ENGINE_CREATED_HOOKS

        self.engines = []
        hook = self.engines.append
        ENGINE_CREATED_HOOKS.append(hook)
        try:
            yield
        finally:
            ENGINE_CREATED_HOOKS.remove(hook)
            self.engines = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
        if call.when == "teardown" and self.engines and test_failed(item, call):
            # Before the teardown report is made: it carries the test's properties to JUnit XML.
            for name, value in self._keep(item):
                item.user_properties.append((name, value))
        note_failure(item, (yield))

    def _keep(self, item: pytest.Item) -> list[tuple[str, str]]:
        self.directory.mkdir(parents=True, exist_ok=True)
        base = tape_name(item.nodeid)
        properties = []
        engines = [e for e in self.engines if _has_tape(e)]
        for i, engine in enumerate(engines):
            name = base if len(engines) == 1 else f"{base}-{i}"
            tape = self.directory / f"{name}.tape"
            try:
                _save_tape(engine, tape)
            except Exception as exc:  # keeping a tape must never break the test run
                properties.append(("tokentape_error", f"{name}: the tape could not be kept: {exc}"))
                continue
            properties.append(("tokentape_tape", str(tape)))
            report = tape.with_suffix(".html")
            try:
                write_postmortem(tape, html=report)
            except Exception as exc:
                properties.append(("tokentape_error", f"{name}: no postmortem report: {exc}"))
                self.kept.append((item.nodeid, tape, None))
                continue
            properties.append(("tokentape_report", str(report)))
            self.kept.append((item.nodeid, tape, report))
        return properties

    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        if not self.kept:
            return
        terminalreporter.section("tokentape: tapes of failing tests")
        for nodeid, tape, report in self.kept:
            shown = f" (postmortem: {report})" if report else ""
            terminalreporter.write_line(f"{nodeid}: {tape}{shown}")


def _has_tape(engine: EngineCore) -> bool:
    from tokentape.events.sqlite_store import SQLiteTape
    from tokentape.events.store import MemoryTape

    writer = engine.tape
    return isinstance(writer, (MemoryTape, SQLiteTape))


def _save_tape(engine: EngineCore, dest: Path) -> None:
    from tokentape.events.sqlite_store import SQLiteTape, copy_tape, remove_tape_files, write_tape
    from tokentape.events.store import MemoryTape

    writer = engine.tape
    remove_tape_files(dest)  # a tape kept by an earlier run of the same test
    if isinstance(writer, MemoryTape):
        write_tape(dest, writer.header, (event for _, event in writer.iter_events()))
        return
    assert isinstance(writer, SQLiteTape) and writer.path is not None
    writer.flush()  # what the engine recorded is in the file (or its WAL); a no-op once closed
    copy_tape(writer.path, dest)  # one consistent file, even of a tape still open for writing


def write_postmortem(tape: Path, html: Path, text: Path | None = None) -> Report:
    """The postmortem of a kept tape, as an HTML report (and a text one); the report."""
    from tokentape.postmortem.analysis import postmortem
    from tokentape.postmortem.report_html import write_report
    from tokentape.postmortem.report_text import print_report
    from tokentape.replay.tape import load_tape

    loaded = load_tape(tape)
    report = postmortem(loaded)
    write_report(report, loaded, html)
    if text is not None:
        with open(text, "w", encoding="utf-8") as out:
            print_report(report, out)
    return report
