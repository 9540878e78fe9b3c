"""Snapshots of the reducer's state, for the event a segment of a segmented tape opens with
(`EngineSnapshot`; the reducer restores it, reducer._on_snapshot).

Only the requests that are not *settled* are kept: a settled request (finished, nothing of
it in flight, its output delivered) is never named by a later event, so a segment needs
nothing of it. The KV cache manager and the stop-string checker snapshot their own state
(engine/core/kv_cache_manager.py, engine/stop_strings.py); the engine core puts the parts
together (EngineCore.snapshot).
"""

from __future__ import annotations

import msgspec

from tokentape.events import schema as ev
from tokentape.events.state import EngineState, RequestState, RequestStatus


def is_settled(state: EngineState, req: RequestState) -> bool:
    """Finished, nothing in flight, output delivered: no later event changes the request."""
    return (
        req.finish_reason is not None
        and not req.num_in_flight
        and req.req_id not in state.pending_output
    )


def request_snapshot(req: RequestState) -> ev.RequestSnapshot:
    return ev.RequestSnapshot(
        req.req_id,
        req.prompt_token_ids,
        req.params,
        req.arrival_step,
        req.status.value,
        req.output_token_ids,
        req.output_logprobs,
        req.output_top_logprobs,
        req.prompt_logprobs,
        req.num_computed_tokens,
        req.num_output_placeholders,
        req.epoch,
        req.num_preemptions,
        req.block_ids,
        req.num_stale_in_flight,
        req.num_fresh_in_flight,
        req.num_partial_in_flight,
        req.prefill_complete,
        req.async_tokens_to_discard,
        req.discard_latest_async_tokens,
        req.drop_stale_output,
        req.num_frames_dropped,
        req.num_emitted,
        req.finish_reason,
        req.stop_reason,
        req.lora_int_id,
    )


def take_snapshot(
    state: EngineState,
    kv_cache: ev.KVCacheSnapshot,
    stop_streams: list[ev.StopStreamSnapshot],
    segment: int,
    seq_offset: int,
    wall_time: float,
) -> ev.EngineSnapshot:
    """The engine's state at a step boundary, as the event a segment opens with. The lists it
    holds are the state's own: it is encoded at once, before anything changes them."""
    return ev.EngineSnapshot(
        state.step,
        segment,
        seq_offset,
        wall_time,
        [request_snapshot(r) for r in state.requests.values() if not is_settled(state, r)],
        list(state.waiting),
        list(state.running),
        [ev.InFlightSnapshot(s.step, s.entries, sorted(s.partial)) for s in state.in_flight_steps],
        list(state.pending_output),
        state.paused,
        state.sleep_level,
        list(state.sleeping_tags),
        state.num_prefix_cache_resets,
        state.weights_id,
        state.weight_version,
        state.num_weight_updates,
        state.weight_update_chunks,
        kv_cache,
        stop_streams,
        list(state.loras.values()),
    )


def for_recompute(snapshot: ev.EngineSnapshot, num_blocks: int) -> ev.EngineSnapshot:
    """The snapshot as an engine without its KV cache starts from it (a what-if on another
    machine): every request kept goes back to waiting, running ones first, to be recomputed
    from its confirmed tokens as a preemption would (no blocks, nothing in flight; output
    owed to the client is still owed), and the cache is empty. Pause, sleep and weight state
    stay."""
    requests = []
    for r in snapshot.requests:
        if r.finish_reason is not None:
            continue  # finished, waiting only for frames or a delivery that will not come
        requests.append(
            msgspec.structs.replace(
                r,
                status=r.status
                if r.status == RequestStatus.WAITING.value
                else RequestStatus.PREEMPTED.value,
                num_computed_tokens=0,
                num_output_placeholders=0,
                block_ids=[],
                num_stale_in_flight=0,
                num_fresh_in_flight=0,
                num_partial_in_flight=0,
                prefill_complete=False,
                async_tokens_to_discard=0,
                discard_latest_async_tokens=False,
                drop_stale_output=False,
            )
        )
    kept = {r.req_id for r in requests}
    waiting = [x for x in [*snapshot.running, *snapshot.waiting] if x in kept]
    return msgspec.structs.replace(
        snapshot,
        requests=requests,
        waiting=waiting,
        running=[],
        in_flight_steps=[],
        pending_output=[x for x in snapshot.pending_output if x in kept],
        kv_cache=ev.KVCacheSnapshot([(0, num_blocks)], [], [], []),
        stop_streams=[s for s in snapshot.stop_streams if s.req_id in kept],
    )
