"""Discard policies: which returning frames the reducer throws away after a preemption.

A preempted request may still have steps in flight; their frames are stale: applied after
the request was scheduled again, they would repeat a token the recompute produces. The
policies differ in how they recognise a stale frame and what they do with it. They are part
of the reducer: they change request state only when the reducer calls them.

- `epoch` (default, exact): every preemption bumps the request's epoch, every scheduled
  entry carries the epoch it was scheduled in, and a frame from an older epoch is stale.
- `counter`: vLLM after PR #42117. At preemption `async_tokens_to_discard` is *set* to the
  output placeholders (so a second preemption overwrites what is left), and each frame
  that comes back removes one, whatever its size (so with k speculative tokens one stale
  frame adds 1 + k but removes 1, and fresh frames are dropped after it).
- `flag`: vLLM before PR #42117. Preemption sets `discard_latest_async_tokens`, and the
  next frame is dropped even when nothing stale was in flight (issue #42043).
- `deliver`: vLLM since PR #48245 (the answer to #47900), its current semantics. Preemption
  zeroes the placeholders and marks what is in flight stale (`num_stale_output_tokens`);
  stale output is delivered but not counted, and the request is not scheduled again until
  it has drained, so nothing is computed twice. A reset's preemption (`drop_stale_output`)
  drops it instead, so the request may be scheduled again at once.

The museum policies (`MUSEUM_POLICIES`) reproduce later bugs of the family, for tapes and
tests only: selectable by name, never a default, not offered by the CLI.

- `flag-reset-only`: vLLM #38624. The flag is set by a reset's preemptions only, so a
  KV-pressure preemption leaves its in-flight output to be applied: a token twice.
- `counter-reset-only`: vLLM between #42117 and #48245 (#47900). The counter is set by a
  reset's preemptions only; a KV-pressure preemption zeroes the placeholders and the stale
  output that comes back is applied and counted, so they go below zero (vLLM asserted).
- `counter-spec-budget`: vLLM #41190 (fixed by #49620). The discard budget is counted in
  tokens, 1 + k per frame in flight, and a stale frame takes back the tokens it returned
  (1 + accepted drafts): after rejected drafts the budget outlives the stale frames and
  drops fresh ones. (The issue gives the budget's unit; how it drained is modelled.)
"""

from __future__ import annotations

from typing import Protocol

from tokentape.events.state import RequestState


class DiscardPolicy(Protocol):
    name: str
    may_drop_fresh: bool  # False when only stale frames are ever dropped
    # True: a stale frame the policy keeps is delivered by design, and leaves the placeholders
    # alone (zeroed at preemption). False: a stale frame that gets through is a failure of the
    # policy, and counted as vLLM counted it before #48245 (placeholders go negative, #47900).
    delivers_stale: bool

    def on_preempt(self, req: RequestState, reason: str) -> None:
        """Called at a preemption under async scheduling, before everything in flight is
        marked stale (`req.num_stale_in_flight` still counts the stale entries of earlier
        preemptions)."""

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        """Called for each frame of an unfinished request that is stale or that the policy
        may drop fresh; `stale` is the truth, `num_tokens` the frame's length."""


class EpochPolicy:
    name = "epoch"
    may_drop_fresh = False
    delivers_stale = False

    def on_preempt(self, req: RequestState, reason: str) -> None:
        pass  # the reducer bumps the epoch for every policy

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        return stale


class CounterPolicy:
    name = "counter"
    may_drop_fresh = True
    delivers_stale = False

    def on_preempt(self, req: RequestState, reason: str) -> None:
        # Overwrites, as vLLM did. Placeholders can already be negative here (a stale frame
        # got through: vLLM asserted, #47900); a negative count would discard nothing either.
        req.async_tokens_to_discard = max(0, req.num_output_placeholders)

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        if req.async_tokens_to_discard > 0:
            req.async_tokens_to_discard -= 1  # one per frame, although it was set in tokens
            return True
        return False


class FlagPolicy:
    name = "flag"
    may_drop_fresh = True
    delivers_stale = False

    def on_preempt(self, req: RequestState, reason: str) -> None:
        req.discard_latest_async_tokens = True  # even when nothing is in flight

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        if req.discard_latest_async_tokens:
            req.discard_latest_async_tokens = False
            return True
        return False


class DeliverPolicy:
    name = "deliver"
    may_drop_fresh = False
    delivers_stale = True

    def on_preempt(self, req: RequestState, reason: str) -> None:
        # vLLM's _preempt_request: a reset drops; an undrained dropped share stays dropped
        # (its positions may already be scheduled again), now with everything in flight.
        req.drop_stale_output = reason == "reset_prefix_cache" or (
            req.drop_stale_output and req.num_stale_in_flight > 0)

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        return stale and req.drop_stale_output


class FlagResetOnlyPolicy(FlagPolicy):
    name = "flag-reset-only"

    def on_preempt(self, req: RequestState, reason: str) -> None:
        if reason == "reset_prefix_cache":  # #38624: the KV-pressure path sets nothing
            req.discard_latest_async_tokens = True


class CounterResetOnlyPolicy(CounterPolicy):
    name = "counter-reset-only"

    def on_preempt(self, req: RequestState, reason: str) -> None:
        if reason == "reset_prefix_cache":  # #47900: the KV-pressure path sets nothing
            super().on_preempt(req, reason)


class CounterSpecBudgetPolicy(CounterPolicy):
    name = "counter-spec-budget"

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        if req.async_tokens_to_discard > 0:
            # Drained by the tokens the frame returned, although it was set at 1 + k per frame.
            req.async_tokens_to_discard = max(0, req.async_tokens_to_discard - num_tokens)
            return True
        return False


DISCARD_POLICIES: dict[str, DiscardPolicy] = {
    p.name: p for p in (EpochPolicy(), CounterPolicy(), FlagPolicy(), DeliverPolicy())
}
# Later bugs of the family, reproduced on purpose (tests/tapes/regenerate.py): selectable by
# name like the others, but not in DISCARD_POLICIES (the CLI's choices, chaos grids).
MUSEUM_POLICIES: dict[str, DiscardPolicy] = {
    p.name: p for p in (FlagResetOnlyPolicy(), CounterResetOnlyPolicy(), CounterSpecBudgetPolicy())
}
ALL_POLICIES: dict[str, DiscardPolicy] = {**DISCARD_POLICIES, **MUSEUM_POLICIES}


def get_policy(name: str) -> DiscardPolicy:
    try:
        return ALL_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown discard_policy {name!r}; choose one of {sorted(DISCARD_POLICIES)} "
            f"(or a museum policy: {sorted(MUSEUM_POLICIES)})"
        ) from None
