from collections.abc import Iterator

import pytest

from tokentape.engine.kv_cache_manager import NO_BLOCKS
from tokentape.events._compiled import stale_builds
from tokentape.events.schema import NO_DRAFTS


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        # pytest-xdist hands out the files of `--dist loadfile` most tests first; the order
        # pytest_collection_modifyitems sets below is the one to keep.
        config.option.loadscopereorder = False
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The vLLM tests first: few to a file, but the longest files (a vLLM start compiles for
    about a minute; vLLM's own scheduler tests run twice), so that under `-n 2 --dist
    loadfile` the many short files fill both workers at the end, not one file alone."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)
