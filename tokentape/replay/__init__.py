"""Replay: fold a tape into state (through snapshots), verify it, debug it, diff two tapes,
re-run it under another configuration (what-if), and export it."""

from tokentape.replay.diff import AlignmentError, TapeDiff, diff
from tokentape.replay.tape import Tape, fold, load_tape
from tokentape.replay.timeline import Timeline, build_timeline
from tokentape.replay.verify import Divergence, VerifyResult, verify
from tokentape.replay.whatif import WhatIfError, WhatIfResult, whatif

__all__ = [
    "AlignmentError",
    "Divergence",
    "Tape",
    "TapeDiff",
    "Timeline",
    "VerifyResult",
    "WhatIfError",
    "WhatIfResult",
    "build_timeline",
    "diff",
    "fold",
    "load_tape",
    "verify",
    "whatif",
]
