"""What the scheduler had room for in a step: the shared rules of the checkers that report a
request left waiting although the step could have taken it (`request_stuck`,
`admission_stalled`).

The scheduler is first come, first served, as vLLM's: a step had room to admit the head of
the waiting queue when it left token budget and a sequence slot, preempted nobody for KV
pressure (such a step admits nobody), generation was not paused, the head is not a request
whose stale output must drain first (the `deliver` policy's rule), and the free KV blocks
hold all of the head's tokens (blocks shared through the prefix cache counted once per
holder, so the free count is never too high).
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.events.discard import get_policy
from tokentape.events.state import RequestState
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context


class RoomChecker(Checker):
    """A checker that asks, after each step, whether the waiting head had room in it."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        config = ctx.tape.config
        self.budget = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        # vLLM's block pool keeps block 0 as its null block: one fewer to allocate from.
        self.num_blocks = config.num_kv_blocks - (ctx.tape.header.source == "vllm")
        self.block_size = config.block_size
        self.delivers_stale = get_policy(ctx.state.discard_policy).delivers_stale
        self._pressure_step = -1  # the latest step that preempted for KV pressure

    def before(self) -> dict[type, Hook]:
        return {ev.RequestPreempted: self._preempted}

    def _preempted(self, seq: int, e: ev.RequestPreempted) -> None:
        if e.reason == "kv_pressure":
            self._pressure_step = e.step

    def free_blocks(self) -> int:
        requests = self.state.requests
        return self.num_blocks - sum(len(requests[r].block_ids) for r in self.state.running)

    def head_with_room(self, e: ev.StepScheduled, tokens: int) -> RequestState | None:
        """The head of the waiting queue, if step `e` (which scheduled `tokens`) had room to
        admit it."""
        state = self.state
        if not state.waiting or state.paused is not None or self._pressure_step == e.step:
            return None
        if len(state.running) >= self.max_seqs or tokens >= self.budget:
            return None
        head = state.requests[state.waiting[0]]
        if self.delivers_stale and head.num_stale_in_flight and not head.drop_stale_output:
            return None  # it waits for its stale output to drain, by design
        if -(-head.num_tokens // self.block_size) > self.free_blocks():
            return None
        return head
