"""A recording session: every vLLM scheduler built in this process is recorded, whatever builds
it (vLLM's test helpers, an EngineCore, a test's own `Scheduler(...)`), with vLLM's code and
vLLM's tests unchanged. The pytest plugin (`--tokentape-record-vllm DIR`) opens one for a test
session and collects each test's recordings.

`install()` makes `Scheduler.__new__` build the recording subclass of the class asked for
(scheduler.recording_class), so `Scheduler(...)` and `AsyncScheduler(...)` are still instances
of the classes their callers named. The recordings of a test are kept in memory until the
test ends (`finish`), and the caller decides which to write out. Standard library only at
import: vLLM is imported by `install`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tokentape.integrations.vllm import active_session


def current() -> RecordingSession | None:
    """The session recording this process's schedulers, if one is open."""
    return active_session.current()  # type: ignore[no-any-return]


@dataclass(slots=True)
class Recording:
    """One scheduler's tape, recorded during one test."""

    scheduler: Any  # the RecordingScheduler (detached from its recorder by `finish`)
    recorder: Any  # its TapeRecorder, whose tape is a MemoryTape

    @property
    def tape(self) -> Any:
        return self.recorder.tape


@dataclass(slots=True)
class RecordingSession:
    test: str | None = None  # the test now running
    recordings: list[Recording] = field(default_factory=list)  # the test's, so far
    num_recorded: int = 0  # schedulers recorded in the whole session
    not_recorded_reasons: Counter[str] = field(default_factory=Counter)  # why others were not
    _saved_new: Any = None  # Scheduler.__dict__'s own __new__ before install, if any

    def install(self) -> None:
        if active_session.current() is not None:
            raise RuntimeError("a recording session is already open in this process")
        from vllm.v1.core.sched.scheduler import Scheduler

        from tokentape.integrations.vllm.scheduler import RecordingScheduler, recording_class

        def new(cls: type, *args: Any, **kwargs: Any) -> Any:
            if not issubclass(cls, RecordingScheduler):
                cls = recording_class(cls)
            return RecordingScheduler.__new__(cls, *args, **kwargs)

        self._saved_new = Scheduler.__dict__.get("__new__")
        Scheduler.__new__ = new  # type: ignore[method-assign]
        active_session.set_current(self)

    def uninstall(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        if self._saved_new is None:
            del Scheduler.__new__
        else:
            Scheduler.__new__ = self._saved_new  # type: ignore[method-assign]
        active_session.set_current(None)

    # -- called by RecordingScheduler as it is built ---------------------------------------------

    def recording(self, scheduler: Any, recorder: Any) -> None:
        self.recordings.append(Recording(scheduler, recorder))
        self.num_recorded += 1

    def not_recorded(self, scheduler_name: str, reason: str) -> None:
        self.not_recorded_reasons[f"{scheduler_name}: {reason}"] += 1

    # -- tests -------------------------------------------------------------------------------------

    def start(self, test: str) -> None:
        self.finish()  # schedulers built between tests (at collection) are not recorded on
        self.test = test

    def finish(self) -> list[Recording]:
        """The recordings of the test that ended; their schedulers record nothing more (a
        scheduler that outlives its test, in a fixture, is recorded for its first test only)."""
        done, self.recordings, self.test = self.recordings, [], None
        for recording in done:
            recording.scheduler.detach_recorder()
        return done
