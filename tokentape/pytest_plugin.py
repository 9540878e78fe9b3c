"""tokentape's pytest plugin (entry point `pytest11`, or `-p tokentape.pytest_plugin` where
tokentape is on the path but not installed): its options, and the keepers they turn on.

- `--tokentape-dir DIR`: the tape of every tokentape `LLM` a failing test created, kept in DIR
  with its postmortem report (tokentape/postmortem/pytest_plugin.py).
- `--tokentape-record-vllm DIR`: every vLLM scheduler built during the session is recorded,
  whatever builds it; the tapes of failing tests are kept in DIR with their postmortem reports
  (text and HTML); `--tokentape-keep-all` keeps every test's tapes
  (tokentape/integrations/vllm/pytest_recorder.py).

Nothing of tokentape beyond this module is imported unless an option is given.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokentape")
    group.addoption(
        "--tokentape-dir",
        metavar="DIR",
        default=None,
        help="record a tape for every tokentape engine a test creates; keep the tapes of failing "
        "tests in DIR, each with its postmortem report (.html) beside it",
    )
    group.addoption(
        "--tokentape-record-vllm",
        metavar="DIR",
        default=None,
        help="record every vLLM Scheduler/AsyncScheduler built during the session on a tape named "
        "after its test; keep the tapes of failing tests in DIR with their postmortem reports "
        "(.txt and .html)",
    )
    group.addoption(
        "--tokentape-keep-all",
        action="store_true",
        default=False,
        help="with --tokentape-record-vllm: keep the tapes of every test, not only failing ones",
    )


def pytest_configure(config: pytest.Config) -> None:
    directory = config.getoption("tokentape_dir", None)
    if directory:
        from tokentape.postmortem.pytest_plugin import TapeKeeper

        config.pluginmanager.register(TapeKeeper(Path(directory)), "tokentape-tape-keeper")
    vllm_directory = config.getoption("tokentape_record_vllm", None)
    if vllm_directory:
        from tokentape.integrations.vllm.pytest_recorder import VllmTapeKeeper

        keeper = VllmTapeKeeper(Path(vllm_directory), config.getoption("tokentape_keep_all"))
        config.pluginmanager.register(keeper, "tokentape-vllm-recorder")
    elif config.getoption("tokentape_keep_all", False):
        raise pytest.UsageError("--tokentape-keep-all needs --tokentape-record-vllm DIR")
