"""The scheduler (decide): reads the reducer's state and emits events, never mutating it.

One step, in vLLM V1's order:
1. running requests first: the next prefill chunk, or a decode of 1 + k tokens (k draft
   slots for speculative decoding); when KV blocks run out, the most recently admitted
   running request is preempted (by recompute) until the allocation fits;
2. then waiting requests, front first, with prefix-cache hits, unless this step preempted
   or generation is paused;
all within `max_num_batched_tokens` and `max_num_seqs`.

With async scheduling a request may have steps in flight: decodes are scheduled on the
output placeholders of the steps before (the runner fills them in), and a request whose
in-flight steps already reach its token limit is not scheduled again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokentape.engine.config import EngineConfig
from tokentape.engine.core.kv_cache_manager import KVCacheManager
from tokentape.engine.core.step_plan import StepPlan
from tokentape.engine.runners.base import NewRequest, ScheduledBatch
from tokentape.engine.stop_strings import StopStringChecker
from tokentape.events import schema as ev
from tokentape.events.discard import get_policy
from tokentape.events.state import EngineState, RequestState, RequestStatus
from tokentape.events.stop_check import check_stop


class Scheduler:
    """The decide half of the engine: owns the planning of each step (which requests run,
    with how many tokens, which are preempted or finished) over the reducer's state and the
    KV cache manager's blocks, and whether each request the latest frame gave tokens is
    finished (`update_from_output`). It changes nothing itself: every decision is an event
    it emits through the engine, which records it and applies it with the reducer.
    `stop_strings`: the engine's stop-string matcher (it decodes the output text). Upstream
    bugs are injected by a subclass (fault_injecting_scheduler.py), never through this one."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        state: EngineState,
        emit: Callable[[ev.Event], None],
        stop_strings: StopStringChecker | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.state = state
        self.emit = emit
        self.stop_strings = stop_strings
        self.max_model_len = config.effective_max_model_len

    def preempt(
        self, req: RequestState, reason: ev.PreemptReason, extra_blocks: Sequence[int] = ()
    ) -> None:
        """Free the request's KV (and blocks given to it in the step being planned) and
        record the preemption; the reducer requeues it."""
        self.kv.free(req.req_id, [*req.block_ids, *extra_blocks])
        self.emit(ev.RequestPreempted(self.state.step, req.req_id, reason, req.num_in_flight))

    def update_from_output(self) -> None:
        """After a frame is applied: finish every request it brought to a stop, as vLLM's
        `update_from_output` does with `check_stop`. The one place a request's finish is
        decided, but for aborts (the caller's) and the max_model_len cap of `schedule`.

        Stop token or length first (events/stop_check.py); then, for a request with stop
        strings, the text the frame's tokens add, up to that stop: a stop string found
        there finishes it with reason "stop", over a length finish, as in vLLM."""
        state = self.state
        eos = state.eos_token_id
        stop_strings = self.stop_strings
        for req, start in state.frame_outputs:
            if req.finish_reason is not None:
                continue
            output = req.output_token_ids
            num_output = len(output)
            if (  # the common case, one token that stops nothing, without a call
                num_output == start + 1
                and num_output < req.max_output_tokens
                and output[start] not in req.stop_ids
                and not req.has_stop_strings
            ):
                continue
            decision = check_stop(req, start, eos)
            if req.has_stop_strings and stop_strings is not None:
                if decision is None or decision.reason != "stop":  # a stop token wins
                    kept = num_output if decision is None else decision.num_output_tokens
                    found = stop_strings.find(req, kept)
                    if found is not None:
                        self.finish(req, "stop", found, kept)
                        continue
            if decision is not None:
                self.finish(req, decision.reason, decision.stop_reason, decision.num_output_tokens)

    def finish(
        self,
        req: RequestState,
        reason: ev.FinishReason,
        stop_reason: str | int | None = None,
        num_output_tokens: int | None = None,
    ) -> None:
        """Free the request's blocks and record its finish: with vLLM's stop_reason (the stop
        string or token id that ended it) and its output's length (default: every token it
        has; a frame's tokens after the stop are cut)."""
        self.kv.free(req.req_id, req.block_ids)
        self.kv.forget_request(req.req_id)
        if reason == "abort":
            self.emit(ev.RequestAborted(self.state.step, req.req_id))
            return
        if num_output_tokens is None:
            num_output_tokens = len(req.output_token_ids)
        self.emit(
            ev.RequestFinished(self.state.step, req.req_id, reason, stop_reason, num_output_tokens)
        )

    def schedule(self) -> ScheduledBatch | None:
        """Plan the next step and record it; None when there is nothing to run."""
        state = self.state
        if state.paused in ("keep", "abort"):
            return None
        plan = StepPlan(ScheduledBatch(state.step, []), self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted and state.paused is None:  # "wait" admits nothing new
            self._admit_waiting(plan)
        if not plan.entries:
            return None
        plan.batch.entries = list(plan.entries.values())
        self.emit(ev.StepScheduled(plan.batch.step, plan.batch.entries))
        return plan.batch

    def _schedule_running(self, plan: StepPlan) -> None:
        state, kv, requests = self.state, self.kv, self.state.requests
        max_model_len, max_spec = self.max_model_len, self.config.num_speculative_tokens
        for req_id in list(state.running):
            budget = plan.budget
            if budget <= 0:
                break
            req = requests[req_id]
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            computed = req.num_computed_tokens
            num_output = len(req.output_token_ids)
            num_tokens = req.num_prompt_tokens + num_output
            known = num_tokens - computed  # confirmed tokens not computed yet
            # Without a known token the input is the placeholder the runner fills in (async).
            num_new = min(known, budget) if known > 0 else 1
            num_spec = 0
            decode = known <= 0 or (known == 1 and req.prefill_complete)
            if decode:
                remaining = min(req.params.max_tokens - num_output, max_model_len - num_tokens)
                if req.num_fresh_in_flight >= remaining:
                    continue  # the steps in flight already produce every token it may have
                if computed + num_new > max_model_len:
                    if req.num_fresh_in_flight:
                        continue  # draft positions in flight count as computed until they return
                    # Only a historical discard policy can push a request here (its dropped
                    # frames left positions computed); cap it as vLLM caps at max_model_len.
                    self.finish(req, "length")
                    continue
                if max_spec:
                    num_spec = max(
                        0, min(max_spec, budget - num_new, max_model_len - computed - num_new)
                    )
                    num_new += num_spec
            new_blocks = self._allocate_or_preempt(req, computed + num_new, plan)
            if new_blocks is None:
                continue  # it was preempted itself
            kv.cache_full_blocks(req, req.block_ids, new_blocks, computed + num_new)
            entry = ev.ScheduledEntry(req_id, req.epoch, computed, num_new, num_spec, new_blocks)
            if decode:  # its input is the runner's own last sample
                plan.add(entry, None, partial=False)
            else:
                tokens = req.token_ids_between(computed, computed + num_new)
                plan.add(entry, tokens, partial=computed + num_new < num_tokens)

    def _allocate_or_preempt(
        self, req: RequestState, num_tokens: int, plan: StepPlan
    ) -> list[int] | None:
        """Blocks for `num_tokens`, preempting the most recently admitted running requests
        until they fit; None if `req` itself had to go."""
        requests, running = self.state.requests, self.state.running
        while (new_blocks := self.kv.allocate(len(req.block_ids), num_tokens)) is None:
            victim = requests[running[-1]]
            self.preempt(victim, "kv_pressure", plan.drop(victim.req_id))
            plan.preempted = True
            if victim is req:
                return None
        return new_blocks

    def _admit_waiting(self, plan: StepPlan) -> None:
        self._admit(plan, list(self.state.waiting), len(self.state.running), None)

    def _admit(
        self, plan: StepPlan, waiting: list[str], num_running: int, skipped: list[str] | None
    ) -> None:
        """Admit `waiting` requests, front first, while the budget and `max_num_seqs` (less
        `num_running` seats taken) allow. A request whose KV blocks fall short stops admission
        (first come, first served), or, given `skipped`, goes there instead (vLLM's
        skipped_waiting, which the engine itself has no use for: a fault's)."""
        state, kv = self.state, self.kv
        # A policy that delivers stale output (vLLM since #48245) must let it drain first, or
        # the recompute would sample a position that output delivers too.
        delivers_stale = get_policy(state.discard_policy).delivers_stale
        # As vLLM: at most max_loras different adapters in a step; a request whose adapter
        # would be one too many waits, and the ones behind it may go first.
        max_loras = self.config.max_loras if self.config.enable_lora else 0
        loras = {state.requests[r].lora_int_id for r in plan.entries} - {0} if max_loras else set()
        for req_id in waiting:
            if plan.budget <= 0 or num_running >= self.config.max_num_seqs:
                break
            req = state.requests[req_id]
            if delivers_stale and req.num_stale_in_flight and not req.drop_stale_output:
                break  # first come, first served: it drains within the pipeline's depth
            lora = req.lora_int_id
            if lora and lora not in loras and len(loras) >= max_loras:
                continue
            # As vLLM: a request asking for prompt logprobs computes every prompt position
            # (cached blocks have no logits), so it takes no prefix-cache hits.
            wants_prompt_lps = req.params.prompt_logprobs is not None
            hits = kv.get_computed_blocks(req) if not wants_prompt_lps else []
            num_cached = len(hits) * kv.block_size
            num_new = min(req.num_tokens - num_cached, plan.budget)
            new_blocks = kv.allocate(0, num_cached + num_new, hits)
            if new_blocks is None:
                if skipped is None:
                    break  # first come, first served: nobody behind it jumps the queue
                skipped.append(req_id)
                continue
            kv.cache_full_blocks(req, [], new_blocks, num_cached + num_new)
            if lora:
                loras.add(lora)
            entry = ev.ScheduledEntry(req_id, req.epoch, num_cached, num_new, 0, new_blocks)
            # It (re)enters the batch: the runner gets its tokens from position 0.
            plan.batch.new_requests[req_id] = NewRequest(
                req.prompt_token_ids,
                req.params,
                wants_prompt_lps and req.prompt_logprobs is None,
                req.lora_int_id,
            )
            plan.add(
                entry,
                req.token_ids_between(0, num_cached + num_new),
                partial=num_cached + num_new < req.num_tokens,
            )
            num_running += 1
