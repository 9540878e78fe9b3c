"""Chaos: seeded storms that drive a real engine through every disturbance it must survive
(tokentape/chaos/storms.py), for the tests, `benchmarks/chaos_storms.py` and the CLI; the
same storms against vLLM's own scheduler (vllm_storms.py), and the shrinking of a storm that
fails to the smallest that still does (shrink.py)."""

from tokentape.chaos.storms import (
    COMMANDS,
    StormDriver,
    StormError,
    StormResult,
    StormSpec,
    run_storm,
    storm_commands,
    storm_grid,
)

__all__ = [
    "COMMANDS",
    "StormDriver",
    "StormError",
    "StormResult",
    "StormSpec",
    "run_storm",
    "storm_commands",
    "storm_grid",
]
