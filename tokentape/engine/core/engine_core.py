"""EngineCore: the engine behind AsyncLLM, as vLLM V1's EngineCore. It owns the LLMEngine and
its tape, takes requests, aborts and calls, steps, and hands back token deltas.

The same class runs in the background process (`tokentape.engine.core.proc`) and in the
frontend's own event loop (the in-process mode, for debugging).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from tokentape.engine.config import EngineConfig
from tokentape.engine.core.messages import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreInfo,
    CoreMessage,
    CoreOutputs,
    CoreRequest,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
    error_of,
)
from tokentape.engine.factory import build_engine
from tokentape.engine.outputs import EngineCoreOutput
from tokentape.errors import EngineDeadError
from tokentape.events.tape_path import TapeSpec

SHUTDOWN = "shutdown"  # the call that ends the core

# A command (an add, an abort, a call) that raises is refused: its caller gets the error's
# type and message, and the engine serves on, unless the failure ended the engine (a broken
# tape, or a failure inside the recorded part of the command: then it is on the tape).
# A failure inside a step is always fatal.


def load_weights_arg(arg: object) -> object:
    """update_weights's argument as it travels: a folder path, or safetensors bytes."""
    if isinstance(arg, bytes):
        from safetensors.torch import load

        return load(arg)
    return arg


class EngineCore:
    def __init__(self, model: str, tape: TapeSpec, engine_args: dict[str, Any]) -> None:
        self.engine = build_engine(EngineConfig(model=model, **engine_args), tape)
        self._closed = False
        self._calls: dict[str, Callable[..., Any]] = {
            "pause_generation": self.engine.pause_generation,
            "resume_generation": self.engine.resume_generation,
            "is_paused": self.engine.is_paused,
            "reset_prefix_cache": self.engine.reset_prefix_cache,
            "update_weights": lambda w, version=None: self.engine.update_weights(
                load_weights_arg(w), version
            ),
            "start_weight_update": self.engine.start_weight_update,
            "finish_weight_update": self.engine.finish_weight_update,
            "get_weight_version": self.engine.get_weight_version,
            "sleep": self.engine.sleep,
            "wake_up": self.engine.wake_up,
            "is_sleeping": self.engine.is_sleeping,
            "abort_all": self.engine.abort_all,
        }

    def info(self) -> CoreInfo:
        e = self.engine
        return CoreInfo(
            e.runner.model_id,
            e.runner.vocab_size,
            e.config.effective_max_model_len,
            e.runner.eos_token_id,
            e.tape.path,
            os.getpid(),
        )

    def stats(self) -> SchedulerStats:
        e = self.engine
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
        return self.engine.is_paused()

    def has_work(self) -> bool:
        """Whether stepping can make progress (a paused engine schedules nothing)."""
        return self.engine.has_unfinished_requests() and not self.engine.is_paused()

    def add_request(self, req: AddRequest) -> EngineCoreOutput | None:
        """Add a request (for n > 1 its children "{i}_{id}", whose deltas the frontend's
        output processor gathers); a refused one (checked before anything is recorded) comes
        back as an error output. EngineDeadError: the add ended the engine (on the tape)."""
        try:
            self.engine.add_core_request(req.request_id, req.prompt_token_ids, req.params)
        except Exception as exc:  # noqa: BLE001 - any refusal goes back to its caller
            self._raise_if_dead()
            return EngineCoreOutput(req.request_id, [], error=error_of(exc))
        return None

    def abort(self, request_ids: list[str]) -> None:
        requests = self.engine.state.requests
        for req_id in request_ids:
            req = requests.get(req_id)
            if req is not None and not req.is_finished:  # unknown or done: nothing to abort
                self.engine.abort_request(req_id)

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
        reason = self.engine.dead_reason
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
        if self.engine.dead_reason is None:
            with contextlib.suppress(Exception):  # a tape that cannot take it is dead already
                self.engine.fail(type(exc).__name__, f"engine core: {exc}")
        return f"{type(exc).__name__}: {exc}"

    def _call(self, msg: UtilityCall) -> UtilityResult:
        try:
            return UtilityResult(msg.call_id, self.call(msg.method, msg.args))
        except Exception as exc:  # noqa: BLE001 - refused; the engine serves on unless it ended
            self._raise_if_dead()
            return UtilityResult(msg.call_id, None, error_of(exc))

    def step(self) -> list[EngineCoreOutput]:
        """One engine step; the deltas of every request that got output."""
        return self.engine.step_core()

    def frontend_died(self) -> None:
        """The frontend's process died (killed, or the actor that held it crashed): record it on
        the tape, with the requests as they stand, when any is unfinished. The engine serves no
        more; `shutdown` then closes the tape as it stands."""
        engine = self.engine
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
        engine = self.engine
        try:
            if engine.has_unfinished_requests() and engine.dead_reason is None:
                self.abort([r.req_id for r in engine.state.unfinished])
                for _ in range(engine.depth + 2):  # the in-flight steps, then nothing
                    if not engine.has_unfinished_requests():
                        break
                    engine.step_core()
        except Exception as exc:  # noqa: BLE001 - on the tape; the tape is closed all the same
            self._record_failure(exc)
        finally:
            self.engine.close()
