"""The engine-core process: `python -m tokentape.engine.core.proc`, started by AsyncLLM.

It reads its CoreSetup (msgpack, length-prefixed) from stdin, builds the engine and its tape,
and serves over two ZMQ sockets: requests in (PULL), messages out (PUSH). Its stdin stays
open for its whole life: end of file means the frontend is gone, and the core closes the tape
and exits. A frontend that lets its core go writes FAREWELL first: the core then aborts what
is left, as a shutdown call does. Without it the frontend's process died (killed, or an
engine actor that crashed), and the core records that on the tape as an EngineError,
requests as they stand, so the tape says how the run ended. It runs in a process group of its
own (in the frontend's session), so a Ctrl-C or SIGTERM meant for the frontend's process group
does not reach it: the frontend decides when it stops.
"""

from __future__ import annotations

import gc
import os
import signal
import sys

import msgspec
import zmq

from tokentape.engine.core.messages import (
    FAREWELL,
    CoreFailed,
    CoreReady,
    error_of,
    request_decoder,
    setup_decoder,
)

_encode = msgspec.msgpack.Encoder().encode


def _read_setup() -> bytes:
    stdin = sys.stdin.buffer
    size = int.from_bytes(stdin.read(4), "little")
    data = stdin.read(size)
    if len(data) != size:
        raise EOFError("the frontend closed stdin before the setup was complete")
    return data


def serve(core: object, pull: zmq.Socket, push: zmq.Socket, stdin_fd: int) -> bool:
    """The loop: take every message that has arrived, step while there is work, send.
    Returns whether the frontend died (its stdin ended without FAREWELL)."""
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(stdin_fd, zmq.POLLIN)
    decode, send = request_decoder.decode, push.send
    farewell = False
    while True:
        events = dict(poller.poll(0 if core.has_work() else None))  # type: ignore[attr-defined]
        if stdin_fd in events:
            data = os.read(stdin_fd, 4096)
            if not data:
                return not farewell  # the frontend is gone
            farewell = farewell or FAREWELL in data
        requests = []
        while True:
            try:
                data = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                requests.append(decode(data))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # The frontend encodes only what it checked; a message that still does not
                # decode is dropped (it has no id to answer), and the engine serves on.
                print(
                    f"engine core: dropped a message that does not decode: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
        messages, done = core.run_once(requests)  # type: ignore[attr-defined]
        for msg in messages:
            send(_encode(msg))
        if done:
            return False


def main() -> int:
    # A background process group of the frontend's session: under `stty tostop`, a write to
    # the terminal (a warning on stderr) would stop this process; ignoring SIGTTOU lets it write.
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    setup = setup_decoder.decode(_read_setup())
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 10_000)  # the last messages reach the frontend before exit
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(setup.output_address)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(setup.input_address)
    try:
        from tokentape.engine.core.engine_core import EngineCore

        core = EngineCore(setup.model, setup.tape, setup.engine_args)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the frontend reports it
        push.send(_encode(CoreFailed(*error_of(exc))))
        pull.close(0)
        push.close()
        ctx.term()
        return 1
    # What the build made (torch, the model, the engine) lives as long as this process:
    # frozen, the full collections that the steps' short-lived objects set off pass over it
    # (as vLLM's engine core does). On the tiny model one took 24 ms, every 50-100 steps of
    # 256 requests; frozen, 0.04 ms. This process is the core's own: no caller's heap here.
    gc.collect()
    gc.freeze()
    push.send(_encode(CoreReady(core.info())))
    died = False
    try:
        died = serve(core, pull, push, sys.stdin.fileno())
    finally:
        if died:
            core.frontend_died()
        core.shutdown()  # idempotent: after a shutdown call, or when the frontend is gone
        pull.close(0)
        push.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
