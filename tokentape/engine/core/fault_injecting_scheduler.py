"""The scheduler of an engine built with faults (EngineConfig.faults: upstream bugs on purpose,
for the museum's tapes and the tests): `Scheduler` with its fault hooks (hooks.py) called
where they act. The factory builds it only then, so an ordinary engine's scheduler calls no
hook. Compiled beside the scheduler it extends (events/_compiled.py)."""

from __future__ import annotations

from collections.abc import Sequence

from tokentape.engine.core.scheduler import Scheduler
from tokentape.engine.core.step_plan import StepPlan
from tokentape.engine.hooks import EngineHooks
from tokentape.events import schema as ev
from tokentape.events.state import RequestState


class FaultInjectingScheduler(Scheduler):
    """`hooks`: the engine's fault hooks, set once the engine has built them."""

    hooks: Sequence[EngineHooks] = ()

    def preempt(
        self, req: RequestState, reason: ev.PreemptReason, extra_blocks: Sequence[int] = ()
    ) -> None:
        for hook in self.hooks:
            hook.before_preempt(req)
        super().preempt(req, reason, extra_blocks)

    def finish(
        self,
        req: RequestState,
        reason: ev.FinishReason,
        stop_reason: str | int | None = None,
        num_output_tokens: int | None = None,
    ) -> None:
        for hook in self.hooks:
            hook.before_finish(req, reason)
        super().finish(req, reason, stop_reason, num_output_tokens)

    def _schedule_running(self, plan: StepPlan) -> None:
        super()._schedule_running(plan)
        for hook in self.hooks:
            hook.after_running_scheduled(plan)

    def _admit_waiting(self, plan: StepPlan) -> None:
        waiting = list(self.state.waiting)
        num_running = len(self.state.running)
        skips = False
        for hook in self.hooks:
            waiting = hook.admission_candidates(waiting)
            num_running += hook.seats_held()
            skips = skips or hook.skips_short_requests()
        skipped: list[str] | None = [] if skips else None
        self._admit(plan, waiting, num_running, skipped)
        for hook in self.hooks:
            hook.after_waiting_admitted(plan, skipped or [])
