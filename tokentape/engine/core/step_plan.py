"""The step the scheduler is planning: its entries, the runner's batch and the token budget
left (scheduler.py fills it; an injected fault, hooks.py, may add to it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokentape.engine.runners.base import ScheduledBatch
from tokentape.events import schema as ev


@dataclass(slots=True)
class StepPlan:
    """The step being planned: its entries, the runner's batch and the token budget left."""

    batch: ScheduledBatch
    budget: int
    entries: dict[str, ev.ScheduledEntry] = field(default_factory=dict)
    preempted: bool = False

    def add(self, entry: ev.ScheduledEntry, token_ids: list[int] | None, partial: bool) -> None:
        self.entries[entry.req_id] = entry
        self.budget -= entry.num_new_tokens
        if token_ids is not None:
            self.batch.token_ids[entry.req_id] = token_ids
        if partial:
            self.batch.partial_prefills.add(entry.req_id)

    def drop(self, req_id: str) -> list[int]:
        """Take a preempted request out of the step; returns the blocks it was given in it."""
        entry = self.entries.pop(req_id, None)
        if entry is None:
            return []
        self.budget += entry.num_new_tokens
        self.batch.token_ids.pop(req_id, None)
        self.batch.partial_prefills.discard(req_id)
        self.batch.new_requests.pop(req_id, None)
        return entry.new_block_ids
