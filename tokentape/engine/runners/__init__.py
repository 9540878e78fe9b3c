"""Model runners: turn a scheduled step into a frame of sampled tokens."""

from tokentape.engine.runners.base import ModelRunner, NewRequest, ScheduledBatch
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.engine.runners.replay import ReplayRunner

__all__ = ["ModelRunner", "OracleRunner", "ReplayRunner", "NewRequest", "ScheduledBatch"]
