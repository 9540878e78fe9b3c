"""The recording scheduler: vLLM's own Scheduler (or AsyncScheduler), unchanged, with every
call that changes a request recorded on a tokentape tape by TapeRecorder.

vLLM builds its scheduler in the engine core process from a class path, and picks its
AsyncScheduler only when `scheduler_cls` is None. So `RecordingScheduler` is one class path
for both: built with a config that schedules asynchronously it is an AsyncRecordingScheduler
(a subclass of vLLM's AsyncScheduler), otherwise a SyncRecordingScheduler (of Scheduler).
Both are RecordingSchedulers, and each can also be named directly; `recording_class` makes
the recording subclass of any other scheduler class (what a recording session builds).

Two ways to record:
- an engine (the default): the tape goes to the path in $TOKENTAPE_TAPE (the engine core runs
  in its own process), which must not exist yet. With $TOKENTAPE_CHECK=1 each event is also
  checked against the fold of the tape so far as it is recorded (what a chaos storm against
  vLLM runs with): an event that contradicts it stops the run with RecordingLost, the tape
  ending in an EngineError that says why. With $TOKENTAPE_TAPE_AT_CLOSE=1 the tape is held in
  memory and written as one file when the scheduler shuts down: no writer process to start,
  which is most of the cost of a short run (a chaos storm's shrink makes hundreds); a run
  killed before its shutdown leaves no tape. A configuration the recorder cannot describe
  (pipeline or data parallelism, KV connectors, several KV cache groups) is refused when the
  engine starts, and a request it cannot record (pooling, prompt embeddings, streaming input)
  when it is added: before anything is recorded. A tape that cannot be written stops the
  engine, as tokentape's own: a run is never served unrecorded. A release outside the ones
  the recorder was taught, whose code has a discard mechanism it knows (releases.py), is
  recorded with a line on stderr and the note in the header's `source_note`, and checked
  live as with $TOKENTAPE_CHECK=1.
- inside a recording session (session.py: vLLM's own tests under the pytest plugin): the tape
  is kept in memory for the session, each event is checked against the fold of the tape so
  far, and nothing the recorder does ever fails vLLM's code. A scheduler it cannot describe
  is not recorded; where the run leaves what the tape can describe (a test setting vLLM's
  state by hand), the tape ends with a RecordingStopped that says why.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

import vllm
import vllm.envs
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request

from tokentape.events.sqlite_store import SQLiteTape, write_tape
from tokentape.events.store import MemoryTape
from tokentape.events.tape_path import check_tape_path
from tokentape.integrations.vllm import active_session, mapping
from tokentape.integrations.vllm.mapping import UnsupportedByRecorder
from tokentape.integrations.vllm.recorder import RecorderError, TapeRecorder
from tokentape.integrations.vllm.releases import (
    Release,
    check_release,
    shipped_faults,
    untaught_note,
)
from tokentape.replay.tape import state_before_events
from tokentape.replay.verify_recorded import ConsistencyChecker

TAPE_ENV = "TOKENTAPE_TAPE"
CHECK_ENV = "TOKENTAPE_CHECK"
AT_CLOSE_ENV = "TOKENTAPE_TAPE_AT_CLOSE"


class RecordingScheduler(Scheduler):
    """Records vLLM's scheduling onto a tokentape tape; see the module."""

    def __new__(cls, *args: Any, **kwargs: Any) -> RecordingScheduler:
        if cls is RecordingScheduler:  # the one class path: dispatch on the scheduling mode
            config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
            cls = (
                AsyncRecordingScheduler
                if config.scheduler_config.async_scheduling
                else SyncRecordingScheduler
            )
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._recorder: TapeRecorder | None = None
        self._in_update = False
        active = active_session.current()
        self._tolerant = active is not None
        if active is None:
            release = running_release()
            path = os.environ.get(TAPE_ENV)
            if not path:
                raise UnsupportedByRecorder(
                    f"set ${TAPE_ENV} to the path of the tape to write (a new file)"
                )
            check_tape_path(path)  # before vLLM builds anything more
            super().__init__(*args, **kwargs)
            checked = os.environ.get(CHECK_ENV) == "1" or not release.taught
            at_close = os.environ.get(AT_CLOSE_ENV) == "1"
            self._recorder = self._new_recorder(
                release,
                (lambda h: _TapeWrittenAtClose(path, h))
                if at_close
                else (lambda h: SQLiteTape(path, h)),
                checked,
            )
            return
        super().__init__(*args, **kwargs)
        try:
            release = running_release()
            self._recorder = self._new_recorder(release, MemoryTape, checked=True)
        except UnsupportedByRecorder as exc:
            vllm_class = next(
                c for c in type(self).__mro__ if not issubclass(c, RecordingScheduler)
            )
            active.not_recorded(vllm_class.__name__, str(exc))
            return
        active.recording(self, self._recorder)

    def _new_recorder(
        self, release: Release, open_tape: Callable[[Any], Any], checked: bool = False
    ) -> TapeRecorder:
        if self.connector is not None or getattr(self, "ec_connector", None) is not None:
            raise UnsupportedByRecorder(
                "the tokentape recorder does not record runs with KV or EC connectors"
            )
        if getattr(self, "num_sampled_tokens_per_step", 1) != 1:
            raise UnsupportedByRecorder(
                "the tokentape recorder records autoregressive models (one "
                "sampled token per step), not diffusion canvases"
            )
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise UnsupportedByRecorder(
                f"the tokentape recorder records models with one KV cache group, not {len(groups)}"
            )
        asynchronous = isinstance(self, AsyncScheduler)
        config = mapping.engine_config(
            self.vllm_config,
            self.block_size,
            self.kv_cache_config.num_blocks,
            self.max_num_scheduled_tokens,
            release.discard_policy,
            asynchronous,
            list(running_faults()),
        )
        note = ""
        if not release.taught:
            note = untaught_note(vllm.__version__, release)
            print(f"tokentape recorder: {note}", file=sys.stderr, flush=True)
        header = mapping.make_header(config, self.vllm_config, vllm.__version__, note)
        checker = None
        if checked:
            checker = ConsistencyChecker(
                state_before_events(header, config),
                config.max_num_batched_tokens,
                config.max_num_seqs,
                header.vocab_size,
            )
        randomized = not vllm.envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
        return TapeRecorder(open_tape(header), header.vocab_size, randomized, checker)

    def detach_recorder(self) -> None:
        """Record nothing more (the session closed this scheduler's tape)."""
        self._recorder = None

    # -- how a call is recorded ------------------------------------------------------------------

    def _record(self, what: Callable[[TapeRecorder], None]) -> None:
        """Record with the recorder, if any. Its failure stops an engine (a run is never served
        unrecorded); in a session it ends the tape with why, and vLLM goes on."""
        recorder = self._recorder
        if recorder is None:
            return
        try:
            what(recorder)
        except UnsupportedByRecorder as exc:
            if not self._tolerant:
                raise  # refused before anything was recorded
            self._stop(str(exc))
        except Exception as exc:
            if not self._tolerant:
                with contextlib.suppress(Exception):
                    recorder.error(exc)
                raise
            self._stop(
                str(exc)
                if isinstance(exc, RecorderError)
                else f"the recorder could not follow vLLM: {type(exc).__name__}: {exc}"
            )

    def _stop(self, reason: str) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            with contextlib.suppress(Exception):
                recorder.stop(reason)

    def _vllm(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """vLLM's own method; if it raises, the run ends there on the tape (EngineError)."""
        try:
            return call(*args, **kwargs)
        except BaseException as exc:
            self._failed(exc)
            raise

    def _failed(self, exc: BaseException) -> None:
        recorder = self._recorder
        if recorder is not None:
            with contextlib.suppress(Exception):
                recorder.error(exc)
            if self._tolerant:
                self._recorder = None  # nothing follows an EngineError on a tape

    # -- commands --------------------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        params: list[Any] = []

        def check(recorder: TapeRecorder) -> None:
            if request.request_id in self.requests:
                raise UnsupportedByRecorder(
                    f"request id {request.request_id!r} is already in use "
                    "(streaming-input sessions cannot be recorded)"
                )
            params.append(mapping.sampling_params(request, recorder.vocab_size))

        self._record(check)
        self._vllm(super().add_request, request)
        if params:
            self._record(lambda r: r.added(request, params[0]))

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: Any
    ) -> list[Any]:
        finished = self._vllm(super().finish_requests, request_ids, finished_status)
        self._record(
            lambda r: r.finished_by_call(
                finished, mapping.status_reason(finished_status), deliver=not self._in_update
            )
        )
        return finished

    def set_pause_state(self, pause_state: Any) -> None:
        self._vllm(super().set_pause_state, pause_state)
        self._record(lambda r: r.pause_state(pause_state.name))

    def executor_slept(self, level: int) -> None:
        """The executor released its memory (vLLM's EngineCore.sleep at level 1 or 2, once
        its pause is done). vLLM's engine core does not tell its scheduler, so whatever drives
        the engine calls this (the scheduler driver does), as the executor's sleep returns."""
        self._record(lambda r: r.slept(level))

    def executor_woke_up(self, tags: list[str] | None) -> None:
        """The executor woke `tags` up (None: everything), as its wake_up returns: before the
        resume that EngineCore.wake_up may follow it with."""
        self._record(lambda r: r.woke_up(tags))

    def executor_failed(self, exc: BaseException) -> None:
        """The executor raised running a step that the scheduler scheduled: the engine core
        dies of it, and the tape ends with it (an EngineError), as with vLLM's own errors."""
        self._failed(exc)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self._record(lambda r: r.begin_reset())
        try:
            ok = super().reset_prefix_cache(reset_running_requests, reset_connector)
        except BaseException as exc:
            self._record(lambda r: r.end_reset(reset_running_requests, False))
            self._failed(exc)
            raise
        self._record(lambda r: r.end_reset(reset_running_requests, ok))
        return ok

    # -- the scheduler's decisions and the runner's frames ------------------------------------

    def _preempt_request(self, request: Any, timestamp: float, *args: Any, **kwargs: Any) -> None:
        # vLLM since #48245 passes drop_stale_output too; earlier releases, only these two.
        super()._preempt_request(request, timestamp, *args, **kwargs)
        self._record(lambda r: r.preempted(request))

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = self._vllm(super().schedule, *args, **kwargs)
        self._record(lambda r: r.scheduled(output, self.requests))
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        framed: list[bool] = []
        self._record(lambda r: framed.append(r.frame(scheduler_output, model_runner_output)))
        self._in_update = True
        try:
            outputs = self._vllm(super().update_from_output, scheduler_output, model_runner_output)
        finally:
            self._in_update = False
        if framed:
            self._record(lambda r: r.delivered(outputs, mapping.finish_reason, framed[0]))
        return outputs

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if not self._tolerant and self._recorder is not None:
                self._recorder.close()


class _TapeWrittenAtClose(MemoryTape):
    """A tape held in memory, written as one SQLite file by close ($TOKENTAPE_TAPE_AT_CLOSE)."""

    def __init__(self, path: str, header: Any) -> None:
        super().__init__(header)
        self.file = path
        self._written = False

    def close(self) -> None:
        if not self._written:
            self._written = True
            write_tape(self.file, self.header, (e for _, e in self.iter_events()))


class SyncRecordingScheduler(RecordingScheduler):
    """vLLM's Scheduler, recorded (synchronous scheduling)."""


class AsyncRecordingScheduler(RecordingScheduler, AsyncScheduler):
    """vLLM's AsyncScheduler, recorded (async scheduling)."""


@cache
def running_release() -> Release:
    """The release of the vLLM this process runs (releases.check_release), read from its code
    once: every scheduler the process builds records under it."""
    return check_release(vllm.__version__, Scheduler, Request)


@cache
def running_faults() -> tuple[str, ...]:
    """The engine-core bugs of the vLLM this process runs (releases.shipped_faults), once."""
    return tuple(shipped_faults(EngineCore))


@cache
def recording_class(base: type) -> type:
    """The recording subclass of a vLLM scheduler class (vLLM's own two have theirs)."""
    if issubclass(base, RecordingScheduler):
        return base
    if base is Scheduler:
        return SyncRecordingScheduler
    if base is AsyncScheduler:
        return AsyncRecordingScheduler
    return type(f"Recording{base.__name__}", (RecordingScheduler, base), {"__module__": __name__})
