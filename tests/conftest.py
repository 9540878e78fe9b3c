import pytest

from tokentape.events._compiled import stale_builds


def pytest_configure(config: pytest.Config) -> None:
    stale = stale_builds()
    if stale:
        raise pytest.UsageError(
            "stale compiled modules (run `pip install -e .` again, or reinstall with "
            "TOKENTAPE_PURE_PYTHON=1 to run the Python source):\n  " + "\n  ".join(stale)
        )
