"""The model runner's worker thread: runs jobs (forward passes) in order, on the engine's own
CPU thread count.

Every forward pass runs here, with the pipeline (depth > 1) or without it. That scopes the
engine's thread count to this thread: OpenMP (and with it torch's intra-op threads, oneDNN's
and MKL's) keeps its count per thread, so the count set here leaves the caller's
`torch.get_num_threads()` as it was. torch also keeps a process-wide count that threads started
later begin with; setting it here changes that too, so the worker puts it back.

The runner's other parallel torch work (a weight update, a sleep and a wake-up) runs here too,
and its build on a thread of its own that ends with it (`on_a_thread_of_its_own`): each thread
that runs a parallel region keeps an OpenMP team of its own for good, and once libgomp (torch's
OpenMP) manages more threads than there are CPUs, it cuts every team's spin-wait at a barrier
to 100 spins before a sleep on a futex. A team left on the engine's own thread beside the
worker's (the build's) made Qwen3-0.6B's decode steps on 2 CPUs 7% slower (a forward 312 -> 292
ms without it; 26,000 -> 1,500 context switches in a run of 64 x 48 tokens).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class _Failure:
    error: BaseException


class _SideJob:
    """What a job run by `call` returns: its outcome went to its caller, not the outbox."""


_SIDE_JOB = _SideJob()


class ModelWorker:
    """A thread that runs submitted jobs one at a time, in order; `result()` returns (or
    raises) the oldest job's outcome. `num_threads` None keeps torch's default count."""

    def __init__(self, num_threads: int | None, name: str = "tokentape-model-runner") -> None:
        self._inbox: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._outstanding = 0  # jobs submitted whose result() has not been taken
        callers = torch.get_num_threads()  # settles the caller's own count before ours is set
        # The thread holds the queues, not the worker: a worker dropped without close() is
        # collected, and its finalizer stops the thread.
        self._thread = threading.Thread(
            target=_serve, args=(self._inbox, self._outbox, num_threads), name=name, daemon=True
        )
        self._thread.start()
        # Stop the thread at interpreter exit too, before torch is torn down under it.
        self._stop = weakref.finalize(self, _stop_worker, self._inbox, self._thread)
        self.run(lambda: None)  # the count is set once this returns
        if num_threads:
            _set_count_for_new_threads(callers)

    @property
    def num_pending(self) -> int:
        """Jobs submitted and not started yet."""
        return self._inbox.qsize()

    @property
    def num_outstanding(self) -> int:
        """Jobs submitted whose outcome has not been taken by `result()` yet."""
        return self._outstanding

    def submit(self, job: Callable[[], Any]) -> None:
        self._outstanding += 1
        self._inbox.put(job)

    def result(self) -> Any:
        outcome = self._outbox.get()
        self._outstanding -= 1
        if isinstance(outcome, _Failure):
            raise outcome.error
        return outcome

    def run(self, job: Callable[[], Any]) -> Any:
        """Run one job on the worker and wait for it (nothing else may be pending)."""
        self.submit(job)
        return self.result()

    def call(self, job: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `job` on the worker after the jobs submitted before it, and wait for it (up to
        `timeout` seconds: TimeoutError, the job still runs). Its outcome is its own: the
        steps' results, which `result()` takes in order, are left as they are. Called from a
        job on the worker, it runs `job` at once: it is already in its turn."""
        if threading.current_thread() is self._thread:
            return job()
        done: Future[Any] = Future()

        def side_job() -> _SideJob:
            _settle(done, job)
            return _SIDE_JOB

        self._inbox.put(side_job)
        return done.result(timeout)

    def close(self) -> None:
        self._stop()


def _serve(
    inbox: queue.Queue[Callable[[], Any] | None], outbox: queue.Queue[Any], num_threads: int | None
) -> None:
    # torch settles a thread's count lazily, on its first parallel op, from the process-wide
    # count; settle it first, or the count put back for new threads would replace ours.
    torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    while (job := inbox.get()) is not None:
        try:
            outcome = job()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller of result())
            outcome = _Failure(exc)
        if outcome is not _SIDE_JOB:
            outbox.put(outcome)
        # Not held while waiting for the next: a job's closure holds its runner.
        del job, outcome


def on_a_thread_of_its_own(job: Callable[[], Any]) -> Any:
    """Run `job` on a new thread and wait for that thread to end; its outcome (or exception)
    is the caller's. The OpenMP team the job's torch ops start ends with the thread (see the
    module's docstring)."""
    done: Future[Any] = Future()
    # A daemon: an interrupted caller's interpreter does not wait for the job to end.
    thread = threading.Thread(target=_settle, args=(done, job), name="tokentape-build", daemon=True)
    thread.start()
    thread.join()
    return done.result()


def _settle(done: Future[Any], job: Callable[[], Any]) -> None:
    """Run `job`; its outcome, or its exception, goes to `done` (whose waiter raises it)."""
    try:
        done.set_result(job())
    except BaseException as exc:  # noqa: BLE001 (raised to the waiter)
        done.set_exception(exc)


def _set_count_for_new_threads(count: int) -> None:
    """torch.set_num_threads also sets the count every thread started later begins with; set
    that back from a short-lived thread, so only that thread's own count changes."""
    t = threading.Thread(target=torch.set_num_threads, args=(count,), name="tokentape-threads")
    t.start()
    t.join()


def _stop_worker(inbox: queue.Queue[Callable[[], Any] | None], thread: threading.Thread) -> None:
    inbox.put(None)
    thread.join()
