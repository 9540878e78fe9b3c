"""How AsyncLLM talks to its engine core: MPClient (a background process over ZMQ, the
default) or InprocClient (the same EngineCore stepped in the frontend's event loop, for
debugging: one thread, breakpoints work). Both hand every core message to `dispatch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec

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
        self.send(UtilityCall(call_id, method, list(args)))
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

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocClient(CoreClient):
    def __init__(self, model: str, tape: Any, engine_args: dict[str, Any]) -> None:
        super().__init__()
        from tokentape.engine.core.engine_core import EngineCore

        self.core = EngineCore(model, tape, engine_args)
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

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.core.shutdown()


class MPClient(CoreClient):
    """Starts `python -m tokentape.engine.core.proc` and waits until its engine is built."""

    def __init__(self, model: str, tape: Any, engine_args: dict[str, Any], startup_timeout_s: float = 900.0) -> None:
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
        setup = msgspec.msgpack.encode(CoreSetup(in_addr, out_addr, model, tape, engine_args))
        # The child imports this very package, wherever it was imported from here.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokentape.engine.core.proc"],
            stdin=subprocess.PIPE, env=env, start_new_session=True,
        )
        # Forgotten without shutdown(): end the core's stdin (it closes its tape and exits).
        self._finalizer = weakref.finalize(self, _abandon, self.proc, self._dir)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(len(setup).to_bytes(4, "little") + setup)
            self.proc.stdin.flush()  # stays open: its end tells the core the frontend is gone
            self.info = self._wait_ready(startup_timeout_s)
        except BaseException:
            self._close_process(timeout_s=5.0)
            raise

    def _wait_ready(self, timeout_s: float) -> CoreInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._pull.poll(100):
                msg = message_decoder.decode(self._pull.recv())
                if isinstance(msg, CoreReady):
                    return msg.info
                if isinstance(msg, CoreFailed):
                    raise rebuild_error((msg.error_type, msg.message))
                raise RuntimeError(f"engine core: unexpected first message {type(msg).__name__}")
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"the engine core process exited with status {code} before it was ready")
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
                    dispatch(CoreDead(f"the engine core process exited with status {code}"))
                    return
                continue
            # Everything that has arrived, in one wake of the loop (one message per step).
            while True:
                try:
                    data = recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = decode(data)
                dispatch(msg)
                if isinstance(msg, CoreDead):
                    return

    def send(self, msg: CoreRequest) -> None:
        if self._closed:
            from tokentape.engine.llm_engine import EngineDeadError

            raise EngineDeadError("the engine has been shut down")
        self._push.send(request_encoder.encode(msg))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Ask the core to close its tape and exit; wait for it (kill it past the timeout)."""
        if self._closed:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self._push.send(request_encoder.encode(UtilityCall(-1, SHUTDOWN, [])))
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
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
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
