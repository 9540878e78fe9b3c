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

from collections.abc import Callable

from tokentape.engine.config import EngineConfig
from tokentape.engine.kv_cache_manager import KVCacheManager
from tokentape.engine.runners.base import RunnerEntry, ScheduledBatch
from tokentape.events import schema as ev
from tokentape.events.state import EngineState, RequestState, RequestStatus


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        state: EngineState,
        emit: Callable[[ev.Event], None],
    ) -> None:
        self.config = config
        self.kv = kv
        self.state = state
        self.emit = emit
        self.max_model_len = config.effective_max_model_len

    def preempt(self, req: RequestState, reason: ev.PreemptReason, extra_blocks: list[int] = ()) -> None:  # type: ignore[assignment]
        """Free the request's KV and record the preemption; the reducer requeues it."""
        self.kv.free(req.req_id, req.block_ids + list(extra_blocks))
        self.emit(ev.RequestPreempted(self.state.step, req.req_id, reason, len(req.in_flight)))

    def finish(self, req: RequestState, reason: ev.FinishReason) -> None:
        self.kv.free(req.req_id, req.block_ids)
        self.kv.forget_request(req.req_id)
        if reason == "abort":
            self.emit(ev.RequestAborted(self.state.step, req.req_id))
        else:
            self.emit(ev.RequestFinished(self.state.step, req.req_id, reason))

    def _num_draft_slots(self, req: RequestState, num_new: int, budget: int) -> int | None:
        """Draft slots for a decode of this request, or None to skip it this step."""
        remaining = min(
            req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens
        )
        if req.num_fresh_in_flight >= remaining:
            return None  # the steps in flight already produce every token it may still have
        room = self.max_model_len - req.num_computed_tokens - num_new
        return max(0, min(self.config.num_speculative_tokens, budget - num_new, room))

    def schedule(self) -> ScheduledBatch | None:
        state = self.state
        if state.paused in ("keep", "abort"):
            return None
        config, kv, requests = self.config, self.kv, state.requests
        step = state.step
        budget = config.max_num_batched_tokens
        entries: dict[str, ev.ScheduledEntry] = {}
        runner_entries: dict[str, RunnerEntry] = {}
        preempted = False

        for req_id in list(state.running):
            if budget <= 0:
                break
            req = requests[req_id]
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            computed = req.num_computed_tokens
            known = req.num_tokens - computed  # confirmed tokens not computed yet
            # Without a known token the input is the placeholder the runner fills in (async).
            num_new = min(known, budget) if known > 0 else 1
            token_ids = req.all_token_ids[computed:computed + num_new] if known > 0 else []
            num_spec = 0
            if known <= 0 or (known == 1 and req.output_token_ids):  # a decode, not a prefill chunk
                slots = self._num_draft_slots(req, num_new, budget)
                if slots is None:
                    continue
                if computed + num_new > self.max_model_len:
                    # Only a historical discard policy can push a request here (its dropped
                    # frames left positions computed); cap it as vLLM caps at max_model_len.
                    self.finish(req, "length")
                    continue
                num_spec = slots
                num_new += slots
            while (new_blocks := kv.allocate(len(req.block_ids), computed + num_new)) is None:
                victim = requests[state.running[-1]]
                pending = entries.pop(victim.req_id, None)
                if pending is not None:
                    runner_entries.pop(victim.req_id)
                    budget += pending.num_new_tokens
                self.preempt(victim, "kv_pressure", pending.new_block_ids if pending else ())
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                continue
            kv.cache_full_blocks(req, req.block_ids, new_blocks, computed + num_new)
            entries[req_id] = ev.ScheduledEntry(req_id, req.epoch, computed, num_new, num_spec, new_blocks)
            runner_entries[req_id] = RunnerEntry(
                req_id, req.prompt_token_ids, req.params, req.epoch, computed, num_new, num_spec,
                token_ids, False, computed + num_new >= req.num_tokens,
            )
            budget -= num_new

        if not preempted and state.paused is None:
            num_running = len(state.running)
            for req_id in list(state.waiting):
                if budget <= 0 or num_running >= config.max_num_seqs:
                    break
                req = requests[req_id]
                hits = kv.get_computed_blocks(req)
                num_cached = len(hits) * kv.block_size
                num_new = min(req.num_tokens - num_cached, budget)
                new_blocks = kv.allocate(0, num_cached + num_new, hits)
                if new_blocks is None:
                    break
                kv.cache_full_blocks(req, [], new_blocks, num_cached + num_new)
                entries[req_id] = ev.ScheduledEntry(req_id, req.epoch, num_cached, num_new, 0, new_blocks)
                runner_entries[req_id] = RunnerEntry(
                    req_id, req.prompt_token_ids, req.params, req.epoch, num_cached, num_new, 0,
                    req.all_token_ids[:num_cached + num_new], True,
                    num_cached + num_new >= req.num_tokens,
                )
                budget -= num_new
                num_running += 1

        if not entries:
            return None
        self.emit(ev.StepScheduled(step, list(entries.values())))
        return ScheduledBatch(step, list(runner_entries.values()))
