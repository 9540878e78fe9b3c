"""Which core modules run compiled (mypyc, see setup.py), and whether a build is stale."""

from __future__ import annotations

import importlib
import os

COMPILED_MODULES = (
    "tokentape.events.state",
    "tokentape.events.discard",
    "tokentape.events.engine_rules",
    "tokentape.events.reducer",
    "tokentape.events.stop_check",
    "tokentape.engine.core.kv_cache_manager",
    # The per-request Python of every step: the scheduler's plan and the outputs built from
    # it (compiled, a decode step of 256 requests takes about a third less time).
    "tokentape.engine.core.step_plan",
    "tokentape.engine.core.scheduler",
    "tokentape.engine.core.fault_injecting_scheduler",
    "tokentape.engine.output_processor",
    "tokentape.engine.core.core_outputs",
    # The runner's per-entry Python in every lane's pass: its inputs and its sampling.
    "tokentape.engine.runners.input_batch",
    "tokentape.engine.runners.sample_frames",
)


def stale_builds() -> list[str]:
    """Compiled modules older than their source: an edit there would silently not run."""
    stale = []
    for name in COMPILED_MODULES:
        path = importlib.import_module(name).__file__ or ""
        if path.endswith((".so", ".pyd")):
            source = os.path.join(os.path.dirname(path), name.rsplit(".", 1)[1] + ".py")
            if os.path.exists(source) and os.path.getmtime(source) > os.path.getmtime(path):
                stale.append(f"{path} is older than {source}")
    return stale
