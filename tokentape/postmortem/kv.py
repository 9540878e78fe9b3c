"""Checkers of the paged KV cache, derived from the blocks each scheduled entry took.

Each block's holders are counted from the tape: an entry's `new_block_ids` take a reference
(prefix-cache hits first, then newly allocated blocks), a preemption or a finish gives every
block of the request back. Findings:
- `kv_block_freed_twice`: a newly allocated block was still held by another request (the
  allocator got it back twice), a block was given back more often than taken, or a block id
  lies outside the pool;
- `kv_block_leaked`: a KV-pressure preemption while so many blocks were free by the tape that
  no allocation of that step could have failed: the engine's pool lost blocks;
- `prefix_cache_reset_in_use`: a prefix-cache reset succeeded while requests held blocks.
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.events.state import RequestStatus
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context


class KVChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        config = self.ctx.tape.config
        self.num_blocks = config.num_kv_blocks
        self.block_size = config.block_size
        self.budget_blocks = -(-config.max_num_batched_tokens // self.block_size)
        self.refs = [0] * self.num_blocks
        self.holder: list[str | None] = [None] * self.num_blocks  # latest request to take it
        self.used = 0  # blocks with at least one holder
        self._reset: tuple[int, ev.PrefixCacheReset] | None = (
            None  # a reset whose preemptions follow
        )
        self.abort_freed: set[int] = set()  # blocks given back by an abort with a step in flight

    def before(self) -> dict[type, Hook]:
        return {
            ev.StepScheduled: self._scheduled,
            ev.RequestPreempted: self._preempted,
            ev.RequestFinished: self._released,
            ev.RequestAborted: self._released,
            ev.PrefixCacheReset: self._prefix_cache_reset,
        }

    def _scheduled(self, seq: int, e: ev.StepScheduled) -> None:
        self._settle_reset()
        requests, refs, holder, bs = self.state.requests, self.refs, self.holder, self.block_size
        for entry in e.entries:
            if not entry.new_block_ids:
                continue
            req = requests.get(entry.req_id)
            admitted = req is not None and req.status is not RequestStatus.RUNNING
            hits = entry.num_computed_before // bs if admitted else 0
            for i, b in enumerate(entry.new_block_ids):
                if not 0 <= b < self.num_blocks:
                    self.ctx.report(
                        "kv_block_freed_twice",
                        "error",
                        [entry.req_id],
                        e.step,
                        f"request {entry.req_id!r} was given KV block {b}, outside the "
                        f"pool of {self.num_blocks} blocks",
                        [(seq, e)],
                        None,
                        seq,
                    )
                    continue
                if i >= hits and refs[b] > 0:
                    other = holder[b]
                    bug = "vllm#33377" if b in self.abort_freed else None
                    self.ctx.report(
                        "kv_block_freed_twice",
                        "error",
                        sorted({entry.req_id, other or "?"}),
                        e.step,
                        f"KV block {b} was newly allocated to request {entry.req_id!r} "
                        f"in step {e.step} while request {other!r} still held it: "
                        "it was freed twice or handed out twice",
                        [(seq, e)],
                        bug,
                        seq,
                    )
                if refs[b] == 0:
                    self.used += 1
                refs[b] += 1
                holder[b] = entry.req_id

    def _release(self, seq: int, e: ev.Event, req_id: str) -> None:
        req = self.state.requests.get(req_id)
        if req is None:
            return
        refs = self.refs
        for b in req.block_ids:
            if not 0 <= b < self.num_blocks:
                continue  # reported when it was taken
            refs[b] -= 1
            if refs[b] == 0:
                self.used -= 1
            elif refs[b] < 0:
                refs[b] = 0
                self.ctx.report(
                    "kv_block_freed_twice",
                    "error",
                    [req_id],
                    e.step,
                    f"KV block {b} was given back by request {req_id!r} in step {e.step} "
                    "more often than it was taken",
                    [(seq, e)],
                    None,
                    seq,
                )

    def _released(self, seq: int, e: ev.RequestFinished | ev.RequestAborted) -> None:
        self._settle_reset()
        req = self.state.requests.get(e.req_id)
        if isinstance(e, ev.RequestAborted) and req is not None and req.num_in_flight:
            self.abort_freed.update(req.block_ids)  # its step in flight comes back after the free
        self._release(seq, e, e.req_id)

    def _preempted(self, seq: int, e: ev.RequestPreempted) -> None:
        if e.reason != "reset_prefix_cache":  # a reset's own preemptions come right after it
            self._settle_reset()
        if e.reason == "kv_pressure":
            # Before the failed allocation the step can only have taken blocks for its running
            # entries (each within the token budget, which a dropped entry gives back, plus
            # one partly filled block per request) and needs at most one budget's worth more.
            bound = 3 * self.budget_blocks + 2 * len(self.state.running) + 1
            free = self.num_blocks - self.used
            if free > bound:
                self.ctx.report(
                    "kv_block_leaked",
                    "error",
                    [e.req_id],
                    e.step,
                    f"request {e.req_id!r} was preempted for KV pressure in step {e.step} "
                    f"while the tape accounts for only {self.used} of {self.num_blocks} blocks "
                    f"in use ({free} free, no allocation of the step needs more than {bound}): "
                    "the engine's pool lost blocks",
                    [(seq, e)],
                    None,
                    seq,
                    per_request=False,
                )
        self._release(seq, e, e.req_id)

    def _prefix_cache_reset(self, seq: int, e: ev.PrefixCacheReset) -> None:
        self._settle_reset()
        if not e.ok:
            return
        self._reset = (seq, e)
        if not e.reset_running_requests:
            self._settle_reset()
        # Otherwise its preemptions follow: the blocks are counted once they are given back,
        # at the next event that changes them (the others leave the count as it is).

    def _settle_reset(self) -> None:
        """Check a successful reset once its own preemptions are done: no block may be in use."""
        if self._reset is None:
            return
        reset_seq, reset = self._reset
        self._reset = None
        if self.used:
            holders = sorted(
                {h for b, h in enumerate(self.holder) if self.refs[b] and h is not None}
            )
            self.ctx.report(
                "prefix_cache_reset_in_use",
                "error",
                holders[:8],
                reset.step,
                f"the prefix cache was reset in step {reset.step} "
                f"while {self.used} KV blocks were in use",
                [(reset_seq, reset)],
                None,
                reset_seq,
            )

    def finish(self) -> None:
        self._settle_reset()
