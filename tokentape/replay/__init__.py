"""Replay: fold a tape into state, and verify that the scheduler reproduces it."""

from tokentape.replay.tape import Tape, fold, load_tape
from tokentape.replay.verify import Divergence, VerifyResult, verify

__all__ = ["Divergence", "Tape", "VerifyResult", "fold", "load_tape", "verify"]
