"""Model runners: turn a scheduled step into a frame of sampled tokens."""

from tokentape.engine.runners.base import ModelRunner, NewRequest, ScheduledBatch
from tokentape.engine.runners.oracle import OracleRunner

__all__ = ["ModelRunner", "OracleRunner", "NewRequest", "ScheduledBatch"]
