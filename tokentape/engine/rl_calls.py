"""LLMEngine's RL calls, as a mixin of LLMEngine: vLLM's pause and resume
(`pause_generation`, `resume_generation`, `is_paused`), `reset_prefix_cache`, its sleep mode
(`sleep`, `wake_up`, `is_sleeping`) and `abort_all`. The weight updates are weight_updates.py's.

`pause_generation(mode, clear_cache)` is vLLM's: "abort" aborts every request, "wait" admits
nothing new and lets the running requests finish, "keep" schedules nothing and keeps every
request; the steps in flight are applied (their tokens go out with the next `step()`), then,
with `clear_cache`, the running requests are preempted and the prefix cache is reset.

`sleep(level, mode)` is vLLM's: a pause in `mode` ("abort" by default, as vLLM's: every
request is aborted; "keep" keeps them for after the wake-up; "wait" lets the running ones
finish) that drains every step in flight and, at level >= 1, resets the prefix cache with the
running requests preempted (their KV is about to go: they are recomputed after the wake-up);
then the runner releases its memory (runners/sleep_memory.py) and the engine records
EngineSlept, with nothing in flight. While it sleeps no step runs: requests that arrive are
recorded and queued, and are served after the wake-up; `resume_generation` and
`pause_generation` are refused. `wake_up(tags)` restores what the tags name ("weights",
"kv_cache"; None: everything); once nothing sleeps it resumes generation, recorded as
GenerationResumed. Unlike vLLM before its partial-wake fix, a wake-up of the weights alone
does not resume scheduling against a KV cache that is not there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokentape.engine.hooks import EngineHooks
from tokentape.engine.kv_cache_manager import KVCacheManager
from tokentape.engine.runners.base import ModelRunner, SleepsMemory
from tokentape.engine.scheduler import Scheduler
from tokentape.errors import EngineDeadError
from tokentape.events import schema as ev
from tokentape.events.state import EngineState
from tokentape.events.store import TapeWriter
from tokentape.events.validation import check_bool, check_int, shown

PAUSE_MODES = ("abort", "wait", "keep")


def check_sleep_args(level: object, mode: object) -> None:
    """vLLM's sleep arguments, refused before anything is sent or recorded."""
    check_int("level", level, 0, 2)
    if mode not in PAUSE_MODES:
        raise ValueError(f"sleep: mode must be one of {PAUSE_MODES}, got {mode!r}")


def check_wake_tags(tags: object) -> list[str] | None:
    """wake_up's tags as a list (None: every tag), each one of schema.WAKE_TAGS."""
    if tags is None:
        return None
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Sequence):
        raise TypeError(f"wake_up: tags must be a list of strings or None, got {shown(tags)}")
    for tag in tags:
        if tag not in ev.WAKE_TAGS:
            raise ValueError(f"wake_up: unknown tag {tag!r}; the tags are {list(ev.WAKE_TAGS)}")
    return list(tags)


class RLCalls:
    """Pause, resume, prefix-cache reset, sleep mode and abort-all for LLMEngine (which
    inherits them)."""

    if TYPE_CHECKING:  # what they use of LLMEngine (mypy checks it defines them alike)
        state: EngineState
        runner: ModelRunner
        tape: TapeWriter
        _dead: str | None
        _children: dict[str, list[str]]
        hooks: Sequence[EngineHooks]
        scheduler: Scheduler
        kv: KVCacheManager

        def _emit(self, event: ev.Event) -> None: ...
        def _recorded(self) -> contextlib.AbstractContextManager[None]: ...
        def one_commit(self) -> contextlib.AbstractContextManager[None]: ...
        def _step_once(self) -> None: ...
        def _apply_oldest_frame(self) -> None: ...
        def abort_request(self, request_id: str) -> None: ...
        def check_no_open_transfer(self, call: str) -> None: ...

    def is_paused(self) -> bool:
        return self.state.paused is not None

    def pause_generation(self, mode: str = "keep", clear_cache: bool = True) -> None:
        """Pause as vLLM does and return once the engine has drained.

        abort: abort every request; wait: admit nothing new and let the running requests
        finish; keep: schedule nothing and keep every request for later. In-flight steps are
        applied (their tokens are delivered by the next `step()`), then, with `clear_cache`,
        running requests are preempted and the prefix cache is reset.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode must be one of {PAUSE_MODES}, got {mode!r}")
        check_bool("clear_cache", clear_cache)
        self.check_awake("pause_generation")
        for hook in self.hooks:
            hook.before_pause()
        with self._recorded():
            self._emit(ev.GenerationPaused(self.state.step, mode, clear_cache))  # type: ignore[arg-type]
            if mode == "abort":
                for req in self.state.unfinished:
                    self.scheduler.finish(req, "abort")
            elif mode == "wait":
                while self.state.running:
                    self._step_once()
            if all(hook.drains_on_pause() for hook in self.hooks):
                while self.state.in_flight_steps:
                    self._apply_oldest_frame()
            if clear_cache and all(hook.clears_cache_on_pause() for hook in self.hooks):
                self._reset_prefix_cache(reset_running_requests=True)
        self.tape.flush()  # a paused engine's tape is complete in the file

    def resume_generation(self) -> None:
        if self.state.paused is None:
            return
        self.check_awake("resume_generation")  # wake_up() resumes a sleeping engine
        self.check_no_open_transfer("resume_generation")
        with self._recorded():
            self._emit(ev.GenerationResumed(self.state.step))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache. Fails (False) while blocks are in use, unless running
        requests are reset, in which case every running request is preempted first."""
        check_bool("reset_running_requests", reset_running_requests)  # a bool on the tape, not 1
        with self._recorded():
            return self._reset_prefix_cache(reset_running_requests)

    def _reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        # Waiting requests hold no blocks, so preempting every running one frees them all.
        ok = reset_running_requests or self.kv.num_used_blocks == 0
        self._emit(ev.PrefixCacheReset(self.state.step, reset_running_requests, ok))
        if reset_running_requests:
            requests = self.state.requests
            while self.state.running:
                self.scheduler.preempt(requests[self.state.running[-1]], "reset_prefix_cache")
        if ok and not self.kv.reset_prefix_cache():
            raise RuntimeError("KV blocks still in use after every running request was preempted")
        return ok

    def is_sleeping(self) -> bool:
        """vLLM's: True while the engine sleeps at any level, a pause included (vLLM's sleep
        level 0 is a pause; `wake_up` then resumes it)."""
        return self.state.sleep_level is not None or self.state.paused is not None

    def check_awake(self, call: str) -> None:
        """Refuse a call that cannot run while the engine sleeps, before it records anything."""
        if self.state.sleep_level is not None:
            raise RuntimeError(
                f"{call}: the engine sleeps (level {self.state.sleep_level}); call wake_up() first"
            )

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep: pause in `mode` and drain, then release the memory (level 1: the
        weights offloaded to the host and the KV cache dropped; level 2: both dropped; level
        0: nothing, scheduling only). Returns once asleep; already asleep, it does nothing,
        as vLLM's."""
        check_sleep_args(level, mode)
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed earlier and cannot continue: {self._dead}")
        if self.state.sleep_level is not None:
            return
        if isinstance(self.runner, SleepsMemory):
            self.runner.check_sleep(level)
        self.pause_generation(mode, clear_cache=level >= 1)
        self.fall_asleep(level)

    def fall_asleep(self, level: int) -> None:
        """The end of `sleep`, once paused and drained: release the memory and record it
        (verify replays EngineSlept with this call; its pause replays on its own)."""
        state = self.state
        drained = not state.in_flight_steps or not all(h.drains_on_pause() for h in self.hooks)
        if state.paused is None or not drained or state.sleep_level is not None:
            raise RuntimeError("fall_asleep: only once paused and drained, awake (sleep() does it)")
        with self._recorded():
            in_flight = [s.step for s in state.in_flight_steps]
            kept = [r.req_id for r in state.unfinished]
            self._emit(ev.EngineSlept(state.step, level, in_flight, kept))
            if isinstance(self.runner, SleepsMemory):
                self.runner.sleep(level)
        self.tape.flush()  # a sleeping engine's tape is complete in the file

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up: restore what `tags` name (None: everything) and, once nothing
        sleeps, resume generation (refused, as resume_generation is, while a chunked weight
        transfer is open). On an engine that is only paused it resumes it, as vLLM's; on one
        that is neither it does nothing. The runner restores before anything is recorded: a
        wake-up it refuses (a checkpoint folder gone) leaves the engine asleep."""
        wanted = check_wake_tags(tags)
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed earlier and cannot continue: {self._dead}")
        state = self.state
        if state.sleep_level is None:
            self.resume_generation()
            return
        waking = [t for t in state.sleeping_tags if wanted is None or t in wanted]
        if len(waking) == len(state.sleeping_tags):  # it resumes generation: as resume's rule
            self.check_no_open_transfer("wake_up")
        weights_id = None
        if waking and isinstance(self.runner, SleepsMemory):
            weights_id = self.runner.wake_up(waking)
        with self._recorded():
            self._emit(ev.EngineWokeUp(state.step, wanted, weights_id))
            if state.sleep_level is None:
                self._emit(ev.GenerationResumed(state.step))

    def abort_all(self) -> list[str]:
        """Abort every unfinished request, on the tape (a RequestAborted each, as
        `abort_request`); the ids aborted, as they were added (a request of n > 1 once, for
        its children). Frames in flight for them are discarded when they come back."""
        unfinished = self.state.unfinished
        if not unfinished:
            return []
        parent_of = {c: p for p, children in self._children.items() for c in children}
        aborted: dict[str, None] = {}
        with self.one_commit():  # each abort as abort_request records it (verify replays it)
            for req in unfinished:
                self.abort_request(req.req_id)
                aborted[parent_of.get(req.req_id, req.req_id)] = None
        return list(aborted)
