"""Chaos: seeded storms that drive a real engine through every disturbance it must survive
(tokentape/chaos/storms.py), for the tests, `benchmarks/chaos_storms.py` and the CLI."""

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
