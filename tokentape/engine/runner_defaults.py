"""Engine settings whose default depends on the runner built for it: the KV pool's block
count (sized from memory when the model is built: kv_cache_size.py) and the scheduling mode
(by the device the model runs on). Resolved before the tape's header is written, so a header
always holds the values the engine ran with."""

from __future__ import annotations

import msgspec

from tokentape.engine.config import EngineConfig
from tokentape.engine.runners.base import ModelRunner

# The fake models have no K/V to hold: their pool keeps the size it always had.
ORACLE_NUM_KV_BLOCKS = 2048
DEFAULT_PIPELINE_DEPTH = 2  # vLLM's async scheduling: one step planned ahead


def runs_on_cpu(runner: ModelRunner) -> bool:
    device = getattr(runner, "device", None)  # a real model's; the oracle has none
    return device is not None and device.type == "cpu"


def with_runner_defaults(config: EngineConfig, runner: ModelRunner) -> EngineConfig:
    """num_kv_blocks as the runner allocated it; async_scheduling, when not given, off for a
    model on the CPU (as vLLM's CPU platform turns it off: there the engine thread takes a
    core from the model's threads, and sync measured as fast or faster: docs/benchmarks.md,
    the async / sync rows) unless a pipeline_depth > 1 asks for it, on otherwise;
    pipeline_depth 2 when not given."""
    changes: dict[str, object] = {}
    if config.num_kv_blocks is None:
        changes["num_kv_blocks"] = getattr(runner, "num_kv_blocks", ORACLE_NUM_KV_BLOCKS)
    if config.async_scheduling is None:
        asked = config.pipeline_depth is not None and config.pipeline_depth > 1
        changes["async_scheduling"] = asked or not runs_on_cpu(runner)
    if config.pipeline_depth is None:
        changes["pipeline_depth"] = DEFAULT_PIPELINE_DEPTH
    return msgspec.structs.replace(config, **changes) if changes else config
