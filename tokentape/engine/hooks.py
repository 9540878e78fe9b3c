"""The places where an engine lets an injected upstream bug act (tokentape.events.faults names
them; engine/fault_hooks.py implements them): explicit hooks, instead of methods patched from
outside, that only an engine built with faults calls (FaultInjectingEngineCore and its
FaultInjectingScheduler); an ordinary engine has no hook to call. A hook may plan (add to a
step, free blocks as the upstream code did) but request state still changes only through the
reducer."""

from __future__ import annotations

from tokentape.engine.core.step_plan import StepPlan
from tokentape.engine.runners.base import ScheduledBatch
from tokentape.events.state import RequestState


class EngineHooks:
    """Every hook does nothing; a fault overrides the ones it needs."""

    def after_add(self, req_ids: list[str]) -> None:
        """Requests were added (recorded): a request, or the children of one of n > 1."""

    def before_preempt(self, req: RequestState) -> None:
        """A request is about to be preempted (its preemption not recorded yet)."""

    def before_finish(self, req: RequestState, reason: str) -> None:
        """A request is about to finish or be aborted (not recorded yet)."""

    def after_running_scheduled(self, plan: StepPlan) -> None:
        """The running requests are planned into the step; the waiting ones come next."""

    def admission_candidates(self, waiting: list[str]) -> list[str]:
        """The waiting requests admission looks at, front first (a fault may pass over some)."""
        return waiting

    def seats_held(self) -> int:
        """Sequence slots (max_num_seqs) held by requests outside `running`."""
        return 0

    def skips_short_requests(self) -> bool:
        """Whether a waiting request whose KV blocks fall short is skipped (vLLM's
        skipped_waiting) rather than stopping admission."""
        return False

    def after_waiting_admitted(self, plan: StepPlan, skipped: list[str]) -> None:
        """Waiting requests were admitted into the step (not recorded yet); `skipped`: those
        passed over for want of KV blocks (see skips_short_requests)."""

    def before_pause(self) -> None:
        """pause_generation was called (nothing drained or recorded yet)."""

    def before_submit(self, batch: ScheduledBatch) -> None:
        """The step is recorded and about to go to the runner (what the runner is handed may
        be replaced; the recorded entries may not)."""

    def before_frame(self, step: int) -> None:
        """The oldest step's frame is about to be collected from the runner."""

    def after_frame(self, req_ids: list[str]) -> None:
        """The oldest step's frame was applied; `req_ids`: the requests of that step."""

    def drains_on_pause(self) -> bool:
        """Whether a pause waits for the steps in flight before it returns (a fault may not:
        a sleep after it then releases memory under them)."""
        return True

    def clears_cache_on_pause(self) -> bool:
        """Whether a pause with clear_cache resets the cache once drained (a fault may not)."""
        return True
