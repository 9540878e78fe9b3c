"""Installers of the injectable faults (names and upstream bugs: tokentape.events.faults).

`LLMEngine` calls `install_faults(engine)` only when its config names faults, so the default
path carries none of this. Each installer wraps a method of that one engine or of its
scheduler (an instance attribute in front of the class's method), keeping its own notes of
what the upstream code got wrong; request state still changes only through the reducer.
Every fault is deterministic: a replay of the tape (which records the faults in its header)
installs them again and decides the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec.structs

from tokentape.events import schema as ev
from tokentape.events.faults import REDUCER_FAULTS
from tokentape.events.state import RequestState, RequestStatus

if TYPE_CHECKING:
    from tokentape.engine.llm_engine import LLMEngine
    from tokentape.engine.scheduler import _StepPlan


def _spec_placeholder_input(engine: LLMEngine) -> None:
    """vLLM #40768: a request preempted with speculative slots in flight keeps its -1 draft
    placeholders, and the step that admits it again takes them as input ids (after its
    prompt and output). A real model reads embedding -1; the oracle counts each -1 as a
    position, so the request's stream skips that many tokens."""
    sched, state, k = engine.scheduler, engine.state, engine.config.num_speculative_tokens
    leftover: dict[str, int] = {}  # request -> draft placeholders it still holds
    preempt, admit = sched.preempt, sched._admit_waiting

    def preempt_keeping_drafts(
        req: RequestState, reason: ev.PreemptReason, extra_blocks: Sequence[int] = ()
    ) -> None:
        spec = [
            e.num_spec_tokens
            for _, e in state.in_flight_entries(req.req_id)
            if e.epoch == req.epoch
        ]
        if spec and spec[-1]:
            leftover[req.req_id] = spec[-1]
        preempt(req, reason, extra_blocks)

    def admit_with_drafts(plan: _StepPlan) -> None:
        admit(plan)
        for req_id, entry in list(plan.entries.items()):
            n = leftover.get(req_id)
            if n is None or req_id not in plan.batch.new_requests or plan.budget < n:
                continue
            total = entry.num_computed_before + entry.num_new_tokens
            if total < state.requests[req_id].num_tokens:
                continue  # a chunk short of the end has no slot for drafts
            more = sched.kv.allocate(len(entry.new_block_ids), total + n)
            if more is None:
                continue
            del leftover[req_id]
            plan.entries[req_id] = msgspec.structs.replace(
                entry,
                num_new_tokens=entry.num_new_tokens + n,
                num_spec_tokens=n,
                new_block_ids=[*entry.new_block_ids, *more],
            )
            plan.budget -= n
            plan.batch.token_ids[req_id] = [*plan.batch.token_ids[req_id], *[-1] * n]

    if k:
        sched.preempt = preempt_keeping_drafts  # type: ignore[method-assign]
        sched._admit_waiting = admit_with_drafts  # type: ignore[method-assign]


def _late_stop_after_drain(engine: LLMEngine) -> None:
    """vLLM #49860: pause_generation drains the steps in flight, but their placeholders are
    not returned; vLLM's look-ahead (skip a request once computed + 2 - placeholders reaches
    prompt + max_tokens) then fails, and one more decode is scheduled per step drained."""
    sched, state = engine.scheduler, engine.state
    inflated: dict[str, int] = {}
    pause, preempt, schedule_running = (
        engine.pause_generation,
        sched.preempt,
        sched._schedule_running,
    )

    def pause_without_returning(mode: str = "keep", clear_cache: bool = True) -> None:
        for req_id in state.running:
            n = state.requests[req_id].num_fresh_in_flight
            if n:
                inflated[req_id] = inflated.get(req_id, 0) + n
        pause(mode, clear_cache)

    def preempt_zeroing(
        req: RequestState, reason: ev.PreemptReason, extra_blocks: Sequence[int] = ()
    ) -> None:
        inflated.pop(req.req_id, None)  # a preemption zeroes the placeholders
        preempt(req, reason, extra_blocks)

    def schedule_past_stop(plan: _StepPlan) -> None:
        schedule_running(plan)
        for req_id in list(state.running):
            extra = inflated.get(req_id)
            req = state.requests[req_id]
            if (
                not extra
                or req_id in plan.entries
                or plan.budget <= 0
                or not req.prefill_complete
                or req.status is not RequestStatus.RUNNING
                or req.stop_reason is not None
            ):
                continue
            computed = req.num_computed_tokens
            if (
                computed + 2 - (req.num_output_placeholders + extra)
                >= req.num_prompt_tokens + req.params.max_tokens
                or computed + 1 > sched.max_model_len
            ):
                continue  # the look-ahead holds, or there is no position left
            new_blocks = sched._allocate_or_preempt(req, computed + 1, plan)
            if new_blocks is None:
                continue
            sched.kv.cache_full_blocks(req, req.block_ids, new_blocks, computed + 1)
            plan.add(
                ev.ScheduledEntry(req_id, req.epoch, computed, 1, 0, new_blocks),
                None,
                partial=False,
            )

    engine.pause_generation = pause_without_returning  # type: ignore[method-assign]
    sched.preempt = preempt_zeroing  # type: ignore[method-assign]
    sched._schedule_running = schedule_past_stop  # type: ignore[method-assign]


def _aborted_in_flight(engine: LLMEngine, note: Callable[[RequestState], None]) -> None:
    """Call `note(req)` for each request aborted with a step in flight, before the abort."""
    finish = engine.scheduler.finish

    def finish_noting(req: RequestState, reason: ev.FinishReason, *args: Any) -> None:
        if reason == "abort" and req.num_in_flight:
            note(req)
        finish(req, reason, *args)

    engine.scheduler.finish = finish_noting  # type: ignore[method-assign]


def _after_frames(engine: LLMEngine, then: Callable[[list[str]], None]) -> None:
    """Call `then(request ids of the frame's step)` after each frame is applied."""
    apply = engine._apply_oldest_frame

    def apply_then() -> None:
        ids = [e.req_id for e in engine.state.in_flight_steps[0].entries]
        apply()
        then(ids)

    engine._apply_oldest_frame = apply_then  # type: ignore[method-assign]


def _double_free_on_abort(engine: LLMEngine) -> None:
    """vLLM #33377: the blocks of a request aborted with a step in flight are freed at the
    abort and again when that step's output comes back, as vLLM's block pool frees them
    (no check): by then another request may hold them, and they are handed out twice."""
    kv = engine.kv
    pending: dict[str, list[int]] = {}

    def free_again(ids: list[str]) -> None:
        for req_id in ids:
            for b in reversed(pending.pop(req_id, [])):
                if kv.ref_cnt[b] > 0:
                    kv.ref_cnt[b] -= 1
                    if kv.ref_cnt[b] == 0:
                        kv.free_queue[b] = None

    _aborted_in_flight(engine, lambda req: pending.__setitem__(req.req_id, list(req.block_ids)))
    _after_frames(engine, free_again)


def _crash_on_aborted_output(engine: LLMEngine) -> None:
    """vLLM #52969: output that comes back for a request aborted while its step was in
    flight is looked up among the live requests, and the engine crashes."""
    aborted: set[str] = set()

    def look_up(ids: list[str]) -> None:
        for req_id in ids:
            if req_id in aborted:
                raise KeyError(
                    f"output for request {req_id!r}, which is no longer running (aborted)"
                )

    _aborted_in_flight(engine, lambda req: aborted.add(req.req_id))
    _after_frames(engine, look_up)


_INSTALLERS: dict[str, Callable[[LLMEngine], None]] = {
    "spec_placeholder_input": _spec_placeholder_input,
    "late_stop_after_drain": _late_stop_after_drain,
    "double_free_on_abort": _double_free_on_abort,
    "crash_on_aborted_output": _crash_on_aborted_output,
}


def install_faults(engine: LLMEngine) -> None:
    """Install the engine's faults (its config's `faults`); reducer faults need nothing here."""
    for name in engine.config.faults:
        if name not in REDUCER_FAULTS:
            _INSTALLERS[name](engine)
