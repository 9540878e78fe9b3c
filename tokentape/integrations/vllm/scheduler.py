"""The recording scheduler: vLLM's own Scheduler (or AsyncScheduler), unchanged, with every
call that changes a request recorded on a tokentape tape by TapeRecorder.

vLLM builds its scheduler in the engine core process from a class path, and picks its
AsyncScheduler only when `scheduler_cls` is None. So `RecordingScheduler` is one class path
for both: built with a config that schedules asynchronously it is an AsyncRecordingScheduler
(a subclass of vLLM's AsyncScheduler), otherwise a SyncRecordingScheduler (of Scheduler).
Both are RecordingSchedulers, and each can also be named directly.

The tape goes to the path in $TOKENTAPE_TAPE (the engine core runs in its own process), which
must not exist yet. A configuration the recorder cannot describe (pipeline or data
parallelism, KV connectors, several KV cache groups) is refused when the engine starts, and a
request it cannot record (pooling, prompt embeddings, streaming input) when it is added:
before anything is recorded. A tape that cannot be written stops the engine, as tokentape's
own: a run is never served unrecorded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import vllm
import vllm.envs
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from tokentape.engine.llm import check_tape_path
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.integrations.vllm import mapping
from tokentape.integrations.vllm.mapping import UnsupportedByRecorder
from tokentape.integrations.vllm.recorder import TapeRecorder
from tokentape.integrations.vllm.releases import check_release

TAPE_ENV = "TOKENTAPE_TAPE"


class RecordingScheduler(Scheduler):
    """Records vLLM's scheduling onto a tokentape tape; see the module."""

    def __new__(cls, *args: Any, **kwargs: Any) -> RecordingScheduler:
        if cls is RecordingScheduler:  # the one class path: dispatch on the scheduling mode
            config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
            cls = AsyncRecordingScheduler if config.scheduler_config.async_scheduling else SyncRecordingScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        release = check_release(vllm.__version__, Scheduler, Request)
        path = os.environ.get(TAPE_ENV)
        if not path:
            raise UnsupportedByRecorder(f"set ${TAPE_ENV} to the path of the tape to write (a new file)")
        check_tape_path(path)  # before vLLM builds anything more
        super().__init__(*args, **kwargs)
        if self.connector is not None or self.ec_connector is not None:
            raise UnsupportedByRecorder("the tokentape recorder does not record runs with KV or EC connectors")
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise UnsupportedByRecorder(f"the tokentape recorder records models with one KV cache group, "
                                        f"not {len(groups)}")
        config = mapping.engine_config(self.vllm_config, self.block_size, self.kv_cache_config.num_blocks,
                                       self.max_num_scheduled_tokens, release.discard_policy)
        header = mapping.make_header(config, self.vllm_config, vllm.__version__)
        randomized = not vllm.envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
        self._recorder = TapeRecorder(SQLiteTape(path, header), header.vocab_size, randomized)
        self._in_update = False

    @contextlib.contextmanager
    def _failures_recorded(self) -> Iterator[None]:
        try:
            yield
        except UnsupportedByRecorder:
            raise  # refused before anything was recorded
        except BaseException as exc:
            with contextlib.suppress(Exception):
                self._recorder.error(exc)
            raise

    # -- commands --------------------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        if request.request_id in self.requests:
            raise UnsupportedByRecorder(f"request id {request.request_id!r} is already in use "
                                        "(streaming-input sessions cannot be recorded)")
        params = mapping.sampling_params(request, self._recorder.vocab_size)
        with self._failures_recorded():
            super().add_request(request)
            self._recorder.added(request, params)

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: Any) -> list[Any]:
        with self._failures_recorded():
            finished = super().finish_requests(request_ids, finished_status)
            self._recorder.finished_by_call(finished, mapping.status_reason(finished_status),
                                            deliver=not self._in_update)
        return finished

    def set_pause_state(self, pause_state: Any) -> None:
        super().set_pause_state(pause_state)
        with self._failures_recorded():
            self._recorder.pause_state(pause_state.name)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        recorder = self._recorder
        recorder.begin_reset()
        try:
            ok = super().reset_prefix_cache(reset_running_requests, reset_connector)
        except BaseException:
            recorder.end_reset(reset_running_requests, False)
            raise
        with self._failures_recorded():
            recorder.end_reset(reset_running_requests, ok)
        return ok

    # -- the scheduler's decisions and the runner's frames ------------------------------------

    def _preempt_request(self, request: Any, timestamp: float, *args: Any, **kwargs: Any) -> None:
        # vLLM since #48245 passes drop_stale_output too; earlier releases, only these two.
        super()._preempt_request(request, timestamp, *args, **kwargs)
        self._recorder.preempted(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self._failures_recorded():
            output = super().schedule(*args, **kwargs)
            self._recorder.scheduled(output, self.requests)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        with self._failures_recorded():
            framed = self._recorder.frame(scheduler_output, model_runner_output)
            self._in_update = True
            try:
                outputs = super().update_from_output(scheduler_output, model_runner_output)
            finally:
                self._in_update = False
            self._recorder.delivered(outputs, mapping.finish_reason, framed)
        return outputs

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._recorder.close()


class SyncRecordingScheduler(RecordingScheduler):
    """vLLM's Scheduler, recorded (synchronous scheduling)."""


class AsyncRecordingScheduler(RecordingScheduler, AsyncScheduler):
    """vLLM's AsyncScheduler, recorded (async scheduling)."""
