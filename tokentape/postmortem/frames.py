"""Checkers of what happened to each frame and to the counts that decide it.

- History: the scheduling event of every in-flight step, each request's latest preemption
  and the latest resume, shared through the context (the other checkers' excerpts use them).
- Frame fate (token conservation): every frame token is applied, dropped as stale, dropped
  as fresh (a finding), or arrives after the request stopped (in a frame of a finished
  request, or after the stop in the frame that reached it, cut by the finish); a stale
  frame applied, a fresh frame dropped and the first token after a resume dropped (vLLM
  #42043) are findings. Under
  `deliver` (vLLM since #48245) stale output is delivered by design: applying it is a
  finding only once the request was scheduled again before it drained.
- Counts: output placeholders, the discard count and the in-flight counts must never go
  negative; a running request with nothing in flight must have no placeholders left, at any
  step (vLLM's scheduler would count tokens that never come); and placeholders and the
  discard count must be zero once a request that finished (not aborted: an aborted request is
  freed, and its counts count nothing) has nothing in flight.
"""

from __future__ import annotations

from tokentape.engine.config import MAX_PIPELINE_DEPTH
from tokentape.events import schema as ev
from tokentape.events.discard import discard_count, get_policy
from tokentape.events.state import InFlightStep, RequestState
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context, Preemption, cite

_KEEP_STEPS = MAX_PIPELINE_DEPTH + 4


class HistoryChecker(Checker):
    """Keeps the history the other checkers cite; reports nothing itself."""

    def before(self) -> dict[type, Hook]:
        return {ev.RequestPreempted: self._preempted}

    def after(self) -> dict[type, Hook]:
        return {ev.StepScheduled: self._scheduled, ev.GenerationResumed: self._resumed}

    def _scheduled(self, seq: int, e: ev.StepScheduled) -> None:
        scheduled = self.ctx.scheduled
        scheduled[e.step] = (seq, e)
        flight = self.state.in_flight_steps
        if flight and flight[-1].partial:
            self.ctx.chunked.update(flight[-1].partial)
        # A step's frame comes back before the pipeline schedules MAX_PIPELINE_DEPTH more.
        scheduled.pop(e.step - _KEEP_STEPS, None)

    def _preempted(self, seq: int, e: ev.RequestPreempted) -> None:
        req = self.state.requests.get(e.req_id)
        if req is None:
            return  # the reducer refuses it
        spec = any(entry.num_spec_tokens for _, entry in self.state.in_flight_entries(e.req_id))
        self.ctx.preemptions[e.req_id] = Preemption(seq, e, req.async_tokens_to_discard, spec)

    def _resumed(self, seq: int, e: ev.GenerationResumed) -> None:
        self.ctx.last_resume = (seq, e)
        for p in self.ctx.preemptions.values():
            p.resumed = True


class FrameChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        # Per sampling entry of the frame being applied: (request, stale, outputs, dropped,
        # stopped, scheduled again: an entry of a later epoch is in flight behind it).
        self._before: list[tuple[RequestState, bool, int, int, bool, bool]] = []
        self._step: InFlightStep | None = None
        # Per sampling entry: the request its id names now, when that is another (an id added
        # again while the step was in flight), and the tokens it had.
        self._renamed: list[tuple[RequestState, int] | None] = []
        self._readded: dict[str, tuple[int, ev.Event]] = {}  # the latest re-add of an id
        self._num_output = 0  # the output length of the request finishing, before its cut
        # `deliver` (vLLM since #48245) delivers stale output by design; it is wrong only
        # once the request was scheduled again before it drained (its position recomputed).
        self._delivers_stale = get_policy(ctx.state.discard_policy).delivers_stale

    def before(self) -> dict[type, Hook]:
        return {
            ev.FrameProduced: self._frame_before,
            ev.RequestAdded: self._added,
            ev.RequestFinished: self._finish_before,
        }

    def after(self) -> dict[type, Hook]:
        return {ev.FrameProduced: self._frame_after, ev.RequestFinished: self._finish_after}

    def _finish_before(self, seq: int, e: ev.RequestFinished) -> None:
        req = self.state.requests.get(e.req_id)
        self._num_output = len(req.output_token_ids) if req is not None else 0

    def _finish_after(self, seq: int, e: ev.RequestFinished) -> None:
        """Tokens of the last frame after the stop were applied with it and are cut here."""
        req = self.state.requests.get(e.req_id)
        cut = self._num_output - len(req.output_token_ids) if req is not None else 0
        if cut > 0:
            self.ctx.tokens["applied"] -= cut
            self.ctx.tokens["after_stop"] += cut

    def _added(self, seq: int, e: ev.RequestAdded) -> None:
        if e.req_id in self.state.requests:  # an id added again (the reducer decides if it may)
            self._readded[e.req_id] = (seq, e)

    def _frame_before(self, seq: int, e: ev.FrameProduced) -> None:
        flight = self.state.in_flight_steps
        self._step = flight[0] if flight and flight[0].step == e.step else None
        if self._step is None:
            return  # the reducer refuses this frame; the driver reports it
        partial = self._step.partial
        self._before = [
            (
                req,
                entry.epoch != req.epoch,
                len(req.output_token_ids),
                req.num_frames_dropped,
                req.finish_reason is not None,
                entry.epoch != req.epoch and self._scheduled_again(entry),
            )
            for entry, req in zip(self._step.entries, self._step.requests)
            if entry.req_id not in partial
        ]
        requests = self.state.requests
        self._renamed = [
            None if (now := requests[entry.req_id]) is req else (now, len(now.output_token_ids))
            for entry, req in zip(self._step.entries, self._step.requests)
            if entry.req_id not in partial
        ]

    def _scheduled_again(self, entry: ev.ScheduledEntry) -> bool:
        """Whether a later epoch of the stale entry's request is in flight behind it."""
        if not self._delivers_stale:
            return True  # any stale frame applied is a failure of the policy
        return any(e.epoch > entry.epoch for _, e in self.state.in_flight_entries(entry.req_id))

    def _frame_after(self, seq: int, e: ev.FrameProduced) -> None:
        if self._step is None:
            return
        ctx, tokens = self.ctx, self.ctx.tokens
        scheduled = ctx.scheduled.get(e.step)
        for renamed in self._renamed:
            if renamed is not None and len(renamed[0].output_token_ids) > renamed[1]:
                self._landed_on_reused_id(seq, e, renamed[0], scheduled)
        for (req, stale, n_out, n_dropped, stopped, again), frame in zip(self._before, e.entries):
            produced = len(frame.token_ids)
            tokens["produced"] += produced
            if stopped:
                tokens["after_stop"] += produced
                continue
            preemption = ctx.preemptions.get(req.req_id)
            if req.num_frames_dropped > n_dropped:
                if stale:
                    tokens["dropped_stale"] += produced
                else:
                    tokens["dropped_fresh"] += produced
                    self._fresh_dropped(seq, e, req, scheduled, preemption)
                    if preemption is not None:
                        preemption.fresh_frames += 1
                continue
            applied = len(req.output_token_ids) - n_out
            tokens["applied"] += applied
            if applied < produced:
                tokens["lost"] += produced - applied
                ctx.report(
                    "token_lost",
                    "error",
                    [req.req_id],
                    e.step,
                    f"{produced - applied} of {produced} tokens of request {req.req_id!r}'s "
                    f"frame for step {e.step} were neither applied nor dropped",
                    [scheduled, (seq, e)],
                    seq=seq,
                )
            if stale and again:
                self._stale_applied(seq, e, req, scheduled, preemption)
            elif not stale and preemption is not None:
                preemption.fresh_frames += 1

    def _fresh_dropped(
        self,
        seq: int,
        e: ev.FrameProduced,
        req: RequestState,
        scheduled: tuple[int, ev.Event] | None,
        p: Preemption | None,
    ) -> None:
        policy = get_policy(self.state.discard_policy)
        why = policy.mechanism or f"policy {policy.name!r}"
        excerpt = [cite(p), self.ctx.last_resume if p and p.resumed else None, scheduled, (seq, e)]
        bug = policy.fresh_drop_bug(p is not None and p.spec_in_flight, p.counter_left if p else 0)
        if p is not None and p.resumed and p.fresh_frames == 0:
            self.ctx.report(
                "post_resume_token_dropped",
                "error",
                [req.req_id],
                e.step,
                f"the first token after resume of request {req.req_id!r} (step {e.step}) "
                f"was dropped by {why}, set by its {p.event.reason} preemption in step "
                f"{p.event.step} with "
                f"{p.event.in_flight} steps in flight; every later token moves up by one",
                excerpt,
                bug,
                seq,
            )
            return
        self.ctx.report(
            "fresh_frame_dropped",
            "error",
            [req.req_id],
            e.step,
            f"a fresh frame of request {req.req_id!r} (step {e.step}, epoch {req.epoch}) "
            f"was dropped by {why}; its tokens are lost and later tokens move up",
            excerpt,
            bug,
            seq,
        )

    def _landed_on_reused_id(
        self,
        seq: int,
        e: ev.FrameProduced,
        req: RequestState,
        scheduled: tuple[int, ev.Event] | None,
    ) -> None:
        """The step was scheduled for an earlier request of this id (finished since, the id
        added again), and its output was applied to the new one (vLLM #42492)."""
        self.ctx.reused.add(req.req_id)
        self.ctx.report(
            "stale_frame_applied",
            "error",
            [req.req_id],
            e.step,
            f"the frame of step {e.step}, scheduled for an earlier request {req.req_id!r} that "
            "finished while it was in flight, was applied to the request added again under "
            "that id: the old request's tokens land on the new one",
            [scheduled, self._readded.get(req.req_id), (seq, e)],
            "vllm#42492",
            seq,
        )

    def _stale_applied(
        self,
        seq: int,
        e: ev.FrameProduced,
        req: RequestState,
        scheduled: tuple[int, ev.Event] | None,
        p: Preemption | None,
    ) -> None:
        bug = stale_bug_class(p, self.ctx.tape.header.discard_policy)
        extra = ""
        if p is not None and bug == "vllm#42117-overwrite":
            extra = (
                f"; its preemption in step {p.event.step} overwrote a discard counter of "
                f"{p.counter_left} that had not drained"
            )
        elif self._delivers_stale:
            extra = "; the request had been scheduled again before its stale output drained"
        self.ctx.report(
            "stale_frame_applied",
            "error",
            [req.req_id],
            e.step,
            f"a stale frame of request {req.req_id!r} "
            f"(scheduled in step {e.step} before a preemption) "
            f"was applied: its token is delivered and computed again{extra}",
            [scheduled, cite(p), (seq, e)],
            bug,
            seq,
        )


def stale_bug_class(p: Preemption | None, policy: str) -> str | None:
    """The upstream bug that a stale frame getting through after preemption `p` matches."""
    if p is None:
        return None
    return get_policy(policy).stale_bug(p.event.reason, p.counter_left)


_COUNTS = (
    "num_output_placeholders",
    "async_tokens_to_discard",
    "num_stale_in_flight",
    "num_fresh_in_flight",
    "num_partial_in_flight",
)


class CountChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._done: set[str] = set()  # finished requests already checked for leftover counts
        self._left_over: set[str] = set()  # running requests already reported with leftovers

    def after(self) -> dict[type, Hook]:
        return {
            ev.FrameProduced: self._frame,
            ev.RequestPreempted: self._one,
            ev.RequestFinished: self._one,
            ev.RequestAborted: self._one,
        }

    def _frame(self, seq: int, e: ev.FrameProduced) -> None:
        requests = self.state.requests
        for entry in e.entries:
            req = requests.get(entry.req_id)
            if req is not None:
                self._check(seq, e, req)

    def _one(
        self, seq: int, e: ev.RequestPreempted | ev.RequestFinished | ev.RequestAborted
    ) -> None:
        req = self.state.requests.get(e.req_id)
        if req is not None:
            self._check(seq, e, req)

    def _check(self, seq: int, e: ev.Event, req: RequestState) -> None:
        if (
            req.num_output_placeholders < 0
            or req.async_tokens_to_discard < 0
            or req.num_stale_in_flight < 0
            or req.num_fresh_in_flight < 0
            or req.num_partial_in_flight < 0
        ):
            for name in _COUNTS:
                value = getattr(req, name)
                if value < 0:
                    self._negative(seq, e, req, name, value)
        if (
            req.finish_reason is None
            and not req.num_in_flight
            and req.num_output_placeholders > 0
            and req.req_id not in self._left_over
        ):
            self._left_over.add(req.req_id)
            n = req.num_output_placeholders
            self.ctx.report(
                "placeholders_left_over",
                "warning",
                [req.req_id],
                e.step,
                f"request {req.req_id!r} has nothing in flight after step {e.step} but {n} output "
                f"placeholder(s): the scheduler counts {n} token(s) that will not come, so it "
                "stops scheduling the request that much short of its limit, or never again",
                [cite(self.ctx.preemptions.get(req.req_id)), (seq, e)],
                self.ctx.bug_class_of(req.req_id),
                seq,
            )
        if req.finish_reason is not None and not req.num_in_flight and req.req_id not in self._done:
            self._done.add(req.req_id)
            if req.finish_reason == "abort":
                return  # freed: its counts count nothing any more (a frame may land after it)
            left = {
                "num_output_placeholders": req.num_output_placeholders,
                "discard count": discard_count(self.state, req),
            }
            nonzero = {k: v for k, v in left.items() if v}
            if nonzero:
                shown = ", ".join(f"{k} = {v}" for k, v in nonzero.items())
                p = self.ctx.preemptions.get(req.req_id)
                self.ctx.report(
                    "count_nonzero_at_finish",
                    "warning",
                    [req.req_id],
                    e.step,
                    f"request {req.req_id!r} finished ({req.finish_reason}) with nothing in flight "
                    f"but {shown}",
                    [cite(p), (seq, e)],
                    self.ctx.bug_class_of(req.req_id),
                    seq,
                )

    def _negative(self, seq: int, e: ev.Event, req: RequestState, name: str, value: int) -> None:
        p = self.ctx.preemptions.get(req.req_id)
        bug = None
        if name == "num_output_placeholders" and p is not None:
            bug = get_policy(self.ctx.tape.header.discard_policy).negative_placeholders_bug(
                p.event.reason, p.spec_in_flight, p.counter_left
            )
        elif name == "num_output_placeholders" and req.req_id in self.ctx.chunked:
            bug = "vllm#57562"  # no preemption: a prefill chunk's placeholder went missing
        if bug is None and req.req_id in self.ctx.reused:
            bug = "vllm#42492"  # an earlier request's output took its counts down
        self.ctx.report(
            "negative_count",
            "error",
            [req.req_id],
            e.step,
            f"{name} of request {req.req_id!r} went negative ({value}) at step {e.step}",
            [cite(p), (seq, e)],
            bug,
            seq,
            key=name,
        )
