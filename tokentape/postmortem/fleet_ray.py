"""The fleet postmortem on Ray (`tokentape postmortem DIR --ray`): one task per tape.

It joins the Ray instance this process already has, else the cluster named by RAY_ADDRESS,
else starts a local one (with `jobs` CPUs when given) and stops it afterwards. Tasks open the
tapes by path, so on a cluster of several machines the directory must be on storage every
node sees. Needs the `ray` extra (`pip install 'tokentape[ray]'`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

_WAIT_S = 0.2  # results are gathered in batches, at most this late


def run_on_ray(
    analyse_tape: Callable[[str, str | None], bytes],
    paths: list[str],
    reference: str | None,
    done: Callable[[bytes], None],
    jobs: int | None = None,
) -> None:
    """Run `analyse_tape` (fleet.py's, handed in: this module is its caller's helper) for
    every path as a Ray task; `done` gets each result (msgpack)."""
    try:
        import ray
    except ImportError:
        raise ImportError(
            "the fleet postmortem on Ray needs Ray: pip install 'tokentape[ray]'"
        ) from None
    started = not ray.is_initialized()
    if started:
        if os.environ.get("RAY_ADDRESS"):
            ray.init(logging_level=logging.WARNING)
        else:
            ray.init(num_cpus=jobs, include_dashboard=False, logging_level=logging.WARNING)
    try:
        task = ray.remote(num_cpus=1)(analyse_tape)
        # Ray's stubs type a function with a default argument as taking none.
        pending = [task.remote(p, reference) for p in paths]  # type: ignore[call-arg]
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=_WAIT_S)
                for data in ray.get(ready):
                    done(data)
        except BaseException:
            for ref in pending:
                ray.cancel(ref)
            raise
    finally:
        if started:
            ray.shutdown()
