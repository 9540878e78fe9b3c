"""request_stuck: an unfinished request that made no progress for many steps that had room
for it (token budget, a sequence slot and enough free KV blocks), while generation ran."""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.events.state import RequestStatus
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context

STUCK_AFTER_STEPS = 200  # steps with room for the request but no progress
_SCAN_EVERY = 16  # steps between scans of the unfinished requests


class StuckChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        config = self.ctx.tape.config
        self.budget = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        self.num_blocks = config.num_kv_blocks
        self.block_size = config.block_size
        self.idle: dict[str, int] = {}  # request -> steps with room but without progress
        self.since: dict[str, int] = {}  # request -> the step its idle stretch started
        self.reported: set[str] = set()
        self._room_steps = 0  # of the last scan period: steps with spare tokens and slots
        self._tokens_used = 0

    def after(self) -> dict[type, Hook]:
        return {ev.StepScheduled: self._scheduled}

    def _scheduled(self, seq: int, e: ev.StepScheduled) -> None:
        idle = self.idle
        tokens = 0
        for entry in e.entries:
            tokens += entry.num_new_tokens
            if entry.req_id in idle:
                del idle[entry.req_id]
        if tokens < self.budget and len(e.entries) < self.max_seqs and self.state.paused is None:
            self._room_steps += 1
        if e.step % _SCAN_EVERY == _SCAN_EVERY - 1:
            self._scan(seq, e)

    def _scan(self, seq: int, e: ev.StepScheduled) -> None:
        room, self._room_steps = self._room_steps, 0
        if not room:
            return
        state, bs = self.state, self.block_size
        used = sum(len(state.requests[r].block_ids) for r in state.running)  # shared blocks overcount
        free = self.num_blocks - used
        idle, since, requests = self.idle, self.since, state.requests
        for req_id in (*state.waiting, *state.running):
            req = requests[req_id]
            if req.status is not RequestStatus.RUNNING and -(-req.num_tokens // bs) > free:
                continue  # no KV room for it: waiting is right
            if req.status is RequestStatus.RUNNING and req.num_in_flight:
                continue  # its output is on the way
            if req_id not in idle:
                idle[req_id] = 0
                since[req_id] = e.step
            idle[req_id] += room
            if idle[req_id] >= STUCK_AFTER_STEPS and req_id not in self.reported:
                self.reported.add(req_id)
                self.ctx.report(
                    "request_stuck", "warning", [req_id], since[req_id],
                    f"request {req_id!r} ({req.status.value}) made no progress for {idle[req_id]} steps "
                    f"(steps {since[req_id]}-{e.step}) that had token budget, a sequence slot and free "
                    "KV blocks for it",
                    [(seq, e)], None, seq, last_step=e.step)
