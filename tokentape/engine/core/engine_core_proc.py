"""EngineCoreProc, as vLLM V1's: an EngineCore served over its client's messages. It takes
requests, aborts and calls, steps while there is work, and sends back the deltas.

It runs in its own process (`python -m tokentape.engine.core.engine_core_proc`, started by
AsyncLLM's MPClient), serving over two ZMQ sockets, or in the front end's own event loop
(InprocClient, for debugging).

The process reads its CoreSetup (msgpack, length-prefixed) from stdin, builds the engine core
and its tape, and serves: requests in (PULL), messages out (PUSH). Its stdin stays open for its
whole life: end of file means the front end is gone, and the core closes the tape and exits.
A front end that lets its core go writes FAREWELL first: the core then aborts what is left, as
a shutdown call does. Without it the front end's process died (killed, or an engine actor that
crashed), and the core records that on the tape as an EngineError, requests as they stand, so
the tape says how the run ended. It runs in a process group of its own (in the front end's
session), so a Ctrl-C or SIGTERM meant for the front end's process group does not reach it:
the front end decides when it stops.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tokentape.engine.arg_utils import UsageContext, create_engine_config
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.core.messages import (
    FAREWELL,
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreFailed,
    CoreInfo,
    CoreMessage,
    CoreOutputs,
    CoreReady,
    CoreRequest,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
    error_of,
    request_decoder,
    setup_decoder,
)
from tokentape.engine.factory import build_engine_core
from tokentape.engine.outputs import EngineCoreOutput
from tokentape.errors import EngineDeadError
from tokentape.events.tape_path import TapeSpec
from tokentape.lora.request import LoRARequest

if TYPE_CHECKING:
    import zmq

SHUTDOWN = "shutdown"  # the call that ends the core

# A command (an add, an abort, a call) that raises is refused: its caller gets the error's
# type and message, and the engine serves on, unless the failure ended the engine (a broken
# tape, or a failure inside the recorded part of the command: then it is on the tape).
# A failure inside a step is always fatal.


def load_weights_arg(arg: object) -> object:
    """update_weights's argument as it travels: a folder path, safetensors bytes, or a
    bucket's update_info (a small dict: its tensors are in shared memory)."""
    if isinstance(arg, bytes):
        from safetensors.torch import load

        return load(arg)
    return arg


class EngineCoreProc:
    """An EngineCore (built here, through the engine factory) and the handling of its
    client's messages: `run_once` takes what arrived, steps, and returns what to send."""

    def __init__(
        self,
        model: str,
        tape: TapeSpec,
        engine_args: dict[str, Any],
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
    ) -> None:
        self.engine_core: EngineCore = build_engine_core(
            create_engine_config(model, engine_args, usage_context), tape
        )
        self._closed = False
        self._calls: dict[str, Callable[..., Any]] = {
            "pause_generation": self.engine_core.pause_generation,
            "resume_generation": self.engine_core.resume_generation,
            "is_paused": self.engine_core.is_paused,
            "reset_prefix_cache": self.engine_core.reset_prefix_cache,
            "update_weights": lambda w, version=None: self.engine_core.update_weights(
                load_weights_arg(w), version
            ),
            "init_weight_transfer_engine": self.engine_core.init_weight_transfer_engine,
            "start_weight_update": self.engine_core.start_weight_update,
            "finish_weight_update": self.engine_core.finish_weight_update,
            "get_weight_version": self.engine_core.get_weight_version,
            "sleep": self.engine_core.sleep,
            "wake_up": self.engine_core.wake_up,
            "is_sleeping": self.engine_core.is_sleeping,
            "abort_all": self.engine_core.abort_all,
            "collective_rpc": self.collective_rpc,
            "add_lora": self.add_lora,
            "remove_lora": self.engine_core.remove_lora,
            "list_loras": lambda: sorted(self.engine_core.list_loras()),
        }

    def add_lora(self, lora_request: object) -> bool:
        """EngineCore.add_lora, the LoRARequest as it crossed (msgpack: its fields)."""
        if not isinstance(lora_request, LoRARequest):
            try:
                lora_request = msgspec.convert(lora_request, LoRARequest)
            except msgspec.ValidationError as exc:
                raise TypeError(f"add_lora: not a LoRARequest ({exc})") from None
        return self.engine_core.add_lora(lora_request)

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """EngineCore.collective_rpc, its results checked to travel back (msgpack: plain
        values; a tensor does not)."""
        results = self.engine_core.collective_rpc(method, timeout, tuple(args), kwargs)
        try:
            msgspec.msgpack.encode(results)
        except TypeError as exc:
            raise TypeError(
                f"collective_rpc: {method!r} ran (it is on the tape), but its result cannot "
                f"travel back to the front end ({exc}); return plain values"
            ) from None
        return results

    def info(self) -> CoreInfo:
        e = self.engine_core
        return CoreInfo(
            e.runner.model_id,
            e.runner.vocab_size,
            e.config.effective_max_model_len,
            e.runner.eos_token_id,
            e.tape.path,
            os.getpid(),
        )

    def stats(self) -> SchedulerStats:
        e = self.engine_core
        s, kv = e.state, e.kv
        return SchedulerStats(
            len(s.running),
            len(s.waiting),
            s.paused is not None,
            s.step,
            kv.num_used_blocks / kv.num_blocks if kv.num_blocks else 0.0,
            e.num_preemptions,
            s.sleep_level is not None,
        )

    @property
    def is_paused(self) -> bool:
        return self.engine_core.is_paused()

    def has_work(self) -> bool:
        """Whether stepping can make progress (a paused engine schedules nothing)."""
        return self.engine_core.has_unfinished_requests() and not self.engine_core.is_paused()

    def add_request(self, req: AddRequest) -> EngineCoreOutput | None:
        """Add a request (for n > 1 its children "{i}_{id}", whose deltas the frontend's
        output processor gathers); a refused one (checked before anything is recorded) comes
        back as an error output. EngineDeadError: the add ended the engine (on the tape)."""
        try:
            self.engine_core.add_request(
                req.request_id, req.prompt_token_ids, req.params, req.lora_request
            )
        except Exception as exc:  # noqa: BLE001 - any refusal goes back to its caller
            self._raise_if_dead()
            return EngineCoreOutput(req.request_id, [], error=error_of(exc))
        return None

    def abort(self, request_ids: list[str]) -> None:
        requests = self.engine_core.state.requests
        for req_id in request_ids:
            req = requests.get(req_id)
            if req is not None and not req.is_finished:  # unknown or done: nothing to abort
                self.engine_core.abort_request(req_id)

    def call(self, method: str, args: list[Any]) -> Any:
        fn = self._calls.get(method)
        if fn is None:
            raise ValueError(f"unknown engine call {method!r}")
        return fn(*args)

    def run_once(self, requests: list[CoreRequest]) -> tuple[list[CoreMessage], bool]:
        """Handle the requests that arrived, in order, then step if there is work: the
        messages for the frontend, and whether the core is done (shut down or dead)."""
        messages: list[CoreMessage] = []
        pending: list[EngineCoreOutput] = []
        try:
            for msg in requests:
                if isinstance(msg, AddRequest):
                    refused = self.add_request(msg)
                    if refused is not None:
                        pending.append(refused)
                elif isinstance(msg, AbortRequests):
                    self._abort_quietly(msg.request_ids)
                elif isinstance(msg, UtilityCall):
                    if msg.method == SHUTDOWN:
                        self.shutdown()
                        done = UtilityResult(msg.call_id, True)
                        messages.append(CoreOutputs(pending, self.stats(), done))
                        return messages, True
                    result = self._call(msg)
                    # What the call produced (a pause's drained tokens) goes before its answer.
                    if self.is_paused:
                        pending += self.step()
                    messages.append(CoreOutputs(pending, self.stats(), result))
                    pending = []
            if self.has_work() or requests:
                pending += self.step()
        except Exception as exc:  # noqa: BLE001 - the engine failed: on the tape, nothing more
            messages.append(CoreDead(self._record_failure(exc)))
            return messages, True
        if pending:
            messages.append(CoreOutputs(pending, self.stats()))
        return messages, False

    def _raise_if_dead(self) -> None:
        """After a command raised: re-raise as fatal when it ended the engine."""
        reason = self.engine_core.dead_reason
        if reason is not None:
            raise EngineDeadError(f"the engine failed earlier and cannot continue: {reason}")

    def _abort_quietly(self, request_ids: list[str]) -> None:
        """An abort has no caller waiting for an answer: a refused one changes nothing."""
        try:
            self.abort(request_ids)
        except Exception:  # noqa: BLE001 - refused, unless it ended the engine
            self._raise_if_dead()

    def _record_failure(self, exc: Exception) -> str:
        """A fatal failure, on the tape as an EngineError whatever raised it (the engine's own
        recorded part has put it there already), with the requests as they stand."""
        if isinstance(exc, EngineDeadError):
            return str(exc)
        if self.engine_core.dead_reason is None:
            with contextlib.suppress(Exception):  # a tape that cannot take it is dead already
                self.engine_core.fail(type(exc).__name__, f"engine core: {exc}")
        return f"{type(exc).__name__}: {exc}"

    def _call(self, msg: UtilityCall) -> UtilityResult:
        try:
            return UtilityResult(msg.call_id, self.call(msg.method, msg.args))
        except Exception as exc:  # noqa: BLE001 - refused; the engine serves on unless it ended
            self._raise_if_dead()
            return UtilityResult(msg.call_id, None, error_of(exc))

    def step(self) -> list[EngineCoreOutput]:
        """One engine step; the deltas of every request that got output."""
        return self.engine_core.step()

    def frontend_died(self) -> None:
        """The frontend's process died (killed, or the actor that held it crashed): record it on
        the tape, with the requests as they stand, when any is unfinished. The engine serves no
        more; `shutdown` then closes the tape as it stands."""
        engine = self.engine_core
        if not self._closed and engine.has_unfinished_requests():
            with contextlib.suppress(Exception):  # a broken tape: shutdown closes what it can
                engine.fail(
                    "FrontendDied",
                    "the frontend (AsyncLLM) went away without shutdown(), with "
                    f"{engine.get_num_unfinished_requests()} request(s) unfinished: its "
                    "process died or was killed",
                )

    def shutdown(self) -> None:
        """Abort what is left (on the tape), apply the frames still in flight, close the tape.
        Idempotent; a dead engine's tape is closed as it stands."""
        if self._closed:
            return
        self._closed = True
        engine = self.engine_core
        try:
            if engine.has_unfinished_requests() and engine.dead_reason is None:
                self.abort([r.req_id for r in engine.state.unfinished])
                for _ in range(engine.depth + 2):  # the in-flight steps, then nothing
                    if not engine.has_unfinished_requests():
                        break
                    engine.step()
        except Exception as exc:  # noqa: BLE001 - on the tape; the tape is closed all the same
            self._record_failure(exc)
        finally:
            self.engine_core.close()


# -- the process ------------------------------------------------------------------------------

_encode = msgspec.msgpack.Encoder().encode


def _read_setup() -> bytes:
    stdin = sys.stdin.buffer
    size = int.from_bytes(stdin.read(4), "little")
    data = stdin.read(size)
    if len(data) != size:
        raise EOFError("the frontend closed stdin before the setup was complete")
    return data


def serve(core: EngineCoreProc, pull: zmq.Socket, push: zmq.Socket, stdin_fd: int) -> bool:
    """The loop: take every message that has arrived, step while there is work, send.
    Returns whether the frontend died (its stdin ended without FAREWELL)."""
    import zmq  # pyzmq: the `serve` extra, needed only by a core in its own process

    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(stdin_fd, zmq.POLLIN)
    decode, send = request_decoder.decode, push.send
    farewell = False
    while True:
        events = dict(poller.poll(0 if core.has_work() else None))
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
        messages, done = core.run_once(requests)
        for msg in messages:
            send(_encode(msg))
        if done:
            return False


def main() -> int:
    # A background process group of the frontend's session: under `stty tostop`, a write to
    # the terminal (a warning on stderr) would stop this process; ignoring SIGTTOU lets it write.
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    setup = setup_decoder.decode(_read_setup())
    import zmq

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 10_000)  # the last messages reach the frontend before exit
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(setup.output_address)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(setup.input_address)
    try:
        core = EngineCoreProc(
            setup.model, setup.tape, setup.engine_args, UsageContext(setup.usage_context)
        )
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
