"""For the command-line tests: run `tokentape` in process, and the one-line error rule. A
plain module (not conftest.py), imported by its name."""

from __future__ import annotations

import pytest

from tokentape import cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`tokentape ARGV` in this process: its exit status, stdout and stderr."""
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(rc: int, err: str, *fragments: str) -> None:
    """Exit status 2 and one line on stderr, `error: ...`, holding every fragment."""
    assert rc == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)
