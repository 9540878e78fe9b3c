"""The injectable faults (names and upstream bugs: tokentape.events.faults) and the engine
that carries them.

The factory builds a `FaultInjectingEngineCore` only when the config names faults, so the
default engine carries none of this. Each fault is an `EngineHooks` (hooks.py) acting at the
places this engine and its scheduler (FaultInjectingScheduler) offer, keeping its own notes
of what the upstream code got wrong; request state still changes only through the reducer.
Every fault is deterministic: a replay of the tape (which records the faults in its header)
builds them again and decides the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec.structs

from tokentape.engine.config import EngineConfig
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.core.fault_injecting_scheduler import FaultInjectingScheduler
from tokentape.engine.core.scheduler import Scheduler
from tokentape.engine.core.step_plan import StepPlan
from tokentape.engine.hooks import EngineHooks
from tokentape.engine.runners.base import ModelRunner, ScheduledBatch
from tokentape.engine.tokenizer import Tokenizer
from tokentape.events import schema as ev
from tokentape.events.reducer import kv_cache_alone_asleep
from tokentape.events.schema import SamplingParams
from tokentape.events.state import EngineState, RequestState, RequestStatus
from tokentape.events.store import TapeWriter
from tokentape.lora.request import LoRARequest


class SpecPlaceholderInput(EngineHooks):
    """vLLM #40768: a request preempted with speculative slots in flight keeps its -1 draft
    placeholders, and the step that admits it again takes them as input ids (after its
    prompt and output). A real model reads embedding -1; the oracle counts each -1 as a
    position, so the request's stream skips that many tokens."""

    def __init__(self, sched: Scheduler, state: EngineState) -> None:
        self.sched, self.state = sched, state
        self.leftover: dict[str, int] = {}  # request -> draft placeholders it still holds

    def before_preempt(self, req: RequestState) -> None:
        spec = [
            e.num_spec_tokens
            for _, e in self.state.in_flight_entries(req.req_id)
            if e.epoch == req.epoch
        ]
        if spec and spec[-1]:
            self.leftover[req.req_id] = spec[-1]

    def after_waiting_admitted(self, plan: StepPlan, skipped: list[str]) -> None:
        leftover, state = self.leftover, self.state
        for req_id, entry in list(plan.entries.items()):
            n = leftover.get(req_id)
            if n is None or req_id not in plan.batch.new_requests or plan.budget < n:
                continue
            total = entry.num_computed_before + entry.num_new_tokens
            if total < state.requests[req_id].num_tokens:
                continue  # a chunk short of the end has no slot for drafts
            more = self.sched.kv.allocate(len(entry.new_block_ids), total + n)
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


class LateStopAfterDrain(EngineHooks):
    """vLLM #49860: pause_generation drains the steps in flight, but their placeholders are
    not returned; vLLM's look-ahead (skip a request once computed + 2 - placeholders reaches
    prompt + max_tokens) then fails, and one more decode is scheduled per step drained."""

    def __init__(self, sched: Scheduler, state: EngineState) -> None:
        self.sched, self.state = sched, state
        self.inflated: dict[str, int] = {}

    def before_pause(self) -> None:
        state, inflated = self.state, self.inflated
        for req_id in state.running:
            n = state.requests[req_id].num_fresh_in_flight
            if n:
                inflated[req_id] = inflated.get(req_id, 0) + n

    def before_preempt(self, req: RequestState) -> None:
        self.inflated.pop(req.req_id, None)  # a preemption zeroes the placeholders

    def after_running_scheduled(self, plan: StepPlan) -> None:
        sched, state = self.sched, self.state
        for req_id in list(state.running):
            extra = self.inflated.get(req_id)
            req = state.requests[req_id]
            if (
                not extra
                or req_id in plan.entries
                or plan.budget <= 0
                or not req.prefill_complete
                or req.status is not RequestStatus.RUNNING
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


class _AbortedInFlight(EngineHooks):
    """Notes each request aborted with a step in flight, before the abort; `after_step`
    runs after each frame with the request ids of its step."""

    def __init__(
        self, note: Callable[[RequestState], None], after_step: Callable[[list[str]], None]
    ) -> None:
        self.note, self.after_step = note, after_step

    def before_finish(self, req: RequestState, reason: str) -> None:
        if reason == "abort" and req.num_in_flight:
            self.note(req)

    def after_frame(self, req_ids: list[str]) -> None:
        self.after_step(req_ids)


def double_free_on_abort(sched: Scheduler, state: EngineState) -> EngineHooks:
    """vLLM #33377: the blocks of a request aborted with a step in flight are freed at the
    abort and again when that step's output comes back, as vLLM's block pool frees them
    (no check): by then another request may hold them, and they are handed out twice."""
    kv = sched.kv
    pending: dict[str, list[int]] = {}

    def free_again(ids: list[str]) -> None:
        for req_id in ids:
            for b in reversed(pending.pop(req_id, [])):
                if kv.ref_cnt[b] > 0:
                    kv.ref_cnt[b] -= 1
                    if kv.ref_cnt[b] == 0:
                        kv.free_queue[b] = None

    return _AbortedInFlight(
        lambda req: pending.__setitem__(req.req_id, list(req.block_ids)), free_again
    )


def crash_on_aborted_output(sched: Scheduler, state: EngineState) -> EngineHooks:
    """vLLM #52969: output that comes back for a request aborted while its step was in
    flight is looked up among the live requests, and the engine crashes."""
    aborted: set[str] = set()

    def look_up(ids: list[str]) -> None:
        for req_id in ids:
            if req_id in aborted:
                raise KeyError(
                    f"output for request {req_id!r}, which is no longer running (aborted)"
                )

    return _AbortedInFlight(lambda req: aborted.add(req.req_id), look_up)


class PrefixCacheKeptAcrossWeightUpdate(EngineHooks):
    """NeMo-RL #4018 (lmdeploy #4917, SGLang #26792): the prefix cache is never reset across
    weight updates. The pause that precedes an update asks for clear_cache=True (on the tape),
    drains, and resets nothing: no PrefixCacheReset, running requests keep their KV, and the
    blocks the old weights computed stay cached for the requests after the update."""

    def clears_cache_on_pause(self) -> bool:
        return False


class SkippedWaitingHoldsSeats(EngineHooks):
    """vLLM #53130: a waiting request the admission loop cannot admit yet is skipped (vLLM's
    skipped_waiting holds requests waiting on remote KV, a grammar or streaming input; here,
    on KV blocks) and keeps counting against max_num_seqs while it waits. Once running plus
    skipped requests reach max_num_seqs the loop admits nobody, the skipped ones included, so
    admission stops for good while the running requests are served as usual."""

    def __init__(self, sched: Scheduler, state: EngineState) -> None:
        self.state = state
        self.skipped: dict[str, None] = {}  # in the order they were skipped

    def seats_held(self) -> int:
        requests, waiting = self.state.requests, (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self.skipped = {r: None for r in self.skipped if requests[r].status in waiting}
        return len(self.skipped)

    def skips_short_requests(self) -> bool:
        return True

    def after_waiting_admitted(self, plan: StepPlan, skipped: list[str]) -> None:
        self.skipped.update(dict.fromkeys(skipped))


class StaleOverlapInput(EngineHooks):
    """tenstorrent/vllm #395: the overlap path submits step N+1 before step N's sampled tokens
    are applied to the runner's input batch, so N+1 reads N's input again and samples N's
    position a second time; the client gets that token twice and every later token one place
    late. There the steady state broke in its DP path; here a step where a request joins the
    batch (its shape changes) does it, to each decode with its previous step in flight. The
    tape records the step as scheduled; the frame's `position` records what was sampled."""

    def __init__(self, sched: Scheduler, state: EngineState) -> None:
        self.state = state

    def before_submit(self, batch: ScheduledBatch) -> None:
        if not batch.new_requests:
            return
        requests, stale = self.state.requests, False
        entries = list(batch.entries)  # the recorded list stays as it is
        for i, e in enumerate(entries):
            req = requests[e.req_id]
            c = e.num_computed_before - 1  # step N's input position
            if (
                e.req_id in batch.token_ids  # a prefill: its input is known, not sampled
                or e.num_spec_tokens
                or req.num_fresh_in_flight < 2  # step N's output is already applied
                or not 0 <= c < req.num_tokens
            ):
                continue
            entries[i] = msgspec.structs.replace(e, num_computed_before=c)
            batch.token_ids[e.req_id] = req.token_ids_between(c, c + 1)
            stale = True
        if stale:
            batch.entries = entries


class FreeBlocksInFlight(EngineHooks):
    """vLLM #45357/#47728: a request aborted or preempted with a step in flight gives its KV
    blocks back at once, although that step still writes them, and they are handed out
    again. vLLM's ordered steps make that safe for a new owner that computes the block; not
    for one whose KV a connector loads into it (its PD consumer), unordered with the step.
    Here the request admitted next takes such blocks, at the front of its own, as holding its
    loaded prefix: their tokens count as computed, and the stale write lands on them."""

    def __init__(self, sched: Scheduler, state: EngineState) -> None:
        self.state, self.block_size = state, sched.config.block_size
        self.fenced: dict[int, int] = {}  # block -> the step in flight that writes it

    def _note(self, req: RequestState) -> None:
        bs = self.block_size
        for step, e in self.state.in_flight_entries(req.req_id):
            if e.epoch != req.epoch:
                continue
            last = (e.num_computed_before + e.num_new_tokens - 1) // bs
            for i in range(e.num_computed_before // bs, min(last + 1, len(req.block_ids))):
                self.fenced[req.block_ids[i]] = step

    def before_preempt(self, req: RequestState) -> None:
        self._note(req)

    def before_finish(self, req: RequestState, reason: str) -> None:
        if reason == "abort":
            self._note(req)

    def after_frame(self, req_ids: list[str]) -> None:
        in_flight = {s.step for s in self.state.in_flight_steps}
        self.fenced = {b: s for b, s in self.fenced.items() if s in in_flight}

    def after_waiting_admitted(self, plan: StepPlan, skipped: list[str]) -> None:
        bs, requests = self.block_size, self.state.requests
        for req_id in plan.batch.new_requests:
            entry = plan.entries.get(req_id)
            if entry is None or entry.num_computed_before:
                continue
            k = 0
            while k < len(entry.new_block_ids) and entry.new_block_ids[k] in self.fenced:
                k += 1
            loaded = min(k * bs, entry.num_new_tokens - 1, requests[req_id].num_tokens - 1)
            loaded -= loaded % bs
            if loaded <= 0:
                continue
            plan.entries[req_id] = msgspec.structs.replace(
                entry, num_computed_before=loaded, num_new_tokens=entry.num_new_tokens - loaded
            )
            plan.budget += loaded
            for b in entry.new_block_ids[: loaded // bs]:
                del self.fenced[b]  # taken
            return  # one request takes them


class ParkRequestsWhileAsleep(EngineHooks):
    """vLLM #45268: a request that reaches the engine core while it sleeps is parked in the
    waiting queue, and nothing takes it out again: after the wake-up admission passes over
    it while the engine serves the others, with room for it, and its client waits for ever."""

    def __init__(self, sched: Scheduler, state: EngineState) -> None:
        self.state = state
        self.parked: set[str] = set()

    def after_add(self, req_ids: list[str]) -> None:
        if self.state.sleep_level is not None:
            self.parked.update(req_ids)

    def admission_candidates(self, waiting: list[str]) -> list[str]:
        requests = self.state.requests
        self.parked = {r for r in self.parked if not requests[r].is_finished}
        return [r for r in waiting if r not in self.parked] if self.parked else waiting


class SleepWithoutDrain(EngineHooks):
    """vLLM #45520: the pause a sleep starts with does not wait for the steps in flight, so
    the sleep releases the memory they run on (EngineSlept records them in flight) and
    returns as if all were well; collecting such a step while the memory is released fails
    the engine, as vLLM's worker died of an illegal memory access."""

    def __init__(self, sched: Scheduler, state: EngineState) -> None:
        self.state = state

    def drains_on_pause(self) -> bool:
        return False

    def before_frame(self, step: int) -> None:
        if self.state.sleeping_tags:
            raise RuntimeError(
                f"illegal memory access: step {step} ran on memory the sleep released "
                f"({', '.join(self.state.sleeping_tags)})"
            )


class ResumeOnPartialWake(EngineHooks):
    """vLLM #44395 (fixed by #44483): a wake-up of the weights alone (the RL order: sleep,
    wake_up(["weights"]), update the weights, wake_up(["kv_cache"])) resumes generation as a
    full one does, so the scheduler schedules steps while the KV cache is still released
    (FaultInjectingEngineCore.wake_up records the GenerationResumed; the reducer fault of the
    same name accepts it and those steps). vLLM's next forward pass wrote the released KV
    cache and the engine died of an illegal memory access; here the first such step fails
    the engine when it goes to the runner, whatever the runner (the oracle holds no KV memory
    that could fault): the tape ends on that StepScheduled and the EngineError, the clearest
    record of what vLLM did (no frame, no output of a step on a KV cache that is not there)."""

    def __init__(self, sched: Scheduler, state: EngineState) -> None:
        self.state = state

    def before_submit(self, batch: ScheduledBatch) -> None:
        if "kv_cache" in self.state.sleeping_tags:
            raise RuntimeError(
                f"illegal memory access: step {batch.step} writes the KV cache, which the "
                "sleep released and the wake-up left asleep (only the weights woke)"
            )


def _spec_placeholder_input(sched: Scheduler, state: EngineState) -> EngineHooks | None:
    # Only with speculative decoding: without draft slots there is nothing to keep.
    return SpecPlaceholderInput(sched, state) if sched.config.num_speculative_tokens else None


_FAULTS: dict[str, Callable[[Scheduler, EngineState], EngineHooks | None]] = {
    "spec_placeholder_input": _spec_placeholder_input,
    "late_stop_after_drain": LateStopAfterDrain,
    "double_free_on_abort": double_free_on_abort,
    "crash_on_aborted_output": crash_on_aborted_output,
    "prefix_cache_kept_across_weight_update": lambda sched, state: (
        PrefixCacheKeptAcrossWeightUpdate()
    ),
    "skipped_waiting_holds_seats": SkippedWaitingHoldsSeats,
    "stale_overlap_input": StaleOverlapInput,
    "free_blocks_in_flight": FreeBlocksInFlight,
    "park_requests_while_asleep": ParkRequestsWhileAsleep,
    "sleep_without_drain": SleepWithoutDrain,
    "resume_on_partial_wake": ResumeOnPartialWake,
}


def fault_hooks(config: EngineConfig, sched: Scheduler, state: EngineState) -> list[EngineHooks]:
    """The hooks of the engine's faults (its config's `faults`), in the config's order; a
    fault of the reducer alone needs none (resume_on_partial_wake is the engine's too)."""
    hooks = [_FAULTS[name](sched, state) for name in config.faults if name in _FAULTS]
    return [h for h in hooks if h is not None]


class FaultInjectingEngineCore(EngineCore):
    """EngineCore with the hooks of its config's faults (or the `hooks` given: a test's own
    fault) called where they act; its scheduler calls them where it decides."""

    scheduler_class = FaultInjectingScheduler

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tape: TapeWriter,
        tokenizer: Tokenizer | None = None,
        hooks: Sequence[EngineHooks] | None = None,
    ) -> None:
        super().__init__(config, runner, tape, tokenizer)
        scheduler = self.scheduler
        assert isinstance(scheduler, FaultInjectingScheduler)
        self.hooks = (
            list(hooks) if hooks is not None else fault_hooks(config, scheduler, self.state)
        )
        scheduler.hooks = self.hooks

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> list[str]:
        ids = super().add_request(request_id, prompt_token_ids, params, lora_request)
        for hook in self.hooks:
            hook.after_add(ids)
        return ids

    def _submit(self, batch: ScheduledBatch) -> None:
        for hook in self.hooks:
            hook.before_submit(batch)
        super()._submit(batch)

    def _apply_frame(self) -> None:
        oldest = self.state.in_flight_steps[0]
        for hook in self.hooks:
            hook.before_frame(oldest.step)
        super()._apply_frame()
        ids = [e.req_id for e in oldest.entries]
        for hook in self.hooks:
            hook.after_frame(ids)

    def _before_pause(self) -> None:
        for hook in self.hooks:
            hook.before_pause()

    def _drains_on_pause(self) -> bool:
        return all(hook.drains_on_pause() for hook in self.hooks)

    def _clears_cache_on_pause(self) -> bool:
        return all(hook.clears_cache_on_pause() for hook in self.hooks)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """As the engine's, and with resume_on_partial_wake (vLLM #44395) a wake-up that
        leaves the KV cache asleep, the weights awake, resumes generation anyway: its
        GenerationResumed follows the EngineWokeUp in the same commit."""
        with self.one_commit():
            super().wake_up(tags)
            state = self.state
            if (
                any(isinstance(hook, ResumeOnPartialWake) for hook in self.hooks)
                and state.paused is not None
                and kv_cache_alone_asleep(state)
            ):
                with self._recorded():
                    self._emit(ev.GenerationResumed(state.step))
