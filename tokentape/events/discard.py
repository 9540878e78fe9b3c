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

- `vllm-flag`, `vllm-counter`, `vllm-counter-guarded`: vLLM's AsyncScheduler exactly as
  released before PR #42117 (0.20-0.21), between #42117 and #46066 (0.22-0.24) and from #46066
  to #48245 (0.25-0.26): the flag or the counter is set by a reset's preemptions only; a
  KV-pressure preemption leaves the stale frame to be applied, which vLLM's batch queue of
  depth 2 does before the request is scheduled again, so it is delivered as under `deliver`.
  With drafts, a frame gives its rejected drafts back even when the discard drops it, which
  sends a resumed request's placeholders below zero (#46066); 0.25 stopped that while the
  counter runs. Tapes recorded from those releases name them.

- `flag-reset-only`: vLLM #38624. The flag is set by a reset's preemptions only, so a
  KV-pressure preemption leaves its in-flight output to be applied: a token twice.
- `counter-reset-only`: vLLM between #42117 and #48245 (#47900). The counter is set by a
  reset's preemptions only; a KV-pressure preemption zeroes the placeholders and the stale
  output that comes back is applied and counted, so they go below zero (vLLM asserted).
- `counter-spec-budget`: vLLM #41190 (fixed by #49620). The discard budget is counted in
  tokens, 1 + k per frame in flight, and a stale frame takes back the tokens it returned
  (1 + accepted drafts): after rejected drafts the budget outlives the stale frames and
  drops fresh ones. (The issue gives the budget's unit; how it drained is modelled.)
- `omni-discard-one`: vllm-omni before its PR #5183, a downstream copy of #42043's bug. A
  stop of the request's output sets the discard count to 1 and zeroes the placeholders,
  whatever is in flight: with nothing in flight (a drain came first) the first fresh frame
  is dropped; with two or more steps in flight the second stale frame is applied. Modelled
  at every preemption, tokentape's stop of a running request's output.
"""

from __future__ import annotations

from typing import Protocol

from tokentape.events.state import EngineState, RequestState


class DiscardPolicy(Protocol):
    name: str
    mechanism: str  # what drops frames, in vLLM's words, for the postmortem's messages
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

    def discard_count(self, req: RequestState) -> int:
        """The request's discard count as the policy keeps it (the debugger's `discard`)."""

    def fresh_drop_bug(self, spec_in_flight: bool, counter_left: int) -> str | None:
        """The upstream bug a fresh frame dropped after a preemption matches: `spec_in_flight`,
        an entry in flight then had drafts; `counter_left`, the count it found undrained."""

    def stale_bug(self, reason: str, counter_left: int) -> str | None:
        """The upstream bug a stale frame applied after a preemption for `reason` matches."""

    def give_back_drafts(
        self, req: RequestState, stale: bool, num_drafts: int, num_accepted: int
    ) -> int:
        """Called for a frame whose entry had drafts, before the discard looks at it: gives
        back the rejected draft positions; returns the placeholders the frame's tokens then
        return if it is applied."""

    def negative_placeholders_bug(
        self, reason: str, spec_in_flight: bool, counter_left: int
    ) -> str | None:
        """The upstream bug that placeholders going below zero after a preemption for `reason`
        match (`spec_in_flight`: an entry in flight then had drafts)."""


class _Policy:
    """What the policies share: no discard count of their own, no upstream bug."""

    name = ""
    mechanism = ""
    # vLLM before #48245 as released: a frame with drafts gives its rejected drafts back even
    # when the discard drops it (_give_back_drafts_as_released).
    drafts_as_released = False

    def discard_count(self, req: RequestState) -> int:
        return req.num_stale_in_flight

    def give_back_drafts(
        self, req: RequestState, stale: bool, num_drafts: int, num_accepted: int
    ) -> int:
        if self.drafts_as_released:
            return _give_back_drafts_as_released(req, num_drafts, num_accepted)
        if not stale:  # rejected draft positions were counted as computed
            req.num_computed_tokens -= num_drafts - num_accepted
        return 1 + num_drafts

    def fresh_drop_bug(self, spec_in_flight: bool, counter_left: int) -> str | None:
        return None

    def stale_bug(self, reason: str, counter_left: int) -> str | None:
        if counter_left > 0:
            return "vllm#42117-overwrite"
        return "vllm#47900" if reason == "kv_pressure" else None

    def negative_placeholders_bug(
        self, reason: str, spec_in_flight: bool, counter_left: int
    ) -> str | None:
        if self.drafts_as_released and reason == "reset_prefix_cache" and spec_in_flight:
            return "vllm#46066"  # the dropped stale frame's rejected drafts, given back
        return self.stale_bug(reason, counter_left)  # a stale frame that got through, counted


def _give_back_drafts_as_released(req: RequestState, num_drafts: int, num_accepted: int) -> int:
    """vLLM before #48245 (Scheduler.update_from_output): every frame with drafts, stale or
    about to be dropped, takes its rejected drafts off the computed tokens and the placeholders
    when they are positive. A stale frame thus takes them from a request already scheduled again
    after a reset, and its placeholders go below zero, silently (#46066)."""
    rejected = num_drafts - num_accepted
    if req.num_computed_tokens > 0:
        req.num_computed_tokens -= rejected
    if req.num_output_placeholders > 0:
        req.num_output_placeholders -= rejected
    return 1 + num_accepted  # what the applied tokens return (the rejected ones went above)


class EpochPolicy(_Policy):
    name = "epoch"
    mechanism = "the epoch check"
    may_drop_fresh = False
    delivers_stale = False

    def on_preempt(self, req: RequestState, reason: str) -> None:
        pass  # the reducer bumps the epoch for every policy

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        return stale


class CounterPolicy(_Policy):
    name = "counter"
    mechanism = "the discard counter (async_tokens_to_discard)"
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

    def discard_count(self, req: RequestState) -> int:
        return req.async_tokens_to_discard

    def fresh_drop_bug(self, spec_in_flight: bool, counter_left: int) -> str | None:
        if spec_in_flight:
            return "vllm#42117-spec-units"
        return "vllm#42117-overwrite" if counter_left > 0 else None


class FlagPolicy(_Policy):
    name = "flag"
    mechanism = "the preemption flag (discard_latest_async_tokens)"
    may_drop_fresh = True
    delivers_stale = False

    def on_preempt(self, req: RequestState, reason: str) -> None:
        req.discard_latest_async_tokens = True  # even when nothing is in flight

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        if req.discard_latest_async_tokens:
            req.discard_latest_async_tokens = False
            return True
        return False

    def discard_count(self, req: RequestState) -> int:
        return int(req.discard_latest_async_tokens)

    def fresh_drop_bug(self, spec_in_flight: bool, counter_left: int) -> str | None:
        return "vllm#42043"

    def stale_bug(self, reason: str, counter_left: int) -> str | None:
        if reason == "kv_pressure":
            return "vllm#47900"
        return "vllm#42043-one-frame"  # one flag for a reset that left several stale frames


class DeliverPolicy(_Policy):
    name = "deliver"
    mechanism = "drop_stale_output"
    may_drop_fresh = False
    delivers_stale = True

    def on_preempt(self, req: RequestState, reason: str) -> None:
        # vLLM's _preempt_request: a reset drops; an undrained dropped share stays dropped
        # (its positions may already be scheduled again), now with everything in flight.
        req.drop_stale_output = reason == "reset_prefix_cache" or (
            req.drop_stale_output and req.num_stale_in_flight > 0
        )

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        return stale and req.drop_stale_output

    def discard_count(self, req: RequestState) -> int:  # the stale frames it will drop
        return req.num_stale_in_flight if req.drop_stale_output else 0


class FlagResetOnlyPolicy(FlagPolicy):
    name = "flag-reset-only"

    def on_preempt(self, req: RequestState, reason: str) -> None:
        if reason == "reset_prefix_cache":  # #38624: the KV-pressure path sets nothing
            req.discard_latest_async_tokens = True

    def stale_bug(self, reason: str, counter_left: int) -> str | None:
        if reason == "kv_pressure":
            return "vllm#38624"
        return _Policy.stale_bug(self, reason, counter_left)


class CounterResetOnlyPolicy(CounterPolicy):
    name = "counter-reset-only"

    def on_preempt(self, req: RequestState, reason: str) -> None:
        if reason == "reset_prefix_cache":  # #47900: the KV-pressure path sets nothing
            super().on_preempt(req, reason)

    def stale_bug(self, reason: str, counter_left: int) -> str | None:
        return "vllm#47900" if reason == "kv_pressure" else super().stale_bug(reason, counter_left)


class VllmFlagPolicy(FlagResetOnlyPolicy):
    """vLLM 0.20-0.21 as released: the reset's flag; KV-pressure output delivered."""

    name = "vllm-flag"
    delivers_stale = True
    drafts_as_released = True

    def on_preempt(self, req: RequestState, reason: str) -> None:
        super().on_preempt(req, reason)
        # The flag drops the reset's stale frame, so the request may be scheduled at once
        # (what drop_stale_output tells the scheduler).
        req.drop_stale_output = reason == "reset_prefix_cache"

    def stale_bug(self, reason: str, counter_left: int) -> str | None:
        # Applied only once scheduled again before it drained (a KV-pressure preemption: what
        # #38624 describes), or a second stale frame behind the one the reset's flag dropped.
        if reason == "kv_pressure":
            return super().stale_bug(reason, counter_left)
        return FlagPolicy.stale_bug(self, reason, counter_left)


class VllmCounterPolicy(CounterResetOnlyPolicy):
    """vLLM 0.22-0.24 as released: the reset's counter; KV-pressure output delivered."""

    name = "vllm-counter"
    delivers_stale = True
    drafts_as_released = True

    def on_preempt(self, req: RequestState, reason: str) -> None:
        super().on_preempt(req, reason)
        req.drop_stale_output = reason == "reset_prefix_cache"


class VllmCounterGuardedPolicy(VllmCounterPolicy):
    """vLLM 0.25-0.26 as released: #46066's guard, a frame the counter is about to drop gives
    no drafts back (not even a fresh one, whose rejected positions stay counted as computed)."""

    name = "vllm-counter-guarded"

    def give_back_drafts(
        self, req: RequestState, stale: bool, num_drafts: int, num_accepted: int
    ) -> int:
        if req.async_tokens_to_discard > 0:
            return 1 + num_drafts  # dropped: nothing is given back
        return super().give_back_drafts(req, stale, num_drafts, num_accepted)


class CounterSpecBudgetPolicy(CounterPolicy):
    name = "counter-spec-budget"

    def fresh_drop_bug(self, spec_in_flight: bool, counter_left: int) -> str | None:
        return "vllm#41190"

    def should_drop(self, req: RequestState, stale: bool, num_tokens: int) -> bool:
        if req.async_tokens_to_discard > 0:
            # Drained by the tokens the frame returned, although it was set at 1 + k per frame.
            req.async_tokens_to_discard = max(0, req.async_tokens_to_discard - num_tokens)
            return True
        return False


class OmniDiscardOnePolicy(CounterPolicy):
    name = "omni-discard-one"

    def on_preempt(self, req: RequestState, reason: str) -> None:
        req.async_tokens_to_discard = 1  # vllm-omni #5183: 1, whatever is in flight

    def fresh_drop_bug(self, spec_in_flight: bool, counter_left: int) -> str | None:
        return "vllm-omni#5183"

    def stale_bug(self, reason: str, counter_left: int) -> str | None:
        return "vllm-omni#5183"


DISCARD_POLICIES: dict[str, DiscardPolicy] = {
    p.name: p for p in (EpochPolicy(), CounterPolicy(), FlagPolicy(), DeliverPolicy())
}
# Later bugs of the family, reproduced on purpose (tests/tapes/regenerate.py): selectable by
# name like the others, but not in DISCARD_POLICIES (the CLI's choices, chaos grids).
MUSEUM_POLICIES: dict[str, DiscardPolicy] = {
    p.name: p
    for p in (
        FlagResetOnlyPolicy(),
        CounterResetOnlyPolicy(),
        CounterSpecBudgetPolicy(),
        VllmFlagPolicy(),
        VllmCounterPolicy(),
        VllmCounterGuardedPolicy(),
        OmniDiscardOnePolicy(),
    )
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


def discard_count(state: EngineState, req: RequestState) -> int:
    """The derived discard count of a request under its tape's policy (the policy's
    knowledge: the state only names the policy)."""
    return get_policy(state.discard_policy).discard_count(req)
