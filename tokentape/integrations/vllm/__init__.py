"""Record a vLLM engine onto a tokentape tape.

    TOKENTAPE_TAPE=vllm.tape python my_vllm_script.py    # the script builds:
    LLM(model=..., scheduler_cls="tokentape.integrations.vllm.RecordingScheduler")

`RecordingScheduler` is vLLM's own scheduler (AsyncScheduler under async scheduling,
Scheduler otherwise) with every request, scheduling decision, runner frame, client output,
abort, reset, pause and resume recorded on the tape named by $TOKENTAPE_TAPE. The tape's
header says `source: vllm` and vLLM's version; its discard policy is `deliver` (vLLM since
#48245), so fold, verify, postmortem, debug, diff and export read it as tokentape's own.
The scheduler classes need vLLM and are imported when first named (vLLM resolves the class
path in its engine core process); the package's other modules (the releases it knows, the
mapping of its objects, the recording session) import without it.
"""

from typing import Any

from tokentape.integrations.vllm.mapping import UnsupportedByRecorder

__all__ = [
    "TAPE_ENV",
    "AsyncRecordingScheduler",
    "RecordingScheduler",
    "SyncRecordingScheduler",
    "UnsupportedByRecorder",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tokentape.integrations.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
