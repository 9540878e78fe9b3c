"""How AsyncLLM talks to its engine core: MPClient (a background process over ZMQ, the
default) or InprocClient (the same EngineCoreProc stepped in the front end's event loop, for
debugging: one thread, breakpoints work). Both hand every core message to `dispatch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec

from tokentape.engine.arg_utils import UsageContext
from tokentape.engine.core.messages import (
    FAREWELL,
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreFailed,
    CoreInfo,
    CoreMessage,
    CoreReady,
    CoreRequest,
    CoreSetup,
    UtilityCall,
    message_decoder,
    rebuild_error,
    request_encoder,
)

SHUTDOWN = "shutdown"
# Seconds a core whose stdin ended gets to close its tape before it is killed: it reads
# stdin between steps, so only a core stuck in a step is killed.
STOP_GRACE_S = 5.0
# Seconds a send waits for the core's input socket when it has no peer and the core's process
# still runs; past it the core is taken for gone.
SEND_WAIT_S = 1.0
# Core messages (one per step) the reader takes per wake of the event loop before it yields.
READ_BATCH = 16
Dispatch = Callable[[CoreMessage], None]


class CoreClient:
    """What AsyncLLM needs of a core: send requests, aborts and calls; messages come back
    through `dispatch`, which `start` installs in the running event loop."""

    info: CoreInfo

    def __init__(self) -> None:
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future[Any]] = {}

    def start(self, dispatch: Dispatch) -> None:
        raise NotImplementedError

    def send(self, msg: CoreRequest) -> None:
        raise NotImplementedError

    def add_request(self, req: AddRequest) -> None:
        self.send(req)

    def abort(self, request_ids: list[str]) -> None:
        self.send(AbortRequests(request_ids))

    async def call(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        fut = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self.send(UtilityCall(call_id, method, list(args)))
        except BaseException:
            del self._calls[call_id]
            raise
        return await fut

    def resolve(self, call_id: int, result: Any, error: tuple[str, str] | None) -> None:
        fut = self._calls.pop(call_id, None)
        if fut is not None and not fut.done():
            if error is not None:
                fut.set_exception(rebuild_error(error))
            else:
                fut.set_result(result)

    def fail_calls(self, exc: Exception) -> None:
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(exc)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        raise NotImplementedError


class InprocClient(CoreClient):
    def __init__(
        self, model: str, tape: Any, engine_args: dict[str, Any], usage_context: UsageContext
    ) -> None:
        super().__init__()
        from tokentape.engine.core.engine_core_proc import EngineCoreProc

        self.core = EngineCoreProc(model, tape, engine_args, usage_context)
        self.info = self.core.info()
        self._inbox: list[CoreRequest] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, dispatch: Dispatch) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(dispatch))

    def send(self, msg: CoreRequest) -> None:
        self._inbox.append(msg)
        if self._wake is not None:
            self._wake.set()

    async def _run(self, dispatch: Dispatch) -> None:
        assert self._wake is not None
        while True:
            if not self._inbox and not self.core.has_work():
                await self._wake.wait()
                self._wake.clear()
                continue
            requests, self._inbox = self._inbox, []
            messages, done = self.core.run_once(requests)
            for msg in messages:
                dispatch(msg)
            if done:
                return
            await asyncio.sleep(0)  # let the consumers and new requests in

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Abort what is left and close the tape, here and now (`timeout_s` is the
        background core's: this core runs in the caller's thread)."""
        if self._task is not None:
            self._task.cancel()
        self.core.shutdown()


def how_it_exited(code: int) -> str:
    """A process's end, as its exit status says: "exited with status 1", or "was killed by
    SIGKILL" for a negative status (the signal; the OOM killer sends SIGKILL)."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}"


class MPClient(CoreClient):
    """Starts `python -m tokentape.engine.core.engine_core_proc` and waits until its engine
    is built."""

    def __init__(
        self,
        model: str,
        tape: Any,
        engine_args: dict[str, Any],
        usage_context: UsageContext,
        startup_timeout_s: float = 900.0,
    ) -> None:
        super().__init__()
        import zmq

        self._dir = tempfile.mkdtemp(prefix="tokentape-core-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(out_addr)
        self._apull: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        setup = msgspec.msgpack.encode(
            CoreSetup(in_addr, out_addr, model, tape, engine_args, usage_context.value)
        )
        # The child imports this very package, wherever it was imported from here.
        root = os.path.dirname(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # Its own process group, so a terminal's Ctrl-C reaches the frontend alone (which then
        # stops the core in order), but not its own session: a new session is a new scheduler
        # autogroup, where the core would escape the frontend's nice (a Ray actor's 15) and
        # take the CPU from the actor that reads its outputs.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokentape.engine.core.engine_core_proc"],
            stdin=subprocess.PIPE,
            env=env,
            process_group=0,
        )
        # Forgotten without shutdown(): end the core's stdin (it closes its tape and exits).
        self._finalizer = weakref.finalize(self, _abandon, self.proc, self._dir)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(len(setup).to_bytes(4, "little") + setup)
            self.proc.stdin.flush()  # stays open: its end tells the core the frontend is gone
            self.info = self._wait_ready(startup_timeout_s)
        except BaseException:  # interrupted, or the core failed: it aborts its build and exits
            _let_go(self.proc)
            self._close_process(timeout_s=STOP_GRACE_S)
            raise

    def _wait_ready(self, timeout_s: float) -> CoreInfo:
        import zmq

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._pull.poll(100):
                msg = message_decoder.decode(self._pull.recv())
                if isinstance(msg, CoreReady):
                    # The core's input socket is connected before it says so, but our end may
                    # not have the peer yet: wait for it, so the first send finds it.
                    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                    if not self._push.poll(left_ms, zmq.POLLOUT):
                        raise TimeoutError("the engine core did not connect to its input socket")
                    return msg.info
                if isinstance(msg, CoreFailed):
                    raise rebuild_error((msg.error_type, msg.message))
                raise RuntimeError(f"engine core: unexpected first message {type(msg).__name__}")
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"the engine core process {how_it_exited(code)} before it was ready"
                )
        raise TimeoutError(f"the engine core was not ready after {timeout_s:.0f} s")

    def start(self, dispatch: Dispatch) -> None:
        import zmq.asyncio

        self._apull = zmq.asyncio.Socket.shadow(self._pull.underlying)
        self._reader = asyncio.get_running_loop().create_task(self._read(dispatch))

    async def _read(self, dispatch: Dispatch) -> None:
        import zmq

        sock, decode, recv = self._apull, message_decoder.decode, self._pull.recv
        while True:
            if not await sock.poll(1000):
                code = self.proc.poll()
                if code is not None:
                    dispatch(CoreDead(f"the engine core process {how_it_exited(code)}"))
                    return
                continue
            # What has arrived, a bounded batch per wake of the loop (one message per step):
            # a core faster than this loop must not starve the streams and the server's
            # other work (a disconnect, /metrics) by keeping this drain from ever ending.
            for _ in range(READ_BATCH):
                try:
                    data = recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = decode(data)
                dispatch(msg)
                if isinstance(msg, CoreDead):
                    return
            else:  # a full batch, more may be waiting: let the others run before the next
                await asyncio.sleep(0)

    def send(self, msg: CoreRequest) -> None:
        """Hand a message to the core without ever blocking: a PUSH socket with no peer (the
        core's end is closed: it died) would wait forever, and the event loop with it."""
        from tokentape.errors import EngineDeadError

        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        try:
            data = request_encoder.encode(msg)
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # checked before; to be sure
            raise ValueError(f"the request cannot be sent to the engine core: {exc}") from None
        if not self._send_bounded(data):
            code = self.proc.poll()
            state = "does not read its input" if code is None else how_it_exited(code)
            raise EngineDeadError(f"the engine core {state}: it takes no more requests")

    def _send_bounded(self, data: bytes) -> bool:
        """Send without blocking; with no peer (zmq.Again), wait up to SEND_WAIT_S for one if
        the core's process still runs (a reconnect), else give up: the core is gone."""
        import zmq

        for attempt in range(2):
            try:
                self._push.send(data, zmq.NOBLOCK)
                return True
            except zmq.Again:
                if attempt or self.proc.poll() is not None:
                    return False
                self._push.poll(int(SEND_WAIT_S * 1000), zmq.POLLOUT)
        return False

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Ask the core to abort what is left, close its tape and exit; wait for it `timeout_s`,
        then end its stdin (it stops between two steps) and, past STOP_GRACE_S, kill it. Never
        blocks on a dead core: the request is sent without waiting."""
        if self._closed:
            return
        if self.proc.poll() is None:
            import zmq

            with contextlib.suppress(zmq.ZMQError):
                self._send_bounded(request_encoder.encode(UtilityCall(-1, SHUTDOWN, [])))
        self._close_process(timeout_s)

    def _close_process(self, timeout_s: float) -> None:
        self._closed = True
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _let_go(self.proc)  # the core closes its tape and exits
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its tape verifies up to its last committed step
                self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self._apull is not None:
            with contextlib.suppress(Exception):
                self._apull.close(linger=0)
        self._pull.close(linger=0)
        self._push.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        self._finalizer.detach()


def _abandon(proc: subprocess.Popen[bytes], folder: str) -> None:
    _let_go(proc)  # an AsyncLLM dropped without shutdown(): its core aborts what is left
    shutil.rmtree(folder, ignore_errors=True)


def _let_go(proc: subprocess.Popen[bytes]) -> None:
    """End the core's stdin with FAREWELL first, so the core does not take it for our death."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.write(FAREWELL)
            proc.stdin.flush()
        with contextlib.suppress(OSError):
            proc.stdin.close()
