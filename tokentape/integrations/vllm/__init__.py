"""Record a vLLM engine onto a tokentape tape.

    TOKENTAPE_TAPE=vllm.tape python my_vllm_script.py    # the script builds:
    LLM(model=..., scheduler_cls="tokentape.integrations.vllm.RecordingScheduler")

`RecordingScheduler` is vLLM's own scheduler (AsyncScheduler under async scheduling,
Scheduler otherwise) with every request, scheduling decision, runner frame, client output,
abort, reset, pause and resume recorded on the tape named by $TOKENTAPE_TAPE. The tape's
header says `source: vllm` and vLLM's version; its discard policy is `deliver` (vLLM since
#48245), so fold, verify, postmortem, debug, diff and export read it as tokentape's own.
Importing this package needs vLLM (it runs in vLLM's engine core process).
"""

from tokentape.integrations.vllm.mapping import UnsupportedByRecorder
from tokentape.integrations.vllm.scheduler import (
    TAPE_ENV,
    AsyncRecordingScheduler,
    RecordingScheduler,
    SyncRecordingScheduler,
)

__all__ = ["TAPE_ENV", "AsyncRecordingScheduler", "RecordingScheduler", "SyncRecordingScheduler",
           "UnsupportedByRecorder"]
