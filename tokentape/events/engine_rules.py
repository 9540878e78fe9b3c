"""The reducer's rules for the events that change the engine rather than a request: pause
and resume, prefix-cache resets, weight updates (whole or chunked) and sleep mode. Each checks
what must hold for its event (a weight change or a sleep with nothing in flight, a wake-up of
a sleeping engine) and raises ReducerError otherwise; reducer.py dispatches to them.
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.events.fold_errors import ReducerError
from tokentape.events.state import EngineState


def on_paused(state: EngineState, e: ev.GenerationPaused) -> None:
    state.paused = e.mode


def on_resumed(state: EngineState, e: ev.GenerationResumed) -> None:
    if state.sleep_level is not None:
        raise ReducerError(f"generation resumed in step {e.step} while the engine sleeps")
    state.paused = None


def on_prefix_cache_reset(state: EngineState, e: ev.PrefixCacheReset) -> None:
    state.num_prefix_cache_resets += e.ok


def check_drained(state: EngineState, e: ev.Event, what: str) -> None:
    # The version of a delivered token is the one in force at its OutputsEmitted: true only if
    # weights change with nothing in flight and nothing undelivered (the engine's own rule).
    if state.in_flight_steps or state.pending_output:
        raise ReducerError(
            f"{what} in step {e.step} with {len(state.in_flight_steps)} step(s) in flight and "
            f"{len(state.pending_output)} request(s) with undelivered output"
        )


def on_weights_updated(state: EngineState, e: ev.WeightsUpdated) -> None:
    check_drained(state, e, "weights updated")
    state.weights_id = e.weights_id
    state.num_weight_updates += 1
    state.weight_version = e.weight_version or str(state.num_weight_updates)
    state.weight_update_chunks = None  # the finish of a chunked transfer, if one was open


def on_weight_update_started(state: EngineState, e: ev.WeightUpdateStarted) -> None:
    if state.weight_update_chunks is not None:
        raise ReducerError(f"weight update started in step {e.step} while one was open")
    check_drained(state, e, "weight update started")
    state.weight_update_chunks = 0


def on_weight_chunk(state: EngineState, e: ev.WeightChunkReceived) -> None:
    if state.weight_update_chunks is None:
        raise ReducerError(f"weight chunk received in step {e.step} with no update started")
    if not len(e.names) == len(e.shapes) == len(e.hashes):
        raise ReducerError(
            f"weight chunk of step {e.step} has {len(e.names)} names, {len(e.shapes)} shapes "
            f"and {len(e.hashes)} hashes"
        )
    state.weight_update_chunks += 1


def on_slept(state: EngineState, e: ev.EngineSlept) -> None:
    if state.sleep_level is not None:
        raise ReducerError(f"the engine fell asleep in step {e.step} while asleep already")
    if e.level not in ev.SLEEP_LEVELS:
        raise ReducerError(f"sleep level {e.level} in step {e.step} is not one of 0, 1, 2")
    if state.paused is None:
        raise ReducerError(f"the engine fell asleep in step {e.step} without pausing first")
    in_flight = [s.step for s in state.in_flight_steps]
    kept = [r.req_id for r in state.unfinished]
    if e.in_flight != in_flight or e.kept != kept:
        raise ReducerError(
            f"EngineSlept of step {e.step} lists steps {e.in_flight} in flight and requests "
            f"{e.kept} kept; the tape has {in_flight} and {kept}"
        )
    state.sleep_level = e.level
    state.sleeping_tags = ev.MEMORY_TAGS if e.level else ()


def on_woke_up(state: EngineState, e: ev.EngineWokeUp) -> None:
    if state.sleep_level is None:
        raise ReducerError(f"the engine woke up in step {e.step} while awake")
    if e.tags is None:
        state.sleeping_tags = ()
    else:
        unknown = [t for t in e.tags if t not in ev.WAKE_TAGS]
        if unknown:
            raise ReducerError(f"wake-up in step {e.step} names unknown tags {unknown}")
        state.sleeping_tags = tuple(t for t in state.sleeping_tags if t not in e.tags)
    if e.weights_id is not None:  # rebuilt after level 2: the model's own weights again
        check_drained(state, e, "weights rebuilt")
        state.weights_id = e.weights_id
        state.weight_version = "default"
    if not state.sleeping_tags:
        state.sleep_level = None


def on_collective_rpc(state: EngineState, e: ev.CollectiveRPC) -> None:
    """A worker call: the weights serving from here on, when it changed them."""
    if e.weights_id is not None:
        state.weights_id = e.weights_id


def on_lora_added(state: EngineState, e: ev.LoRAAdded) -> None:
    if e.lora_int_id < 1:
        raise ReducerError(f"LoRA adapter added in step {e.step} with id {e.lora_int_id} (< 1)")
    if e.lora_int_id in state.loras:
        raise ReducerError(f"LoRA adapter {e.lora_int_id} added in step {e.step} twice")
    state.loras[e.lora_int_id] = e


def on_lora_removed(state: EngineState, e: ev.LoRARemoved) -> None:
    if e.lora_int_id not in state.loras:
        raise ReducerError(f"LoRA adapter {e.lora_int_id} removed in step {e.step}: not loaded")
    users = state.lora_users(e.lora_int_id)
    if users:
        raise ReducerError(
            f"LoRA adapter {e.lora_int_id} removed in step {e.step} while {len(users)} "
            f"unfinished request(s) run with it ({users[0]!r} first)"
        )
    del state.loras[e.lora_int_id]
