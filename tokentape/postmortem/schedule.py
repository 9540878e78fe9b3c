"""Checkers of the scheduler's decisions, read from each StepScheduled before the reducer
applies it:

- `spec_placeholder_in_input`: a request admitted (from waiting, so its tokens are all
  confirmed and it has no drafts) with speculative slots: the slots can only hold draft
  placeholders (-1) left from before its preemption, and they are the step's input ids
  (vLLM #40768). Not an admission whose one token left to compute is padded with -1 drafts
  to the uniform decode size (vLLM since 0.26, `pad_spec_decode`, for full CUDA graphs): the
  padding is the scheduler's own, rejected by the sampler like any wrong draft.
- `scheduled_past_stop`: a decode scheduled for a request whose steps in flight already
  produce every token it may still take (max_tokens, capped by max_model_len): vLLM's
  async scheduler must schedule prompt + max_tokens - 1 tokens in all, no more; one more
  step means its stop comes late. vLLM #49860 where the request's in-flight output was drained
  by a pause, or discarded after `reset_prefix_cache` preempted it with steps in flight
  (vLLM 0.20-0.26: the discarded frames do not give their placeholders back, which then
  count tokens that never come).
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.events.state import RequestStatus
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context


class ScheduleChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._drained: set[str] = set()  # requests whose in-flight output a pause drained
        self._discarded: set[str] = set()  # preempted by a reset with output in flight

    def before(self) -> dict[type, Hook]:
        return {
            ev.StepScheduled: self._scheduled,
            ev.GenerationPaused: self._paused,
            ev.RequestPreempted: self._preempted,
        }

    def _preempted(self, seq: int, e: ev.RequestPreempted) -> None:
        if e.reason == "reset_prefix_cache" and e.in_flight:
            self._discarded.add(e.req_id)

    def _paused(self, seq: int, e: ev.GenerationPaused) -> None:
        requests = self.state.requests
        self._drained.update(r for r in self.state.running if requests[r].num_fresh_in_flight)

    def _scheduled(self, seq: int, e: ev.StepScheduled) -> None:
        requests, running = self.state.requests, RequestStatus.RUNNING
        for entry in e.entries:
            req = requests.get(entry.req_id)
            if req is None or req.finish_reason is not None:
                continue  # the reducer refuses it
            if req.status is not running:
                padded = (
                    entry.num_new_tokens == 1 + entry.num_spec_tokens
                    and entry.num_computed_before + 1 == req.num_tokens
                )
                if entry.num_spec_tokens and not padded:
                    self.ctx.report(
                        "spec_placeholder_in_input",
                        "error",
                        [req.req_id],
                        e.step,
                        f"request {req.req_id!r} was admitted in step {e.step} with "
                        f"{entry.num_spec_tokens} speculative slot(s): an admitted request has no "
                        "drafts, so the slots hold draft placeholders (-1) as input ids",
                        [(seq, e)],
                        "vllm#40768",
                        seq,
                    )
                continue
            if req.prefill_complete and req.num_fresh_in_flight >= req.max_output_tokens - len(
                req.output_token_ids
            ):
                drained = (
                    " after a drain"
                    if req.req_id in self._drained
                    else " after a reset discarded its output in flight"
                    if req.req_id in self._discarded
                    else ""
                )
                bug = "vllm#49860" if drained else None
                self.ctx.report(
                    "scheduled_past_stop",
                    "error",
                    [req.req_id],
                    e.step,
                    f"request {req.req_id!r} was scheduled in step {e.step}{drained} although its "
                    f"{req.num_fresh_in_flight} step(s) in flight already produce the last of its "
                    f"{req.max_output_tokens} tokens: its stop comes late",
                    [(seq, e)],
                    bug,
                    seq,
                )
