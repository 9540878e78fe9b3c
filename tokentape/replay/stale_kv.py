"""Which weights computed each KV block, from a tape: the prefix-cache hits on blocks of older
weights (NeMo-RL #4018's class). The postmortem's `stale_prefix_hit_after_weight_update`
(postmortem/weights.py) and `tokentape why` (why_weights.py) read the same tracker.

A block newly allocated to a scheduled entry is computed under the weights in force then (the
reducer's update count; a block filled across an update counts as the older weights', which
it partly holds). An admitted entry's first `num_computed_before // block_size` blocks are its
prefix-cache hits, as `postmortem/kv.py` counts them. A hit on a block of an older update
count reused the old weights' keys and values. Each update remembers the pause it was made in:
whether that pause asked for `clear_cache=True` (then the cache should have been reset) or kept
the cache on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokentape.events import schema as ev
from tokentape.events.reducer import evolve
from tokentape.events.state import EngineState, RequestStatus
from tokentape.replay.tape import Tape


@dataclass(frozen=True, slots=True)
class WeightsChange:
    seq: int
    event: ev.WeightsUpdated
    version: str  # as the reducer resolved it
    pause: tuple[int, ev.GenerationPaused] | None  # the pause it was made in
    kept_cache: bool  # that pause said clear_cache=False


@dataclass(frozen=True, slots=True)
class StaleHit:
    """An admitted entry that reused prefix-cache blocks computed under older weights."""

    seq: int
    event: ev.StepScheduled
    req_id: str
    epoch: int
    blocks: list[int]
    computed_step: int  # the earliest step that computed one of them
    old_version: str  # the oldest weights among them
    version: str  # the weights in force at the hit
    updates: list[WeightsChange]  # the updates since the oldest block was computed

    @property
    def asked(self) -> list[WeightsChange]:
        """The updates made in a pause that asked for clear_cache=True."""
        return [u for u in self.updates if not u.kept_cache]

    @property
    def cause(self) -> WeightsChange:
        """The update to blame: the first whose pause asked for a clear, else the first."""
        return (self.asked or self.updates)[0]

    def describe(self) -> str:
        blocks = ", ".join(map(str, self.blocks[:6])) + (", ..." if len(self.blocks) > 6 else "")
        return (
            f"request {self.req_id!r} was admitted in step {self.event.step} reusing "
            f"{len(self.blocks)} prefix-cache block(s) ({blocks}) computed in step "
            f"{self.computed_step} under weights version {self.old_version!r}, "
            f"{len(self.updates)} weight update(s) before the weights in force "
            f"({self.version!r})"
        )

    def reason(self) -> str:
        """Why it happened, from the pause the update was made in."""
        u = self.cause
        where = f"the update to {u.version!r} (step {u.event.step})"
        if self.asked:
            return (
                f"the pause before {where} asked for clear_cache=True, yet the prefix cache "
                "was not reset across it (the prefix cache kept across weight updates: "
                "NeMo-RL #4018)"
            )
        return (
            f"the run paused with clear_cache=False before {where}, keeping the cache on "
            "purpose (pause with clear_cache=True, or reset_prefix_cache, to recompute the "
            "prefix under the new weights)"
        )


class StaleKVTracker:
    """Fed every event in tape order, with the state before it (`before`) and after it
    (`after`); `hits` gathers the stale prefix-cache hits."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.generation = [0] * num_blocks  # per block: the update count that computed it
        self.computed_in = [-1] * num_blocks  # and the step that allocated it
        self.updates: list[WeightsChange] = []  # updates[g - 1] made update count g
        self.pause: tuple[int, ev.GenerationPaused] | None = None
        self.hits: list[StaleHit] = []
        self.num_hits = 0  # admissions that reused prefix-cache blocks, stale or not

    def version_at(self, generation: int) -> str:
        return self.updates[generation - 1].version if generation else "default"

    def before(self, seq: int, event: ev.Event, state: EngineState) -> list[StaleHit]:
        """The stale hits of a StepScheduled (read before the reducer applies it)."""
        if type(event) is not ev.StepScheduled:
            return []
        now, bs, n = state.num_weight_updates, self.block_size, self.num_blocks
        generation, computed_in, found = self.generation, self.computed_in, []
        for entry in event.entries:
            if not entry.new_block_ids:
                continue
            req = state.requests.get(entry.req_id)
            admitted = req is not None and req.status is not RequestStatus.RUNNING
            hits = entry.num_computed_before // bs if admitted else 0
            self.num_hits += hits > 0
            stale: list[int] = []
            for i, b in enumerate(entry.new_block_ids):
                if not 0 <= b < n:
                    continue  # postmortem/kv.py reports a block outside the pool
                if i >= hits:
                    generation[b], computed_in[b] = now, event.step
                elif generation[b] != now:
                    stale.append(b)
            if stale:
                oldest = min(generation[b] for b in stale)
                found.append(
                    StaleHit(
                        seq,
                        event,
                        entry.req_id,
                        entry.epoch,
                        stale,
                        min(computed_in[b] for b in stale),
                        self.version_at(oldest),
                        self.version_at(now),
                        self.updates[oldest:],
                    )
                )
        self.hits += found
        return found

    def after(self, seq: int, event: ev.Event, state: EngineState) -> None:
        """Note the pauses and the updates (read after the reducer applies them)."""
        if type(event) is ev.GenerationPaused:
            self.pause = (seq, event)
        elif type(event) is ev.WeightsUpdated:
            kept = self.pause is not None and not self.pause[1].clear_cache
            self.updates.append(WeightsChange(seq, event, state.weight_version, self.pause, kept))


def track(tape: Tape, events: Iterable[tuple[int, ev.Event]] | None = None) -> StaleKVTracker:
    """Fold the tape (or its first `events`) through the tracker."""
    config = tape.config
    tracker = StaleKVTracker(config.block_size, config.num_kv_blocks or 0)
    state = tape.initial_state()
    for seq, event in tape.events() if events is None else events:
        tracker.before(seq, event, state)
        evolve(state, event)
        tracker.after(seq, event, state)
    return tracker
