from collections.abc import Iterator

import pytest

from tokentape.engine.core.kv_cache_manager import NO_BLOCKS
from tokentape.events._compiled import stale_builds
from tokentape.events.schema import NO_DRAFTS


def pytest_configure(config: pytest.Config) -> None:
    stale = stale_builds()
    if stale:
        raise pytest.UsageError(
            "stale compiled modules (run `pip install -e .` again, or reinstall with "
            "TOKENTAPE_PURE_PYTHON=1 to run the Python source):\n  " + "\n  ".join(stale)
        )


@pytest.fixture(autouse=True)
def _shared_empty_lists_stay_empty() -> Iterator[None]:
    """A decode step shares one empty list for "no new blocks" and one for "no drafts"
    (kv_cache_manager.NO_BLOCKS, schema.NO_DRAFTS) instead of allocating one per request:
    whatever a test runs, nothing may have appended to them."""
    yield
    assert NO_BLOCKS == [] and NO_DRAFTS == [], "a shared empty list was mutated"
