"""LLMEngine: the loop that ties decide, evolve, tape and runner together.

Every state change goes the same way: the engine (or its scheduler) builds an event, appends
it to the tape, and applies it through the reducer. The tape is committed at every step
boundary and after every command, so a killed process leaves a tape that verifies up to its
last completed step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import msgspec

from tokentape.engine.bad_words import has_text_bad_words
from tokentape.engine.config import EngineConfig
from tokentape.engine.core_outputs import pending_outputs
from tokentape.engine.hooks import EngineHooks
from tokentape.engine.kv_cache_manager import KVCacheManager
from tokentape.engine.output_processor import OutputProcessor
from tokentape.engine.outputs import EngineCoreOutput, RequestOutput
from tokentape.engine.parallel_sampling import child_params, child_request_id
from tokentape.engine.request_checks import check_request, resolved_bad_words
from tokentape.engine.rl_calls import RLCalls
from tokentape.engine.runner_defaults import with_runner_defaults
from tokentape.engine.runners.base import ChecksParams, ModelRunner, UpdatesWeights
from tokentape.engine.scheduler import Scheduler
from tokentape.engine.stop_strings import find_stop_string
from tokentape.engine.tokenizer import SplitsSafely, Tokenizer
from tokentape.engine.weight_updates import WeightUpdates
from tokentape.errors import EngineDeadError
from tokentape.events import schema as ev
from tokentape.events.reducer import evolve, initial_state
from tokentape.events.schema import SamplingParams
from tokentape.events.store import TapeWriter


class LLMEngine(WeightUpdates, RLCalls):
    """The engine loop, as vLLM's LLMEngine with its EngineCore inside: it owns the engine's
    state (the reducer's, changed only through `_emit`), the KV cache manager, the scheduler,
    the runner, the tape writer and the output processor. Commands (add, abort; the weight
    updates of weight_updates.py; pause, resume, reset, the sleep mode and abort_all of
    rl_calls.py) and steps go on the tape before they take effect; `step` gives
    RequestOutputs, `step_core` the per-request deltas an engine core sends across the
    process boundary. The runner's optional capabilities (runners.base: ChecksParams,
    UpdatesWeights) are read once, here, when it is built."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tape: TapeWriter,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        config = with_runner_defaults(config, runner)  # LLM has done it; a direct caller may not
        config.check_runnable()
        self.config = config
        self.runner = runner
        # The runner's optional capabilities, checked once (runners/base.py's Protocols).
        self.params_checker: ChecksParams | None = (
            runner if isinstance(runner, ChecksParams) else None
        )
        self.weights_updater: UpdatesWeights | None = (
            runner if isinstance(runner, UpdatesWeights) else None
        )
        self.tape = tape
        self.tokenizer = tokenizer
        self._safe_split = tokenizer.safe_split if isinstance(tokenizer, SplitsSafely) else None
        self.depth = config.effective_pipeline_depth
        self.state = initial_state(
            config.discard_policy,
            self.depth > 1,
            runner.eos_token_id,
            config.effective_max_model_len,
            config.faults,
        )
        num_blocks = config.num_kv_blocks
        assert num_blocks is not None  # with_runner_defaults sized it
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, self.state, self._emit)
        self._finished_since_last_batch: list[str] = []
        # Deltas produced outside step() (e.g. by a drain), handed out by the next step.
        self._ready: list[EngineCoreOutput] = []
        self._dead: str | None = None
        self._commits_held = 0  # inside one_commit(): the calls share one tape commit
        self.num_preemptions = 0  # RequestPreempted events emitted (vLLM's preemption metric)
        # Upstream bugs on purpose (tests, tapes), through the engine's hooks (hooks.py): the
        # default path has none.
        self.hooks: Sequence[EngineHooks] = ()
        if config.faults:
            from tokentape.engine.faults import fault_hooks

            self.hooks = self.scheduler.hooks = fault_hooks(config, self.scheduler, self.state)
        # n > 1: each parent's children on the tape (the output processor gathers them).
        self._children: dict[str, list[str]] = {}
        # The one output processor: the deltas of step_core() as the client's RequestOutputs.
        self.output_processor = OutputProcessor(tokenizer)

    # -- the one way state changes ---------------------------------------------------------------

    def _emit(self, event: ev.Event) -> None:
        self.tape.append(event)
        evolve(self.state, event)
        if isinstance(event, (ev.RequestFinished, ev.RequestAborted)):
            self._finished_since_last_batch.append(event.req_id)
        elif isinstance(event, ev.RequestPreempted):
            self.num_preemptions += 1  # for the server's metrics

    @contextlib.contextmanager
    def _recorded(self) -> Iterator[None]:
        """Run an engine operation, deliver the outputs it produced and commit; record any
        internal failure on the tape, then re-raise."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed earlier and cannot continue: {self._dead}")
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
        one a request (half of a tiny run's messages were adds: docs/benchmarks.md)."""
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
        params: SamplingParams | None = None,
        prompt: str | None = None,
    ) -> None:
        """Add a request; its outputs come from `step()` (`prompt`: its text, for them)."""
        params = params if params is not None else SamplingParams()
        ids = self.add_core_request(request_id, prompt_token_ids, params)
        self.output_processor.add_request(request_id, list(prompt_token_ids), prompt, params, ids)

    def add_core_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> list[str]:
        """Record a request, or for n > 1 its n children "{i}_{id}" (parallel_sampling.py),
        all checked before any is recorded; the engine request ids, in index order. Their
        deltas come from `step_core()`."""
        self.check_request(request_id, prompt_token_ids, params)
        resolved = self._with_extra_eos(self._resolve_bad_words(request_id, params))
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
                    ev.RequestAdded(self.state.step, child_id, list(prompt_token_ids), child)
                )
        ids = [child_id for child_id, _ in children]
        for hook in self.hooks:
            hook.after_add(ids)
        return ids

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

    def step(self) -> list[RequestOutput]:
        """Schedule one step and, once the pipeline is full (or idle), apply the oldest frame.

        Returns the outputs of the requests that got tokens or finished, each shaped by its
        `SamplingParams.output_kind` as in vLLM: every token so far (CUMULATIVE, the default),
        the new tokens (DELTA), or nothing until the request finishes (FINAL_ONLY)."""
        return self.output_processor.process_outputs(self.step_core())

    def step_core(self) -> list[EngineCoreOutput]:
        """`step()` as the engine core does it: the new tokens of every request that got
        some or finished (what `OutputsEmitted` records), for an output processor."""
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
                for hook in self.hooks:
                    hook.before_submit(batch)
                self.runner.submit(batch)
                scheduled = True
        if in_flight and (len(in_flight) >= self.depth or not scheduled):
            self._apply_oldest_frame()

    def _apply_oldest_frame(self) -> None:
        if self.hooks:
            oldest = self.state.in_flight_steps[0]
            for hook in self.hooks:
                hook.before_frame(oldest.step)
            ids = [e.req_id for e in oldest.entries]
            self._apply_frame()
            for hook in self.hooks:
                hook.after_frame(ids)
        else:
            self._apply_frame()

    def _apply_frame(self) -> None:
        step = self.state.in_flight_steps[0].step
        frame = self.runner.collect(step)
        requests = self.state.requests
        # Stop strings are looked for in the text the frame adds (vLLM's front end does it in
        # its detokenizer); the output length before the frame says where that text begins.
        before = {
            e.req_id: len(requests[e.req_id].output_token_ids)
            for e in frame
            if requests[e.req_id].params.stop
        }
        self._emit(ev.FrameProduced(step, frame))
        for entry in frame:
            req = requests[entry.req_id]
            if req.is_finished:
                continue
            if entry.req_id in before and req.stop_reason != "stop":  # a stop token wins
                stop_str = find_stop_string(
                    self._decode_for_stop,
                    req.params,
                    req.output_token_ids,
                    before.pop(entry.req_id),
                    split=self._safe_split,
                )
                if stop_str is not None:  # it overrides "length", as in vLLM
                    self.scheduler.finish(req, "stop", stop_str)
                    continue
            if req.stop_reason is not None:
                self.scheduler.finish(req, req.stop_reason)

    def _decode_for_stop(self, token_ids: list[int]) -> str:
        assert self.tokenizer is not None  # check_request refuses stop strings without one
        return self.tokenizer.decode(token_ids)

    def _flush_outputs(self) -> None:
        state = self.state
        if not state.pending_output:
            return
        entries, deltas = pending_outputs(state)
        self._emit(ev.OutputsEmitted(state.step, entries))
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
