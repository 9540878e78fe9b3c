"""duplicated_token: the same position delivered twice.

Each frame entry records the sequence position its first token was sampled at
(`FrameEntry.position`, format 4; -1 where the recorder does not know, on older tapes and
vLLM's). A fresh frame that is applied must start at the request's next position, its
prompt plus the tokens it already has. One that starts before it was computed for a
position the client already has: its tokens repeat that position and every later token
comes late (tenstorrent/vllm #395: a step built from a stale input batch samples the
previous position again). A stale frame applied is `stale_frame_applied`'s to report, and so
is the fresh frame that then delivers its position a second time: not reported here.
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.events.state import RequestState
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context

_BUG = "tenstorrent-vllm#395"  # a fresh step that sampled a delivered position again


class _Delivered:
    """The positions a request's applied frames were sampled at: every position below
    `upto`, and `extra` above it; `stale` those a stale frame delivered."""

    __slots__ = ("upto", "extra", "stale")

    def __init__(self, first: int) -> None:
        self.upto, self.extra, self.stale = first, set[int](), set[int]()

    def has(self, p: int) -> bool:
        return p < self.upto or p in self.extra

    def add(self, p: int) -> None:
        if p != self.upto:
            self.extra.add(p)
            return
        self.upto += 1
        while self.upto in self.extra:
            self.extra.discard(self.upto)
            self.upto += 1


class PositionChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        # Per sampling entry of the frame being applied: (request, fresh, tokens it had), or
        # None for a step the reducer will refuse.
        self._before: list[tuple[RequestState, bool, int]] | None = None
        self._delivered: dict[str, _Delivered] = {}

    def before(self) -> dict[type, Hook]:
        return {ev.FrameProduced: self._frame_before}

    def after(self) -> dict[type, Hook]:
        return {
            ev.FrameProduced: self._frame_after,
            ev.RequestFinished: self._forget,
            ev.RequestAborted: self._forget,
        }

    def _forget(self, seq: int, e: ev.RequestFinished | ev.RequestAborted) -> None:
        self._delivered.pop(e.req_id, None)  # it takes no more tokens

    def _frame_before(self, seq: int, e: ev.FrameProduced) -> None:
        flight = self.state.in_flight_steps
        if not flight or flight[0].step != e.step:
            self._before = None
            return
        step = flight[0]
        self._before = [
            (req, entry.epoch == req.epoch, len(req.output_token_ids))
            for entry, req in zip(step.entries, step.requests)
            if entry.req_id not in step.partial
        ]

    def _frame_after(self, seq: int, e: ev.FrameProduced) -> None:
        if self._before is None:
            return
        for (req, fresh, n_out), frame in zip(self._before, e.entries):
            position, applied = frame.position, len(req.output_token_ids) - n_out
            if applied <= 0 or position < 0:
                continue  # not applied (dropped, or after a stop), or a position unknown
            seen = self._delivered.get(req.req_id)
            if seen is None:
                seen = self._delivered[req.req_id] = _Delivered(req.num_prompt_tokens)
            again = [p for p in range(position, position + applied) if seen.has(p)]
            for p in range(position, position + applied):
                seen.add(p)
                if not fresh:
                    seen.stale.add(p)
            # A position a stale frame delivered first is stale_frame_applied's finding.
            if fresh and again and not all(p in seen.stale for p in again):
                self._report(seq, e, req, again[0], n_out)

    def _report(self, seq: int, e: ev.FrameProduced, req: RequestState, p: int, n_out: int) -> None:
        index = p - req.num_prompt_tokens
        self.ctx.report(
            "duplicated_token",
            "error",
            [req.req_id],
            e.step,
            f"request {req.req_id!r} was given output position {index} twice: the fresh "
            f"frame of step {e.step} was sampled at position {p}, which an earlier frame had "
            f"delivered, and its token went to output position {n_out}; every later token "
            "comes late",
            [self.ctx.scheduled.get(e.step), (seq, e)],
            self.ctx.bug_class_of(req.req_id) or _BUG,
            seq,
        )
