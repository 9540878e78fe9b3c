"""How the server (api_server.run_server, for `tokentape serve`) starts and stops, as vLLM's
launcher.py: its listening socket bound before the engine is built (a port in use is an
error at once, exit 2), uvicorn's server announcing its address and handling the signals,
and the exit status of how it stopped.

Stopping: SIGTERM or Ctrl-C stops taking requests and lets those in flight finish for the
drain timeout; then the rest are aborted (their streams end with finish_reason "abort"),
and the engine core closes the tape within CORE_STOP_TIMEOUT_S (then it is told to stop
between steps, and killed past client.STOP_GRACE_S). SIGTERM then exits 0 (uvicorn would
re-raise it and die by the signal); Ctrl-C stays an interrupt (130). An engine core that
fails while serving makes the server stop as a SIGTERM does and exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from tokentape.entrypoints.cli.common import CLIError

EXIT_OK = 0
EXIT_ENGINE_FAILED = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
# Seconds the engine core gets, after the drain, to abort what is left and close its tape.
CORE_STOP_TIMEOUT_S = 5.0
# Seconds the streams aborted at the end of the drain get to send their last chunk and [DONE].
ABORT_FLUSH_S = 2.0


class StartupError(CLIError):
    """The server cannot start (its address cannot be bound): one line, exit 2."""


class StoppedBeforeServing(BaseException):
    """SIGTERM arrived while the engine was being built: stop cleanly, exit 0."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (uvicorn listens on it): a port in use fails here, before
    the engine is built, with one line naming the address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


@contextlib.contextmanager
def sigterm_stops_startup() -> Iterator[None]:
    """While the engine is built (before uvicorn handles signals), SIGTERM raises
    StoppedBeforeServing, so the half-built engine's core is stopped, not orphaned."""

    def stop(signum: int, frame: Any) -> None:
        raise StoppedBeforeServing()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def make_server(
    config: Any,
    drain_timeout_s: float,
    abort_all: Callable[[], Awaitable[object]],
    on_shutdown: Callable[[], None],
) -> Any:
    """uvicorn's Server, announcing the bound address (a --port 0 server's real port); on
    shutdown it lets requests finish for `drain_timeout_s`, then aborts the rest through the
    engine (their streams end with finish_reason "abort" and [DONE], not a cut connection;
    uvicorn cancels what is still open ABORT_FLUSH_S later), then closes the engine; it does
    not re-raise SIGTERM (the process exits 0 after a clean stop). uvicorn is imported here,
    not with the CLI."""
    import uvicorn

    config.timeout_graceful_shutdown = drain_timeout_s + ABORT_FLUSH_S

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and self.servers and self.servers[0].sockets:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"serving on http://{host}:{port}", file=sys.stderr, flush=True)

        async def shutdown(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(drain_timeout_s, lambda: loop.create_task(abort_all()))
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()
                on_shutdown()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                # uvicorn re-raises what it captured once it is done; SIGTERM has been
                # handled (drained, tape closed), so only an interrupt is passed on.
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    return Server(config)
