"""EngineCore, as vLLM V1's: the loop that ties decide, evolve, tape and runner together.
It schedules a step, hands it to the runner, folds the frame that comes back into the state,
lets the scheduler finish the requests the frame brought to a stop (its update_from_output:
the one place a finish is decided, stop strings included), and emits the per-request deltas
(`EngineCoreOutput`) a front end's output processor turns into `RequestOutput`s. It also
takes the engine-level calls: requests added and aborted, pause and resume, prefix-cache
resets, the sleep mode, abort-all and weight updates.

Every state change goes the same way: the core (or its scheduler) builds an event, appends it
to the tape, and applies it through the reducer. The tape is committed at every step boundary
and after every command, so a killed process leaves a tape that verifies up to its last
completed step.

Pause and resume are vLLM's: `pause_generation(mode, clear_cache)` with mode "abort" (abort
every request), "wait" (admit nothing new, let the running requests finish) or "keep"
(schedule nothing, keep every request); the steps in flight are applied (their tokens go out
with the next `step()`), then, with `clear_cache`, the running requests are preempted and the
prefix cache is reset.

The sleep mode is vLLM's: `sleep(level, mode)` pauses in `mode` ("abort" by default) and
drains every step in flight; at level >= 1 it resets the prefix cache with the running
requests preempted (their KV is about to go: they are recomputed after the wake-up); then the
runner releases its memory (runners/sleep_memory.py) and the core records EngineSlept. While
it sleeps no step runs: requests that arrive are recorded and queued. `wake_up(tags)` restores
what the tags name ("weights", "kv_cache"; None: everything); once nothing sleeps it resumes
generation. A wake-up of the weights alone does not resume scheduling against a KV cache that
is not there (vLLM's partial-wake bug, #44395).

Weight updates are whole (`update_weights(weights)`) or chunked as vLLM's native transfer
(`start_weight_update()`, `update_weights(chunk)` per chunk, `finish_weight_update()`), each
named by a weight version (vLLM's `weight_version`: given, or the update's number). Every
call is checked before anything is recorded: the engine must be paused with nothing in
flight, a chunk's tensors must be the model's by name and shape (the runner holds them,
loading nothing until the finish, so the old weights serve until then), and a transfer left
open is refused at `resume_generation`. The tape has `WeightUpdateStarted`, a
`WeightChunkReceived` per chunk (names, shapes and SHA-256s; not the tensors) and
`WeightsUpdated` with the final SHA-256 and the version. With a `weight_transfer_config`
(vLLM's weight transfer engine, weight_transfer.py: "shm", shared memory), a chunk may also
come as a bucket's update_info, after `init_weight_transfer_engine`: the same chunk, its
tensors read from the trainer's shared-memory block.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from tokentape.engine.bad_words import has_text_bad_words
from tokentape.engine.config import EngineConfig
from tokentape.engine.core.call_args import (
    check_pause_mode,
    check_sleep_args,
    check_wake_tags,
    resolve_version,
)
from tokentape.engine.core.core_outputs import pending_outputs
from tokentape.engine.core.kv_cache_manager import KVCacheManager
from tokentape.engine.core.scheduler import Scheduler
from tokentape.engine.outputs import EngineCoreOutput
from tokentape.engine.parallel_sampling import child_params, child_request_id
from tokentape.engine.request_checks import check_request, resolved_bad_words
from tokentape.engine.runners.base import (
    ChecksParams,
    ModelRunner,
    RunsWorkerCalls,
    ScheduledBatch,
    ServesLoRA,
    SleepsMemory,
    UpdatesWeights,
)
from tokentape.engine.stop_strings import StopStringChecker
from tokentape.engine.tokenizer import Tokenizer
from tokentape.engine.weight_transfer import ShmWeightTransferEngine, is_update_info
from tokentape.engine.worker import args_digest, resolve_method, worker_class
from tokentape.errors import EngineDeadError, LoRAError, WorkerCallRefused
from tokentape.events import schema as ev
from tokentape.events.reducer import evolve, initial_state
from tokentape.events.schema import SamplingParams
from tokentape.events.snapshot import take_snapshot
from tokentape.events.store import TakesSnapshots, TapeWriter
from tokentape.events.validation import check_bool, shown
from tokentape.lora.request import LoRARequest


class EngineCore:
    """The engine's inner loop: it owns the engine's state (the reducer's, changed only
    through `_emit`), the KV cache manager, the scheduler, the runner and the tape writer.
    Commands and steps go on the tape before they take effect; `step` gives the per-request
    deltas of the requests that got tokens or finished. The runner's optional capabilities
    (runners.base: ChecksParams, UpdatesWeights, SleepsMemory) are read once, here.

    Upstream bugs are injected by a subclass the factory builds for an engine with faults
    (fault_hooks.FaultInjectingEngineCore, with its own scheduler): this one has no fault
    path at all."""

    scheduler_class: type[Scheduler] = Scheduler

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tape: TapeWriter,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if not config.is_resolved:  # the factory resolves it for the runner, once
            raise ValueError(
                "EngineCore takes a config resolved for its runner: build it with "
                "engine.factory.build_engine_core"
            )
        self.config = config
        self.runner = runner
        # The runner's optional capabilities, checked once (runners/base.py's Protocols).
        self.params_checker: ChecksParams | None = (
            runner if isinstance(runner, ChecksParams) else None
        )
        self.weights_updater: UpdatesWeights | None = (
            runner if isinstance(runner, UpdatesWeights) else None
        )
        self.worker_calls: RunsWorkerCalls | None = (
            runner if isinstance(runner, RunsWorkerCalls) else None
        )
        self.lora_runner: ServesLoRA | None = (
            runner if isinstance(runner, ServesLoRA) and config.enable_lora else None
        )
        # vLLM's weight transfer engine (weight_transfer.py): how a bucket's tensors arrive.
        transfer = config.weight_transfer_config
        self.weight_transfer = None if transfer is None else ShmWeightTransferEngine(transfer)
        # vLLM's worker, with the RL framework's class mixed in: collective_rpc calls it.
        self.worker = worker_class(config.worker_extension_cls)(runner)
        self.tape = tape
        self.tokenizer = tokenizer
        # Stop strings need text (check_request refuses them without a tokenizer).
        self.stop_strings = StopStringChecker(tokenizer) if tokenizer is not None else None
        self.depth = config.effective_pipeline_depth
        self.state = initial_state(
            config.discard_policy,
            self.depth > 1,
            runner.eos_token_id,
            config.effective_max_model_len,
            config.faults,
        )
        num_blocks = config.num_kv_blocks
        assert num_blocks is not None  # resolved
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = self.scheduler_class(
            config, self.kv, self.state, self._emit, self.stop_strings
        )
        self._finished_since_last_batch: list[str] = []
        # Deltas produced outside step() (e.g. by a drain), handed out by the next step.
        self._ready: list[EngineCoreOutput] = []
        self._dead: str | None = None
        self._commits_held = 0  # inside one_commit(): the calls share one tape commit
        self.num_preemptions = 0  # RequestPreempted events emitted (vLLM's preemption metric)
        # n > 1: each parent's children on the tape (the output processor gathers them).
        self._children: dict[str, list[str]] = {}
        if isinstance(tape, TakesSnapshots):  # a segmented tape: each segment opens with one
            tape.bind_snapshots(self.snapshot)

    # -- the one way state changes ---------------------------------------------------------------

    def _emit(self, event: ev.Event) -> None:
        self.tape.append(event)
        evolve(self.state, event)
        if isinstance(event, (ev.RequestFinished, ev.RequestAborted)):
            self._finished_since_last_batch.append(event.req_id)
            req = self.state.requests[event.req_id]
            if req.has_stop_strings and self.stop_strings is not None:
                self.stop_strings.finish(req)
        elif isinstance(event, ev.RequestPreempted):
            self.num_preemptions += 1  # for the server's metrics

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed earlier and cannot continue: {self._dead}")

    @contextlib.contextmanager
    def _recorded(self) -> Iterator[None]:
        """Run an engine operation, deliver the outputs it produced and commit; record any
        internal failure on the tape, then re-raise."""
        self._check_alive()
        try:
            yield
            self._flush_outputs()  # whatever the operation finished or produced, deliver it
            # A tape that cannot be written ends the run too: the state would outgrow its record.
            if not self._commits_held:
                self.tape.commit()
        except BaseException as exc:
            self._dead = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                self.tape.append(ev.EngineError(self.state.step, type(exc).__name__, str(exc)))
                self.tape.flush()  # in the file before the exception propagates
            raise

    @contextlib.contextmanager
    def one_commit(self) -> Iterator[None]:
        """The engine calls made inside go to the tape as one commit, at the end: one client
        call made of many (LLM.generate's adds), one message to the tape writer rather than
        one a request (half of a tiny run's tape messages were adds)."""
        self._commits_held += 1
        try:
            yield
        finally:
            self._commits_held -= 1
            if not self._commits_held and self._dead is None:
                self.tape.commit()

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> list[str]:
        """Record a request, or for n > 1 its n children (parallel_sampling.py), all checked
        before any is recorded; the engine request ids, in index order. Their deltas come
        from `step()`. With `lora_request` it runs with that adapter, loaded first
        (add_lora) unless it is loaded already."""
        self.check_request(request_id, prompt_token_ids, params)
        resolved = self._with_extra_eos(self._resolve_bad_words(request_id, params))
        lora_int_id = 0
        if lora_request is not None:
            self.add_lora(lora_request)  # the request's last check (it records, if not loaded)
            lora_int_id = lora_request.lora_int_id
        if params.n == 1:
            children = [(request_id, resolved)]
        else:
            children = [
                (
                    child_request_id(i, request_id),
                    child_params(resolved, i, self.config.seed, prompt_token_ids),
                )
                for i in range(params.n)
            ]
            self._children[request_id] = [child_id for child_id, _ in children]
        with self._recorded():
            for child_id, child in children:
                self._emit(
                    ev.RequestAdded(
                        self.state.step, child_id, list(prompt_token_ids), child, lora_int_id
                    )
                )
        return [child_id for child_id, _ in children]

    def _resolve_bad_words(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """String bad words as token ids, encoded by this engine's tokenizer (bad_words.py)."""
        if not has_text_bad_words(params):
            return params
        return resolved_bad_words(self, request_id, params)

    def _with_extra_eos(self, params: SamplingParams) -> SamplingParams:
        """The model's other EOS ids join the request's stop_token_ids (unless ignore_eos), as
        vLLM adds a generation config's; recorded so, the tape replays without the model."""
        extra = [i for i in self.runner.extra_eos_token_ids if i not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return msgspec.structs.replace(params, stop_token_ids=(*params.stop_token_ids, *extra))

    def check_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Refuse a request the engine could not serve or the tape could not hold, or whose
        per-step work would exceed the limits, before anything is recorded (request_checks.py;
        SamplingParams checked its own fields when it was built)."""
        check_request(self, request_id, prompt_token_ids, params)

    def has_parent(self, request_id: str) -> bool:
        """Whether `request_id` is an unfinished request of n > 1 (its children run)."""
        children = self._children.get(request_id)
        if children is None:
            return False
        requests = self.state.requests
        if all(requests[c].is_finished for c in children):  # done: its id is free again
            del self._children[request_id]
            return False
        return True

    def abort_request(self, request_id: str) -> None:
        if self.has_parent(request_id):  # n > 1: abort its children
            for child_id in self._children[request_id]:
                self.abort_request(child_id)
            return
        req = self.state.requests.get(request_id)
        if req is None:
            raise KeyError(f"abort_request: unknown request id {request_id!r}")
        if req.is_finished:
            return  # finishing and aborting raced; nothing left to abort
        with self._recorded():
            self.scheduler.finish(req, "abort")

    def has_unfinished_requests(self) -> bool:
        s = self.state
        return bool(s.waiting or s.running or s.in_flight_steps or self._ready)

    def get_num_unfinished_requests(self) -> int:
        return len(self.state.waiting) + len(self.state.running)

    # -- stepping ------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule one step and, once the pipeline is full (or idle), apply the oldest frame:
        the new tokens of every request that got some or finished (what `OutputsEmitted`
        records), for an output processor."""
        with self._recorded():
            self._step_once()
        ready, self._ready = self._ready, []
        return ready

    def _step_once(self) -> None:
        # The steps in flight are the reducer's: StepScheduled adds one, its FrameProduced
        # removes it, and the runner is handed every scheduled step in that order.
        in_flight = self.state.in_flight_steps
        scheduled = False
        if len(in_flight) < self.depth:
            batch = self.scheduler.schedule()
            if batch is not None:
                batch.finished_req_ids, self._finished_since_last_batch = (
                    self._finished_since_last_batch,
                    [],
                )
                self._submit(batch)
                scheduled = True
        if in_flight and (len(in_flight) >= self.depth or not scheduled):
            self._apply_frame()

    def _submit(self, batch: ScheduledBatch) -> None:
        self.runner.submit(batch)

    def _apply_frame(self) -> None:
        """Fold the oldest step's frame, then let the scheduler finish the requests it
        brought to a stop (vLLM's update_from_output)."""
        step = self.state.in_flight_steps[0].step
        self._emit(ev.FrameProduced(step, self.runner.collect(step)))
        self.scheduler.update_from_output()

    def _flush_outputs(self) -> None:
        state = self.state
        if not state.pending_output:
            return
        entries, deltas = pending_outputs(state)
        self._emit(ev.OutputsEmitted(state.step, entries))
        stop_strings = self.stop_strings
        if stop_strings is not None and stop_strings.has_streams():
            for delta in deltas:  # the text of requests with stop strings is decoded here
                delta.new_text = stop_strings.take_text(delta.request_id)
        self._ready += deltas

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve any more (its failure is on the tape), or None."""
        return self._dead

    def fail(self, error_type: str, message: str) -> None:
        """End the engine on a failure found outside it (its frontend died, or the engine core
        failed around a step): recorded on the tape as an EngineError, with the requests as
        they stand, as an internal failure is; it serves no more."""
        if self._dead is not None:
            return
        self._dead = f"{error_type}: {message}"
        self.tape.append(ev.EngineError(self.state.step, error_type, message))
        self.tape.flush()

    def close(self) -> None:
        self.runner.close()
        self.tape.close()

    # -- snapshots: where a segment of a segmented tape begins -------------------------------

    def snapshot(self, segment: int = 0, seq_offset: int = 0) -> ev.EngineSnapshot:
        """The engine's state at a step boundary (events/snapshot.py): what a segment opens
        with, so that it replays without the segments before it."""
        return take_snapshot(
            self.state,
            self.kv.snapshot(),
            self.stop_strings.snapshot() if self.stop_strings is not None else [],
            segment,
            seq_offset,
            time.time(),
        )

    def restore(self, snapshot: ev.EngineSnapshot) -> None:
        """Start from a snapshot (a replay of a segment): recorded on this engine's tape and
        applied, the KV cache manager's bookkeeping and the stop strings' streams with it.
        Only before anything else happened."""
        if self.state.num_events or self.state.requests:
            raise RuntimeError("restore: only a new engine starts from a snapshot")
        if snapshot.loras and self.lora_runner is None:
            raise LoRAError("the snapshot holds LoRA adapters: build the engine with enable_lora")
        for lora in snapshot.loras:
            assert self.lora_runner is not None
            self.lora_runner.restore_lora(lora)
        with self._recorded():
            self._emit(snapshot)
            self.kv.restore(snapshot.kv_cache)
            if self.stop_strings is not None:
                self.stop_strings.restore(snapshot.stop_streams, self.state.requests)

    # -- pause, resume, prefix-cache reset, sleep mode, abort-all ----------------------------

    def is_paused(self) -> bool:
        return self.state.paused is not None

    def pause_generation(self, mode: str = "keep", clear_cache: bool = True) -> None:
        """Pause as vLLM does and return once the engine has drained.

        abort: abort every request; wait: admit nothing new and let the running requests
        finish; keep: schedule nothing and keep every request for later. In-flight steps are
        applied (their tokens are delivered by the next `step()`), then, with `clear_cache`,
        running requests are preempted and the prefix cache is reset.
        """
        check_pause_mode("pause_generation", mode)
        check_bool("clear_cache", clear_cache)
        self.check_awake("pause_generation")
        self._before_pause()
        with self._recorded():
            self._emit(ev.GenerationPaused(self.state.step, mode, clear_cache))  # type: ignore[arg-type]
            if mode == "abort":
                for req in self.state.unfinished:
                    self.scheduler.finish(req, "abort")
            elif mode == "wait":
                while self.state.running:
                    self._step_once()
            if self._drains_on_pause():
                while self.state.in_flight_steps:
                    self._apply_frame()
            if clear_cache and self._clears_cache_on_pause():
                self._reset_prefix_cache(reset_running_requests=True)
        self.tape.flush()  # a paused engine's tape is complete in the file

    def _before_pause(self) -> None:
        """A pause was asked for, its arguments checked, nothing recorded yet (an injected
        fault notes what it needs)."""

    def _drains_on_pause(self) -> bool:
        """A pause waits for the steps in flight (an injected fault may not)."""
        return True

    def _clears_cache_on_pause(self) -> bool:
        """A pause with clear_cache resets the cache once drained (an injected fault may not)."""
        return True

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
        self._check_alive()
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
        drained = not state.in_flight_steps or not self._drains_on_pause()
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
        self._check_alive()
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

    # -- LoRA adapters --------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's add_lora: load a PEFT adapter under its name and id, checked first (its
        folder, its rank against max_lora_rank, its shapes against the model; LoRAError) and
        recorded as LoRAAdded with its SHA-256. False if that adapter is loaded already. With
        max_cpu_loras adapters loaded, the one loaded longest ago that no unfinished request
        runs with is removed first (LoRARemoved), as vLLM's cache evicts."""
        runner = self._check_lora_request(lora_request)
        state = self.state
        if lora_request.lora_int_id in state.loras:
            return False
        if len(state.loras) >= self.config.lora_capacity:
            evict = next((i for i in state.loras if not state.lora_users(i)), None)
            if evict is None:
                raise LoRAError(
                    f"LoRA adapter {lora_request.lora_name!r}: the {self.config.lora_capacity} "
                    "adapters loaded (max_cpu_loras) all serve unfinished requests"
                )
            self.remove_lora(evict)
        info = runner.add_lora(
            lora_request.lora_int_id, lora_request.lora_path, self.config.max_lora_rank
        )
        with self._recorded():
            self._emit(
                ev.LoRAAdded(
                    self.state.step,
                    lora_request.lora_name,
                    lora_request.lora_int_id,
                    lora_request.lora_path,
                    info.adapter_id,
                    info.rank,
                    info.scaling,
                    info.target_modules,
                )
            )
        return True

    def _check_lora_request(self, lora_request: object) -> ServesLoRA:
        """The runner that serves LoRA, once `lora_request` may be served by it: a
        LoRARequest whose id and name are not taken by another adapter."""
        self._check_alive()
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {shown(lora_request)}")
        if self.lora_runner is None:
            raise LoRAError(
                "LoRA is not enabled: build the engine with enable_lora=True (serve: --enable-lora)"
            )
        loaded = self.state.loras.get(lora_request.lora_int_id)
        if loaded is not None and loaded.lora_name != lora_request.lora_name:
            raise LoRAError(
                f"LoRA id {lora_request.lora_int_id} is adapter {loaded.lora_name!r}, not "
                f"{lora_request.lora_name!r}"
            )
        for other in self.state.loras.values():
            if other.lora_name == lora_request.lora_name and other is not loaded:
                raise LoRAError(
                    f"LoRA adapter {lora_request.lora_name!r} is loaded already, with id "
                    f"{other.lora_int_id}"
                )
        if loaded is None and not lora_request.lora_path:
            raise LoRAError(
                f"LoRA adapter {lora_request.lora_name!r} is not loaded and has no lora_path"
            )
        return self.lora_runner

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's remove_lora: False if no adapter has that id; LoRAError while an
        unfinished request runs with it. Recorded as LoRARemoved."""
        self._check_alive()
        if self.lora_runner is None:
            raise LoRAError("LoRA is not enabled: build the engine with enable_lora=True")
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int):
            raise TypeError(
                f"remove_lora: lora_int_id must be an integer, got {shown(lora_int_id)}"
            )
        if lora_int_id not in self.state.loras:
            return False
        users = self.state.lora_users(lora_int_id)
        if users:
            raise LoRAError(
                f"LoRA adapter {lora_int_id} serves {len(users)} unfinished request(s) "
                f"({users[0]!r} first); abort them or let them finish first"
            )
        self.lora_runner.remove_lora(lora_int_id)
        with self._recorded():
            self._emit(ev.LoRARemoved(self.state.step, lora_int_id))
        return True

    def list_loras(self) -> set[int]:
        """vLLM's list_loras: the ids of the adapters loaded."""
        return set(self.state.loras)

    # -- collective_rpc: the RL framework's code on the worker ----------------------------------

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's collective_rpc: call `method` (a worker method by name, one of
        `worker_extension_cls` among them, or a function taking the worker first) on every
        worker, and return their results (tokentape has one worker: a list of one). It runs
        after the steps handed to the runner, before any later one. Recorded as
        CollectiveRPC: the method, a digest of the arguments, the weights' hash when the
        call changed them. A method that raises is recorded, and its exception comes back
        to the caller; the engine serves on."""
        self._check_alive()
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise WorkerCallRefused(f"collective_rpc: timeout must be > 0, got {shown(timeout)}")
        if not isinstance(args, (tuple, list)):
            raise WorkerCallRefused(f"collective_rpc: args must be a tuple, got {shown(args)}")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise WorkerCallRefused(
                f"collective_rpc: kwargs must be a dict of names, got {shown(kwargs)}"
            )
        name, call = resolve_method(self.worker, method)
        digest = args_digest(tuple(args), kwargs)
        if self.worker_calls is None:
            raise RuntimeError(f"collective_rpc: model {self.runner.model_id!r} runs no worker")
        result, error, weights_id = self.worker_calls.run_worker_call(
            lambda: call(*args, **kwargs), timeout
        )
        failed = None if error is None else f"{type(error).__name__}: {error}"
        with self._recorded():
            self._emit(ev.CollectiveRPC(self.state.step, name, digest, weights_id, failed))
        if error is not None:
            raise error
        return [result]

    def replay_rpc(self, record: ev.CollectiveRPC) -> None:
        """A recorded collective_rpc, for a replay: its code and arguments are not on the
        tape, so it is recorded again as it was (what it did to the weights with it)."""
        with self._recorded():
            self._emit(record)

    # -- weight updates ------------------------------------------------------------------------

    def get_weight_version(self) -> str:
        """The version of the weights serving now (vLLM #49040): "default" until an update."""
        return self.state.weight_version

    def update_weights(
        self, weights: object, weight_version: str | int | None = None
    ) -> str | None:
        """Load new weights (a state_dict or a checkpoint folder), for RL loops; or, inside a
        transfer (`start_weight_update`), check and hold one chunk of them.

        Allowed only while generation is paused with nothing in flight (after
        `pause_generation`); every tensor is checked before anything changes, so a refused
        update leaves the old weights serving. A whole update is recorded as WeightsUpdated
        with the new weights' SHA-256, which it returns, and `weight_version` (default: the
        update's number); a chunk as WeightChunkReceived (it returns None; its version is
        `finish_weight_update`'s). K/V already cached were computed with the old weights:
        pause with `clear_cache=True` to recompute them.
        """
        if is_update_info(weights):
            self._receive_bucket(weights, weight_version)
            return None
        updater = self._check_can_update("update_weights")
        if self.state.weight_update_chunks is not None:
            if weight_version is not None:
                raise ValueError(
                    "update_weights: a chunk of a transfer takes no weight_version; "
                    "give it to finish_weight_update"
                )
            chunk = updater.stage_weights(weights)  # raises before anything is held
            with self._recorded():
                self._emit(
                    ev.WeightChunkReceived(self.state.step, chunk.names, chunk.shapes, chunk.hashes)
                )
            return None
        version = resolve_version(weight_version, self.state.num_weight_updates + 1)
        weights_id = updater.update_weights(weights)  # raises before any change on bad input
        with self._recorded():
            self._emit(ev.WeightsUpdated(self.state.step, weights_id, version))
        return weights_id

    def init_weight_transfer_engine(self, init_info: object = None) -> None:
        """vLLM's: make the weight transfer engine ready, once before the training loop (for
        "shm": the engine checks it can attach shared memory). Refused without
        `weight_transfer_config`. Not on the tape: the buckets' chunks are."""
        self._check_alive()
        transfer = self._transfer_engine("init_weight_transfer_engine")
        transfer.init_transfer_engine({} if init_info is None else init_info)  # type: ignore[arg-type]

    def _transfer_engine(self, call: str) -> ShmWeightTransferEngine:
        if self.weight_transfer is None:
            raise RuntimeError(
                f"{call}: the engine has no weight transfer engine; build it with "
                "weight_transfer_config=WeightTransferConfig(backend='shm') (serve: "
                '--weight-transfer-config \'{"backend": "shm"}\')'
            )
        return self.weight_transfer

    def _receive_bucket(self, update_info: object, weight_version: str | int | None) -> None:
        """update_weights(update_info): one bucket of the weight transfer engine, inside an
        open transfer, taken as a chunk (checked, held, recorded as WeightChunkReceived)."""
        transfer = self._transfer_engine("update_weights")
        if not transfer.initialized:
            raise RuntimeError("update_weights: call init_weight_transfer_engine first")
        updater = self._check_can_update("update_weights")
        if self.state.weight_update_chunks is None:
            raise RuntimeError(
                "update_weights: an update_info is a bucket of a transfer; call "
                "start_weight_update first (and finish_weight_update after the last bucket)"
            )
        if weight_version is not None:
            raise ValueError(
                "update_weights: a bucket of a transfer takes no weight_version; "
                "give it to finish_weight_update"
            )
        chunk = transfer.receive_weights(update_info, updater.stage_weights)
        with self._recorded():
            self._emit(
                ev.WeightChunkReceived(self.state.step, chunk.names, chunk.shapes, chunk.hashes)
            )

    def start_weight_update(self) -> None:
        """Open a chunked transfer (vLLM RFC #31848): `update_weights(chunk)` as many times as
        needed, then `finish_weight_update()`. The old weights serve until the finish."""
        self._check_can_update("start_weight_update")
        open_chunks = self.state.weight_update_chunks
        if open_chunks is not None:
            raise RuntimeError(
                "start_weight_update: a weight update is already open "
                f"({open_chunks} chunk(s) received); call finish_weight_update first"
            )
        with self._recorded():
            self._emit(ev.WeightUpdateStarted(self.state.step))

    def finish_weight_update(self, weight_version: str | int | None = None) -> str:
        """Load every chunk of the open transfer at once and publish `weight_version`
        (default: the update's number); returns the new weights' SHA-256."""
        updater = self._check_can_update("finish_weight_update")
        if self.state.weight_update_chunks is None:
            raise RuntimeError(
                "finish_weight_update: no weight update is open (start_weight_update)"
            )
        version = resolve_version(weight_version, self.state.num_weight_updates + 1)
        weights_id = updater.load_staged_weights()
        with self._recorded():
            self._emit(ev.WeightsUpdated(self.state.step, weights_id, version))
        return weights_id

    def check_no_open_transfer(self, call: str) -> None:
        """Refuse `call` (resume_generation) while a chunked transfer is open: the model holds
        the old weights and the chunks wait for the finish."""
        chunks = self.state.weight_update_chunks
        if chunks is not None:
            raise RuntimeError(
                f"{call}: a weight update is open (start_weight_update, {chunks} chunk(s) "
                "received); call finish_weight_update first"
            )

    def _check_can_update(self, call: str) -> UpdatesWeights:
        self._check_alive()
        if self.state.paused is None:
            raise RuntimeError(f"{call}: pause generation first (pause_generation(mode='keep'))")
        if self.state.in_flight_steps:
            raise RuntimeError(f"{call}: {len(self.state.in_flight_steps)} step(s) still in flight")
        if "weights" in self.state.sleeping_tags:  # offloaded or dropped (rl_calls.sleep)
            raise RuntimeError(f"{call}: the weights sleep; call wake_up(['weights']) first")
        if self.weights_updater is None:
            raise RuntimeError(f"{call}: model {self.runner.model_id!r} has no weights to update")
        return self.weights_updater
