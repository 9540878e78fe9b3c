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
from tokentape.engine.runners.base import NewRequest, ScheduledBatch
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
        self.emit(ev.RequestPreempted(self.state.step, req.req_id, reason, req.num_in_flight))

    def finish(self, req: RequestState, reason: ev.FinishReason) -> None:
        self.kv.free(req.req_id, req.block_ids)
        self.kv.forget_request(req.req_id)
        if reason == "abort":
            self.emit(ev.RequestAborted(self.state.step, req.req_id))
        else:
            self.emit(ev.RequestFinished(self.state.step, req.req_id, reason))

    def schedule(self) -> ScheduledBatch | None:
        state = self.state
        if state.paused in ("keep", "abort"):
            return None
        config, kv, requests = self.config, self.kv, state.requests
        step = state.step
        budget = config.max_num_batched_tokens
        entries: dict[str, ev.ScheduledEntry] = {}
        batch = ScheduledBatch(step, [])
        preempted = False
        max_model_len, max_spec = self.max_model_len, config.num_speculative_tokens

        for req_id in list(state.running):
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
                    num_spec = max(0, min(max_spec, budget - num_new, max_model_len - computed - num_new))
                    num_new += num_spec
            while (new_blocks := kv.allocate(len(req.block_ids), computed + num_new)) is None:
                victim = requests[state.running[-1]]
                pending = entries.pop(victim.req_id, None)
                if pending is not None:
                    batch.token_ids.pop(victim.req_id, None)
                    batch.partial_prefills.discard(victim.req_id)
                    budget += pending.num_new_tokens
                self.preempt(victim, "kv_pressure", pending.new_block_ids if pending else ())
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                continue
            kv.cache_full_blocks(req, req.block_ids, new_blocks, computed + num_new)
            entries[req_id] = ev.ScheduledEntry(req_id, req.epoch, computed, num_new, num_spec, new_blocks)
            if not decode:  # a decode's input is the runner's own last sample
                batch.token_ids[req_id] = req.token_ids_between(computed, computed + num_new)
                if computed + num_new < num_tokens:
                    batch.partial_prefills.add(req_id)
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
                batch.new_requests[req_id] = NewRequest(req.prompt_token_ids, req.params)
                batch.token_ids[req_id] = req.token_ids_between(0, num_cached + num_new)
                if num_cached + num_new < req.num_tokens:
                    batch.partial_prefills.add(req_id)
                budget -= num_new
                num_running += 1

        if not entries:
            return None
        batch.entries = list(entries.values())
        self.emit(ev.StepScheduled(step, batch.entries))
        return batch
