"""The reducer: `evolve(state, event)` is the only code that changes request state.

The live engine applies every event it appends through `evolve`, and replay folds a tape
through the same function, so `fold(tape)` gives exactly the state the engine had. For speed
`evolve` updates the state in place and returns it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokentape.events import schema as ev
from tokentape.events.discard import get_policy
from tokentape.events.engine_rules import (
    on_collective_rpc,
    on_lora_added,
    on_lora_removed,
    on_paused,
    on_prefix_cache_reset,
    on_resumed,
    on_slept,
    on_weight_chunk,
    on_weight_update_started,
    on_weights_updated,
    on_woke_up,
)
from tokentape.events.faults import REDUCER_FAULTS
from tokentape.events.fold_errors import ReducerError
from tokentape.events.state import (
    FINISHED_STATUS,
    EngineState,
    InFlightStep,
    RequestState,
    RequestStatus,
)
from tokentape.events.stop_check import check_stop


def initial_state(
    discard_policy: str = "epoch",
    async_scheduling: bool = True,
    eos_token_id: int | None = None,
    max_model_len: int = 1 << 62,
    faults: Iterable[str] = (),
) -> EngineState:
    get_policy(discard_policy)  # fail early on an unknown name
    reducer_faults = frozenset(faults) & REDUCER_FAULTS
    return EngineState(
        discard_policy,
        async_scheduling,
        eos_token_id,
        max_model_len,
        reducer_faults,
        _handlers(reducer_faults),
    )


def _request(state: EngineState, req_id: str) -> RequestState:
    try:
        return state.requests[req_id]
    except KeyError:
        raise ReducerError(f"event names request {req_id!r}, which was never added") from None


def _leave_queues(state: EngineState, req: RequestState) -> None:
    if req.status is RequestStatus.RUNNING:
        state.running.remove(req.req_id)
    elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        state.waiting.remove(req.req_id)


def _mark_pending(state: EngineState, req: RequestState) -> None:
    """The request has output the client has not seen; it has seen everything so far."""
    if req.req_id not in state.pending_output:
        req.num_emitted = len(req.output_token_ids)
        state.pending_output[req.req_id] = None


def _finish(state: EngineState, req: RequestState, reason: ev.FinishReason) -> None:
    _leave_queues(state, req)
    req.status = FINISHED_STATUS[reason]
    req.finish_reason = reason
    req.block_ids = []
    _mark_pending(state, req)


def _new_request(
    state: EngineState,
    req_id: str,
    prompt: list[int],
    params: ev.SamplingParams,
    step: int,
    lora_int_id: int = 0,
) -> RequestState:
    """A request as added, with what its stop check needs fixed once (its stop ids, whether
    it has stop strings, its output limit, its LoRA adapter's content hash)."""
    req = RequestState(req_id, list(prompt), params, step)
    if lora_int_id:
        lora = state.loras.get(lora_int_id)
        if lora is None:
            raise ReducerError(
                f"request {req_id!r} runs with LoRA adapter {lora_int_id}, which is not loaded"
            )
        req.lora_int_id = lora_int_id
        req.lora_adapter_id = lora.adapter_id
    eos = () if params.ignore_eos or state.eos_token_id is None else (state.eos_token_id,)
    req.stop_ids = frozenset((*params.stop_token_ids, *eos))
    req.has_stop_strings = bool(params.stop)
    req.max_output_tokens = min(params.max_tokens, state.max_model_len - req.num_prompt_tokens)
    return req


def _on_added(state: EngineState, e: ev.RequestAdded) -> None:
    if e.req_id in state.requests:
        raise ReducerError(f"request {e.req_id!r} added twice")
    state.requests[e.req_id] = _new_request(
        state, e.req_id, e.prompt_token_ids, e.params, e.step, e.lora_int_id
    )
    state.waiting.append(e.req_id)


def _on_aborted(state: EngineState, e: ev.RequestAborted) -> None:
    req = _request(state, e.req_id)
    if not req.is_finished:
        _finish(state, req, "abort")


def _on_finished(state: EngineState, e: ev.RequestFinished) -> None:
    """The scheduler's decision: the request finished, its output cut to the length the
    event gives (tokens of the last frame after the stop are not part of it)."""
    req = _request(state, e.req_id)
    if e.stop_reason is not None:
        _check_stop_reason(req, e)
        req.stop_reason = e.stop_reason
    output = req.output_token_ids
    kept = e.num_output_tokens
    if kept is None:  # a tape that does not say: where the stop rule says
        decision = check_stop(req, 0, state.eos_token_id)
        kept = len(output) if decision is None else decision.num_output_tokens
    elif not 0 <= kept <= len(output):
        raise ReducerError(
            f"request {e.req_id!r} finished with {kept} output tokens, "
            f"but its frames gave it {len(output)}"
        )
    if kept < len(output):
        del output[kept:]
        del req.output_logprobs[kept:]
        del req.output_top_logprobs[kept:]
    _finish(state, req, e.reason)


def _check_stop_reason(req: RequestState, e: ev.RequestFinished) -> None:
    stop = e.stop_reason
    if isinstance(stop, str):
        known, what = stop in req.params.stop, f"stop string {stop!r}"
        theirs = f"its stop strings {list(req.params.stop)}"
    else:
        known, what = stop in req.params.stop_token_ids, f"stop token {stop!r}"
        theirs = f"its stop_token_ids {list(req.params.stop_token_ids)}"
    if e.reason != "stop" or not known:
        raise ReducerError(
            f"request {e.req_id!r} finished ({e.reason}) on {what}, which is not one of {theirs}"
        )


def _on_scheduled(state: EngineState, e: ev.StepScheduled) -> None:
    if e.step != state.step:
        raise ReducerError(f"step {e.step} scheduled when step {state.step} was expected")
    if state.sleep_level is not None and not scheduled_on_sleeping_kv_cache(state):
        raise ReducerError(
            f"step {e.step} scheduled while the engine sleeps (level {state.sleep_level}): "
            "no step may run until it wakes up"
        )
    get_request, running = state.requests.get, RequestStatus.RUNNING  # locals: a hot loop
    scheduled: list[RequestState] = []
    add_scheduled = scheduled.append
    partial: set[str] = set()
    for entry in e.entries:
        req = get_request(entry.req_id) or _request(state, entry.req_id)
        add_scheduled(req)
        if req.status is not running:
            if req.finish_reason is not None:
                raise ReducerError(f"finished request {req.req_id!r} scheduled in step {e.step}")
            state.waiting.remove(req.req_id)
            state.running.append(req.req_id)
            req.status = running
        computed = req.num_computed_tokens = entry.num_computed_before + entry.num_new_tokens
        if entry.new_block_ids:
            req.block_ids += entry.new_block_ids
        # An entry samples a token unless it is a prefill chunk short of the sequence's end.
        if computed >= req.num_prompt_tokens + len(req.output_token_ids):
            req.num_output_placeholders += 1 + entry.num_spec_tokens
            req.num_fresh_in_flight += 1
            req.prefill_complete = True
        else:
            req.num_partial_in_flight += 1
            partial.add(entry.req_id)
    state.in_flight_steps.append(InFlightStep(e.step, e.entries, scheduled, partial))
    state.step = e.step + 1


def _on_preempted(state: EngineState, e: ev.RequestPreempted) -> None:
    req = _request(state, e.req_id)
    if req.status is not RequestStatus.RUNNING:
        raise ReducerError(
            f"request {e.req_id!r} preempted in step {e.step} while {req.status.value}, not running"
        )
    state.running.remove(req.req_id)
    state.waiting.appendleft(req.req_id)
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.block_ids = []
    req.epoch += 1
    req.num_preemptions += 1
    if state.async_scheduling:  # vLLM's synchronous Scheduler has no discard logic at all
        get_policy(state.discard_policy).on_preempt(req, e.reason)
    req.num_stale_in_flight = req.num_in_flight  # whatever is in flight is now stale
    req.num_fresh_in_flight = req.num_partial_in_flight = 0
    req.prefill_complete = False
    req.num_output_placeholders = 0


def _on_frame(state: EngineState, e: ev.FrameProduced) -> None:
    if not state.in_flight_steps or state.in_flight_steps[0].step != e.step:
        expected = state.in_flight_steps[0].step if state.in_flight_steps else None
        raise ReducerError(f"frame for step {e.step} arrived when step {expected} was next")
    if state.sleeping_tags:
        raise ReducerError(
            f"frame of step {e.step} applied after the engine released its memory (sleep "
            f"level {state.sleep_level}): the step was in flight when it fell asleep (vLLM #45520)"
        )
    scheduled = state.in_flight_steps.popleft()
    pending, partial = state.pending_output, scheduled.partial
    policy = get_policy(state.discard_policy)
    should_drop, may_drop_fresh = policy.should_drop, policy.may_drop_fresh
    delivers_stale = policy.delivers_stale
    if len(e.entries) != len(scheduled.entries) - len(partial):
        raise ReducerError(
            f"frame of step {e.step} has {len(e.entries)} entries for "
            f"{len(scheduled.entries) - len(partial)} sampling entries"
        )
    frames: Sequence[ev.FrameEntry | None] = e.entries  # one per sampling entry, in order
    if partial:
        answers = iter(e.entries)
        frames = [None if x.req_id in partial else next(answers) for x in scheduled.entries]
    frame_outputs: list[tuple[RequestState, int]] = []
    state.frame_outputs = frame_outputs
    requests: Sequence[RequestState] = scheduled.requests  # as scheduled: identity, not name
    for entry, req, frame in zip(scheduled.entries, requests, frames):
        stale = entry.epoch != req.epoch
        if frame is None:  # a prefill chunk: nothing to apply
            if stale:
                req.num_stale_in_flight -= 1
            else:
                req.num_partial_in_flight -= 1
            continue
        if frame.req_id != entry.req_id:
            raise ReducerError(f"frame of step {e.step} has no tokens for request {entry.req_id!r}")
        num_spec = entry.num_spec_tokens
        if stale:
            req.num_stale_in_flight -= 1
            if req.finish_reason is not None:
                continue
        else:
            req.num_fresh_in_flight -= 1
            if req.finish_reason is not None:  # too late to count, but the placeholders return
                req.num_output_placeholders -= 1 + num_spec
                continue
        if not frame.token_ids:
            continue  # nothing sampled (vLLM: an aborted or failed request): nothing to apply
        returned = 1  # the placeholders the frame returns if applied
        if num_spec:
            returned = policy.give_back_drafts(req, stale, num_spec, frame.num_accepted)
        if (stale or may_drop_fresh) and should_drop(req, stale, len(frame.token_ids)):
            req.num_frames_dropped += 1
            continue
        if not (stale and delivers_stale):  # delivered stale output is not counted (#48245)
            req.num_output_placeholders -= returned
        # Every token is applied; whether one of them stops the request is the scheduler's
        # decision (Scheduler.update_from_output), recorded as RequestFinished, which cuts
        # the output where it stops.
        output = req.output_token_ids
        if entry.req_id not in pending:  # _mark_pending, inlined: this loop is the hot path
            req.num_emitted = len(output)
            pending[entry.req_id] = None
        num_before = len(output)
        output += frame.token_ids
        frame_outputs.append((req, num_before))
        if frame.prompt_logprobs is not None and req.prompt_logprobs is None:
            _keep_prompt_logprobs(req, frame.prompt_logprobs, e.step)
        if frame.logprobs is not None:
            req.output_logprobs += frame.logprobs
        if (
            frame.top_token_ids is not None
            and frame.top_logprobs is not None
            and frame.logprobs is not None
        ):
            # vLLM's dict per position: the sampled token first, then the top k, best first.
            req.output_top_logprobs += [
                {tok: lp, **dict(zip(ids, lps))}
                for tok, lp, ids, lps in zip(
                    output[num_before:], frame.logprobs, frame.top_token_ids, frame.top_logprobs
                )
            ]


def _keep_prompt_logprobs(req: RequestState, plp: ev.PromptLogprobs, step: int) -> None:
    """A frame's prompt logprobs: one per prompt token after the first, or the tape lies."""
    num = req.num_prompt_tokens - 1
    k = req.params.prompt_logprobs
    if (
        k is None
        or len(plp.token_logprobs) != num
        or (k > 0 and (len(plp.top_token_ids) != num or len(plp.top_logprobs) != num))
    ):
        raise ReducerError(
            f"frame of step {step} has prompt logprobs for request {req.req_id!r} that do not "
            f"match its prompt of {req.num_prompt_tokens} tokens (prompt_logprobs={k})"
        )
    req.prompt_logprobs = plp


def _on_outputs(state: EngineState, e: ev.OutputsEmitted) -> None:
    """Every pending output was delivered; the entries record what the client received."""
    state.pending_output.clear()


def _on_snapshot(state: EngineState, e: ev.EngineSnapshot) -> None:
    """Restore the state a segment opens with. Its requests replace the ones of the same id
    (in a fold over earlier segments they are equal); settled requests stay as they are
    (a snapshot leaves them out: nothing changes them any more)."""
    requests = state.requests
    state.loras = {lora.lora_int_id: lora for lora in e.loras}
    for r in e.requests:
        req = _new_request(
            state, r.req_id, r.prompt_token_ids, r.params, r.arrival_step, r.lora_int_id
        )
        req.status = RequestStatus(r.status)
        req.output_token_ids = list(r.output_token_ids)
        req.output_logprobs = list(r.output_logprobs)
        req.output_top_logprobs = [dict(top) for top in r.output_top_logprobs]
        req.prompt_logprobs = r.prompt_logprobs
        req.num_computed_tokens = r.num_computed_tokens
        req.num_output_placeholders = r.num_output_placeholders
        req.epoch = r.epoch
        req.num_preemptions = r.num_preemptions
        req.block_ids = list(r.block_ids)
        req.num_stale_in_flight = r.num_stale_in_flight
        req.num_fresh_in_flight = r.num_fresh_in_flight
        req.num_partial_in_flight = r.num_partial_in_flight
        req.prefill_complete = r.prefill_complete
        req.async_tokens_to_discard = r.async_tokens_to_discard
        req.discard_latest_async_tokens = r.discard_latest_async_tokens
        req.drop_stale_output = r.drop_stale_output
        req.num_frames_dropped = r.num_frames_dropped
        req.num_emitted = r.num_emitted
        req.finish_reason = r.finish_reason
        req.stop_reason = r.stop_reason
        requests[r.req_id] = req
    state.step = e.step
    state.waiting = deque(e.waiting)
    state.running = list(e.running)
    state.in_flight_steps = deque(
        InFlightStep(s.step, s.entries, [requests[x.req_id] for x in s.entries], set(s.partial))
        for s in e.in_flight_steps
    )
    state.pending_output = dict.fromkeys(e.pending_output)
    state.frame_outputs = []
    state.paused = e.paused
    state.sleep_level = e.sleep_level
    state.sleeping_tags = tuple(e.sleeping_tags)
    state.num_prefix_cache_resets = e.num_prefix_cache_resets
    state.weights_id = e.weights_id
    state.weight_version = e.weight_version
    state.num_weight_updates = e.num_weight_updates
    state.weight_update_chunks = e.weight_update_chunks


def _on_segment_closed(state: EngineState, e: ev.SegmentClosed) -> None:
    """The run goes on in the next segment: nothing changes."""


def _on_error(state: EngineState, e: ev.EngineError) -> None:
    state.error = f"{e.error_type}: {e.message}"


def _on_recording_stopped(state: EngineState, e: ev.RecordingStopped) -> None:
    state.recording_stopped = e.reason


# -- the reducer faults: upstream bugs on purpose (events/faults.py), for tests and tapes ----
# A state folded with one gets these handlers in place of the ones they wrap (`_handlers`),
# chosen once when it is made: an ordinary fold runs none of this.


def reusable_request_id(state: EngineState, req: RequestState) -> bool:
    """vLLM #42492, injected (fault output_on_reused_id): a finished request's id may be
    added again, as vLLM's frontend allows; tokentape refuses a request id used before."""
    return "output_on_reused_id" in state.faults and req.is_finished


def _on_added_again(state: EngineState, e: ev.RequestAdded) -> None:
    """output_on_reused_id: a finished request's id names the new request from now on."""
    old = state.requests.get(e.req_id)
    if old is not None and old.is_finished:
        del state.requests[e.req_id]  # the steps in flight keep the old request itself
    _on_added(state, e)


def _on_frame_by_id(state: EngineState, e: ev.FrameProduced) -> None:
    """output_on_reused_id (vLLM #42492): output is looked up by request id when it comes
    back, so an id added again while the step was in flight gets the old request's output."""
    if state.in_flight_steps and state.in_flight_steps[0].step == e.step:
        oldest = state.in_flight_steps[0]
        oldest.requests = [state.requests[x.req_id] for x in oldest.entries]
    _on_frame(state, e)


def _on_scheduled_uncounted_chunks(state: EngineState, e: ev.StepScheduled) -> None:
    """chunk_placeholder_underflow (vLLM #57562): in a step shared with other requests, a
    final prefill chunk that followed earlier chunks samples, but its placeholders are never
    counted (its token takes one back, below zero)."""
    requests, running = state.requests, RequestStatus.RUNNING
    chunks = [
        x
        for x in e.entries
        if len(e.entries) > 1
        and x.num_computed_before > 0
        and x.req_id in requests
        and requests[x.req_id].status is running
        and not requests[x.req_id].prefill_complete
    ]
    _on_scheduled(state, e)
    partial = state.in_flight_steps[-1].partial
    for entry in chunks:
        if entry.req_id not in partial:
            requests[entry.req_id].num_output_placeholders -= 1 + entry.num_spec_tokens


def kv_cache_alone_asleep(state: EngineState) -> bool:
    """The engine sleeps with its weights awake and its KV cache still released: between
    wake_up(["weights"]) and wake_up(["kv_cache"])."""
    tags = state.sleeping_tags
    return state.sleep_level is not None and "kv_cache" in tags and "weights" not in tags


def resumes_on_partial_wake(state: EngineState) -> bool:
    """vLLM #44395, injected (fault resume_on_partial_wake): whether the reducer accepts a
    GenerationResumed now, the KV cache still asleep after a wake-up of the weights alone
    (tokentape's engine resumes only once every tag is awake, and its reducer refuses it)."""
    return "resume_on_partial_wake" in state.faults and kv_cache_alone_asleep(state)


def scheduled_on_sleeping_kv_cache(state: EngineState) -> bool:
    """vLLM #44395, injected (fault resume_on_partial_wake): generation resumed on a wake-up
    of the weights alone, so a step may be scheduled while the KV cache sleeps. Asked only of
    a step scheduled while the engine sleeps, which the reducer refuses otherwise (in
    `_on_scheduled` itself, so the fault composes with chunk_placeholder_underflow's handler
    of the same event)."""
    return resumes_on_partial_wake(state) and state.paused is None


def _on_resumed_on_partial_wake(state: EngineState, e: ev.GenerationResumed) -> None:
    """resume_on_partial_wake (vLLM #44395): generation resumes after a wake-up of the
    weights alone; the engine still sleeps (sleep_level, sleeping_tags: the KV cache) until
    the wake-up of the KV cache."""
    if resumes_on_partial_wake(state):
        state.paused = None
    else:
        on_resumed(state, e)


_FAULT_HANDLERS: dict[str, dict[type, Callable[[EngineState, Any], None]]] = {
    "output_on_reused_id": {ev.RequestAdded: _on_added_again, ev.FrameProduced: _on_frame_by_id},
    "chunk_placeholder_underflow": {ev.StepScheduled: _on_scheduled_uncounted_chunks},
    "resume_on_partial_wake": {ev.GenerationResumed: _on_resumed_on_partial_wake},
}


def _handlers(faults: frozenset[str]) -> dict[type, Callable[[EngineState, Any], None]]:
    """The reducer's handler per event type, with the given faults' in place of theirs."""
    if not faults:
        return _HANDLERS
    handlers = dict(_HANDLERS)
    for name in sorted(faults):
        handlers.update(_FAULT_HANDLERS[name])
    return handlers


_HANDLERS: dict[type, Callable[[EngineState, Any], None]] = {
    ev.RequestAdded: _on_added,
    ev.RequestAborted: _on_aborted,
    ev.RequestFinished: _on_finished,
    ev.GenerationPaused: on_paused,
    ev.GenerationResumed: on_resumed,
    ev.PrefixCacheReset: on_prefix_cache_reset,
    ev.WeightsUpdated: on_weights_updated,
    ev.WeightUpdateStarted: on_weight_update_started,
    ev.WeightChunkReceived: on_weight_chunk,
    ev.EngineSlept: on_slept,
    ev.EngineWokeUp: on_woke_up,
    ev.StepScheduled: _on_scheduled,
    ev.RequestPreempted: _on_preempted,
    ev.FrameProduced: _on_frame,
    ev.OutputsEmitted: _on_outputs,
    ev.EngineError: _on_error,
    ev.RecordingStopped: _on_recording_stopped,
    ev.EngineSnapshot: _on_snapshot,
    ev.SegmentClosed: _on_segment_closed,
    ev.CollectiveRPC: on_collective_rpc,
    ev.LoRAAdded: on_lora_added,
    ev.LoRARemoved: on_lora_removed,
}


def evolve(state: EngineState, event: ev.Event) -> EngineState:
    """Apply one event to the state (in place) and return it."""
    state.handlers[type(event)](state, event)
    state.num_events += 1
    return state


def fold_events(
    events: Iterable[tuple[int, ev.Event]], state: EngineState, until_seq: int | None = None
) -> EngineState:
    """Apply `(seq, event)` pairs in order, stopping before `until_seq`: `evolve` in a loop,
    with the dispatch hoisted out of it (replay folds millions of events)."""
    handlers = state.handlers
    applied = 0
    until = until_seq if until_seq is not None else 1 << 62
    try:
        for seq, event in events:
            if seq >= until:
                break
            handlers[type(event)](state, event)
            applied += 1
    finally:
        state.num_events += applied
    return state
