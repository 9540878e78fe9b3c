"""Checkers of the paged KV cache, derived from the blocks each scheduled entry took.

Each block's holders are counted from the tape: an entry's `new_block_ids` take a reference
(prefix-cache hits first, then newly allocated blocks), a preemption or a finish gives every
block of the request back. Findings:
- `kv_block_freed_twice`: a newly allocated block was still held by another request (the
  allocator got it back twice), a block was given back more often than taken, or a block id
  lies outside the pool;
- `kv_block_leaked`: a KV-pressure preemption while so many blocks were free by the tape that
  no allocation of that step could have failed: the engine's pool lost blocks;
- `prefix_cache_reset_in_use`: a prefix-cache reset succeeded while requests held blocks;
- `block_reused_while_in_flight`: a request admitted took a block as already holding its
  prefix (a prefix-cache hit, or KV loaded into it) while a step still in flight writes other
  tokens into it, for the request that gave it back: that write lands on what the new owner
  reads (vLLM #45357/#47728). The runner runs steps in order, so a block written only by its
  new owner's own steps is safe however soon it was handed out; one it trusts is not.
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.events.state import RequestState, RequestStatus
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
        # Block -> (step, request, its block index, slots not written again since) of the
        # in-flight steps that write it: a later step's write of a slot lands after theirs.
        self.writes: dict[int, list[tuple[int, RequestState, int, set[int]]]] = {}
        self.step_writes: dict[int, list[int]] = {}  # in-flight step -> the blocks it writes

    def after(self) -> dict[type, Hook]:
        return {ev.FrameProduced: self._frame, ev.EngineSnapshot: self._restored}

    def _restored(self, seq: int, e: ev.EngineSnapshot) -> None:
        """A segment begins: the blocks its requests hold, and those its steps in flight
        write for the requests still running (their frames come back in this segment).
        Further on (segments read as one tape) the counts carried over are the truth."""
        if seq != 0:
            return
        requests, bs = self.state.requests, self.block_size
        for req in requests.values():
            for b in req.block_ids:
                if 0 <= b < self.num_blocks:
                    self.used += self.refs[b] == 0
                    self.refs[b] += 1
                    self.holder[b] = req.req_id
        for step in self.state.in_flight_steps:
            for entry, req in zip(step.entries, step.requests, strict=True):
                if req.status is not RequestStatus.RUNNING or entry.epoch != req.epoch:
                    continue
                start, end = (
                    entry.num_computed_before,
                    entry.num_computed_before + entry.num_new_tokens,
                )
                for i in range(start // bs, min((end - 1) // bs + 1, len(req.block_ids))):
                    b = req.block_ids[i]
                    slots = set(range(max(start, i * bs) - i * bs, min(end, (i + 1) * bs) - i * bs))
                    self.writes.setdefault(b, []).append((step.step, req, i, slots))
                    self.step_writes.setdefault(step.step, []).append(b)

    def _frame(self, seq: int, e: ev.FrameProduced) -> None:
        """The step came back: its writes are done."""
        for b in self.step_writes.pop(e.step, ()):
            left = [w for w in self.writes.get(b, ()) if w[0] != e.step]
            if left:
                self.writes[b] = left
            else:
                self.writes.pop(b, None)

    def _track_writes(self, seq: int, e: ev.StepScheduled) -> None:
        """Check the blocks each admitted request trusts against the writes in flight, then
        note the blocks this step writes (before the reducer applies it)."""
        requests, bs, writes = self.state.requests, self.block_size, self.writes
        mine: list[int] = []
        for entry in e.entries:
            req = requests.get(entry.req_id)
            if req is None or req.finish_reason is not None:
                continue  # the reducer refuses it
            running = req.status is RequestStatus.RUNNING
            if not running and writes:
                trusted = entry.new_block_ids[: entry.num_computed_before // bs]
                for j, b in enumerate(trusted):
                    for step, writer, i, slots in writes.get(b, ()):
                        if not self._same_content(writer, i, req, j):
                            self._reused_in_flight(seq, e, req, b, j, (step, writer, i, slots))
            blocks = (req.block_ids if running else []) + entry.new_block_ids
            start = entry.num_computed_before
            end = start + entry.num_new_tokens
            for i in range(start // bs, min((end - 1) // bs + 1, len(blocks))):
                b = blocks[i]
                slots = set(range(max(start, i * bs) - i * bs, min(end, (i + 1) * bs) - i * bs))
                earlier = writes.get(b, [])
                for w in earlier:  # this write lands after theirs: the slots it covers are safe
                    w[3].difference_update(slots)
                writes[b] = [*(w for w in earlier if w[3]), (e.step, req, i, slots)]
                mine.append(b)
        if mine:
            self.step_writes[e.step] = mine

    def _same_content(self, writer: RequestState, i: int, reader: RequestState, j: int) -> bool:
        """Whether the writer's block i holds what the reader's block j stands for: the same
        place in the same prefix (the request's own recompute, or a prefix shared by hash)."""
        end = (i + 1) * self.block_size
        return (
            i == j
            and writer.num_tokens >= end
            and reader.num_tokens >= end
            and writer.token_ids_between(0, end) == reader.token_ids_between(0, end)
        )

    def _reused_in_flight(
        self,
        seq: int,
        e: ev.StepScheduled,
        req: RequestState,
        b: int,
        j: int,
        write: tuple[int, RequestState, int, set[int]],
    ) -> None:
        step, writer, i, slots = write
        bs = self.block_size
        written = ", ".join(str(i * bs + s) for s in sorted(slots))
        self.ctx.report(
            "block_reused_while_in_flight",
            "error",
            sorted({req.req_id, writer.req_id}),
            e.step,
            f"request {req.req_id!r} was admitted in step {e.step} trusting KV block {b} to "
            f"hold its positions {j * bs}-{(j + 1) * bs - 1}, while step {step}, still in "
            f"flight, writes request {writer.req_id!r}'s position(s) {written} into it (it "
            "gave the block back with that step in flight): the stale write "
            "lands on the KV the new owner reads",
            [self.ctx.scheduled.get(step), (seq, e)],
            "vllm#45357",
            seq,
        )

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
        self._track_writes(seq, e)
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
