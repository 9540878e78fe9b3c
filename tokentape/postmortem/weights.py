"""The checker of KV reused across weight updates: `stale_prefix_hit_after_weight_update`.

A prefix-cache hit reuses KV blocks computed earlier. Once the weights change, every block
computed before holds the old weights' keys and values, so an engine must reset its prefix
cache across an update (vLLM: `pause_generation(clear_cache=True)`, or `reset_prefix_cache`)
or new requests continue from stale KV: NeMo-RL #4018 (the same class as lmdeploy #4917 and
SGLang #26792), where new requests reused KV computed by weights up to 17 steps old.

Which weights computed each block comes from the tape (replay/stale_kv.py, which `tokentape
why` reads too). A hit on a block of older weights is the finding: an error when an update in
between came in a pause that asked for `clear_cache=True` (the cache should have been reset:
the bug class), a warning when every such update followed a pause with `clear_cache=False`
(the run kept the cache on purpose, and the warning says so).
"""

from __future__ import annotations

from tokentape.events import schema as ev
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context
from tokentape.replay.stale_kv import StaleKVTracker

KIND = "stale_prefix_hit_after_weight_update"
BUG_CLASS = "nemo-rl#4018"


class WeightsChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        config = ctx.tape.config
        self.tracker = StaleKVTracker(config.block_size, config.num_kv_blocks or 0)

    def before(self) -> dict[type, Hook]:
        return {ev.StepScheduled: self._scheduled}

    def after(self) -> dict[type, Hook]:
        return {ev.GenerationPaused: self._noted, ev.WeightsUpdated: self._noted}

    def _noted(self, seq: int, e: ev.Event) -> None:
        self.tracker.after(seq, e, self.state)

    def _scheduled(self, seq: int, e: ev.StepScheduled) -> None:
        for hit in self.tracker.before(seq, e, self.state):
            u = hit.cause
            self.ctx.report(
                KIND,
                "error" if hit.asked else "warning",
                [hit.req_id],
                hit.event.step,
                f"{hit.describe()}: its tokens attend to the old weights' keys and values; "
                f"{hit.reason()}",
                [u.pause, (u.seq, u.event), (hit.seq, hit.event)],
                BUG_CLASS if hit.asked else None,
                hit.seq,
            )
