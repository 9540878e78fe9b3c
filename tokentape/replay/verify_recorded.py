"""verify for a tape recorded from another engine (header `source`, e.g. vllm).

tokentape cannot re-run vLLM's scheduler, so "the tape reproduces" cannot mean "tokentape's
scheduler makes the same decisions". It means instead that the recording is consistent: the
recorded decisions are folded by the reducer under the tape's discard policy (`deliver` for
vLLM since #48245), and every fact the fold derives is checked against what was recorded:

- a scheduled entry carries the request's epoch, continues a running request from the
  position the fold has it at (an admitted one from a cached prefix no longer than its
  tokens), and each step stays within the token budget and `max_num_seqs`; nothing is
  scheduled while paused (`keep`), nothing admitted while paused (`wait`);
- a preemption names the entries of the request still in flight; a reset's preemptions follow
  a prefix-cache reset and leave nothing running, and the reset's result is what the state
  allows (it fails while requests hold KV blocks, unless they are reset);
- a finish follows the stop condition the fold derives from the frames (a `stop` without one
  is the front end's: a stop string); an abort names a request still unfinished;
- what the client was given (`OutputsEmitted`) equals what the fold derives: the new tokens,
  the finished flag and the finish reason of every request with pending output;
- frame tokens lie in the vocabulary, and the reducer accepts every event.

The first fact that fails is reported as a Divergence whose `actual` is the derived event
where there is one (`actual_label` "derived"). `ConsistencyChecker` makes the same checks one
event at a time: the vLLM recorder runs it live where vLLM's state can change behind its back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokentape.events import schema as ev
from tokentape.events.fold_errors import FOLD_ERRORS, one_line
from tokentape.events.reducer import evolve
from tokentape.events.state import EngineState, RequestStatus
from tokentape.events.stop_check import check_stop
from tokentape.replay.divergence import Diverged, RecordedStream, VerifyResult, header_divergence
from tokentape.replay.tape import Tape

DERIVED = "derived"


def statement_for(header: ev.TapeHeader) -> str:
    """What verify checks on a tape another engine recorded, in one sentence."""
    engine = f"{header.source} {header.source_version}".strip()
    return (
        f"recorded by {engine}: its scheduler is not re-run; the recorded decisions were folded "
        f"under the '{header.discard_policy}' discard policy and every derived fact was checked "
        "against the recorded frames, finishes and client outputs"
    )


def verify_recorded(tape: Tape, progress: Callable[[int], None] | None = None) -> VerifyResult:
    """Fold the tape and check every derived fact against the recording (see the module)."""
    statement = statement_for(tape.header)
    bad_header = header_divergence(tape)
    if bad_header is not None:
        return VerifyResult(False, 0, bad_header, statement=statement)
    stream = RecordedStream(tape.events(), progress)
    checker = ConsistencyChecker(
        tape.initial_state(),
        tape.config.max_num_batched_tokens,
        tape.config.max_num_seqs,
        tape.header.vocab_size,
    )
    try:
        while (nxt := stream.peek()) is not None:
            event = nxt[1]
            if isinstance(event, (ev.EngineError, ev.RecordingStopped)):
                return stream.ended_with_error(statement)
            try:
                checker.check(event)
                stream.take()
            except Inconsistent as exc:
                raise stream.diverged(exc.message, exc.derived, DERIVED) from None
        try:
            checker.end_of_reset()
        except Inconsistent as exc:
            raise stream.diverged(exc.message, exc.derived, DERIVED) from None
    except Diverged as d:
        return VerifyResult(False, stream.consumed, d.divergence, statement=statement)
    return VerifyResult(True, stream.consumed, statement=statement)


class Inconsistent(Exception):
    """A recorded event that the fold of the events before it contradicts."""

    def __init__(self, message: str, derived: ev.Event | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.derived = derived  # what the fold derives instead, where there is one event


class ConsistencyChecker:
    """Folds recorded events one at a time, each checked against the fold of those before it.
    `check` raises Inconsistent for one that contradicts it; the fold may then hold part of
    that event, so checking stops there."""

    def __init__(
        self, state: EngineState, max_num_batched_tokens: int, max_num_seqs: int, vocab_size: int
    ) -> None:
        self.state = state
        self.max_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.resetting = False  # inside a reset that preempts every running request

    def fail(self, message: str, derived: ev.Event | None = None) -> Inconsistent:
        return Inconsistent(message, derived)

    def check(self, e: ev.Event) -> None:
        if self.resetting and not (
            isinstance(e, ev.RequestPreempted) and e.reason == "reset_prefix_cache"
        ):
            self.end_of_reset()
        before = _BEFORE.get(type(e))
        if before is not None:
            before(self, e)
        try:
            evolve(self.state, e)
        except FOLD_ERRORS as exc:
            raise self.fail(f"the reducer refuses this {ev.kind_of(e)}: {one_line(exc)}") from None
        if isinstance(e, ev.StepScheduled) and len(self.state.running) > self.max_seqs:
            raise self.fail(
                f"step {e.step} leaves {len(self.state.running)} requests running, more "
                f"than max_num_seqs {self.max_seqs}"
            )
        if isinstance(e, ev.PrefixCacheReset) and e.ok and e.reset_running_requests:
            self.resetting = True

    def end_of_reset(self) -> None:
        if not self.resetting:
            return
        self.resetting = False
        if self.state.running:
            raise self.fail(
                f"a prefix-cache reset with reset_running_requests left "
                f"{len(self.state.running)} request(s) running ({self.state.running[0]!r}, ...)"
            )

    # -- the checks before each kind of event is applied -----------------------------------------

    def scheduled(self, e: ev.StepScheduled) -> None:
        state = self.state
        if state.paused == "keep":
            raise self.fail(f"step {e.step} was scheduled while generation was paused (keep)")
        total = sum(entry.num_new_tokens for entry in e.entries)
        if total > self.max_tokens:
            raise self.fail(
                f"step {e.step} schedules {total} tokens, more than "
                f"max_num_batched_tokens {self.max_tokens}"
            )
        for entry in e.entries:
            req = state.requests.get(entry.req_id)
            if req is None or req.is_finished:
                continue  # the reducer refuses it, naming why
            name = f"request {entry.req_id!r} in step {e.step}"
            if entry.num_new_tokens < 1 or not 0 <= entry.num_spec_tokens < entry.num_new_tokens:
                raise self.fail(
                    f"{name} is scheduled {entry.num_new_tokens} tokens with "
                    f"{entry.num_spec_tokens} speculative"
                )
            if entry.epoch != req.epoch:
                raise self.fail(
                    f"{name} is scheduled in epoch {entry.epoch}, but the request is in "
                    f"epoch {req.epoch} ({req.num_preemptions} preemptions)"
                )
            if req.status is RequestStatus.RUNNING:
                if entry.num_computed_before != req.num_computed_tokens:
                    raise self.fail(
                        f"{name} continues from position {entry.num_computed_before}, but "
                        f"the fold has it computed to {req.num_computed_tokens}"
                    )
                continue
            if state.paused == "wait":
                raise self.fail(f"{name} is admitted while generation was paused (wait)")
            known = req.num_tokens
            if entry.num_computed_before + entry.num_new_tokens - entry.num_spec_tokens > known:
                raise self.fail(
                    f"{name} is admitted at positions {entry.num_computed_before}-"
                    f"{entry.num_computed_before + entry.num_new_tokens - 1}, past its "
                    f"{known} known tokens"
                )

    def preempted(self, e: ev.RequestPreempted) -> None:
        req = self.state.requests.get(e.req_id)
        if req is None:
            return  # the reducer refuses it
        if e.reason == "reset_prefix_cache" and not self.resetting:
            raise self.fail(
                f"request {e.req_id!r} is preempted for a prefix-cache reset, but no "
                "reset that resets running requests precedes it"
            )
        if e.in_flight != req.num_in_flight:
            derived = ev.RequestPreempted(e.step, e.req_id, e.reason, req.num_in_flight)
            raise self.fail(
                f"the preemption of {e.req_id!r} records {e.in_flight} steps in flight, "
                f"the fold has {req.num_in_flight}",
                derived,
            )

    def reset(self, e: ev.PrefixCacheReset) -> None:
        ok = e.reset_running_requests or not self.state.running
        if e.ok != ok:
            why = (
                "no request holds KV blocks"
                if ok
                else f"{len(self.state.running)} running requests hold KV blocks"
            )
            raise self.fail(
                f"the prefix-cache reset records ok={e.ok}, but {why}",
                ev.PrefixCacheReset(e.step, e.reset_running_requests, ok),
            )

    def finished(self, e: ev.RequestFinished) -> None:
        req = self.state.requests.get(e.req_id)
        if req is None:
            return
        if req.is_finished:
            raise self.fail(
                f"request {e.req_id!r} finishes ({e.reason}), but it finished before "
                f"({req.finish_reason})"
            )
        # The stop rule over everything the frames gave it: a stop string (reason "stop")
        # may finish it where the rule finds nothing.
        decision = check_stop(req, 0, self.state.eos_token_id)
        derived = decision.reason if decision is not None else None
        if derived is None and e.reason != "stop":
            raise self.fail(
                f"request {e.req_id!r} finishes ({e.reason}), but its frames reach no "
                "stop condition"
            )
        if derived is not None and derived != e.reason:
            raise self.fail(
                f"request {e.req_id!r} finishes ({e.reason}), but its frames reach "
                f"the {derived} condition",
                ev.RequestFinished(e.step, e.req_id, derived),
            )

    def aborted(self, e: ev.RequestAborted) -> None:
        req = self.state.requests.get(e.req_id)
        if req is not None and req.is_finished:
            raise self.fail(
                f"request {e.req_id!r} is aborted, but it finished before ({req.finish_reason})"
            )

    def resumed(self, e: ev.GenerationResumed) -> None:
        if self.state.paused is None:
            raise self.fail("generation is resumed while it was not paused")

    def frame(self, e: ev.FrameProduced) -> None:
        vocab = self.vocab_size
        if vocab <= 0:
            return
        for entry in e.entries:
            for tok in entry.token_ids:
                if not 0 <= tok < vocab:
                    raise self.fail(
                        f"the frame of step {e.step} gives request {entry.req_id!r} token "
                        f"{tok}, outside the vocabulary [0, {vocab})"
                    )

    def outputs(self, e: ev.OutputsEmitted) -> None:
        requests = self.state.requests
        derived = {}
        for req_id in self.state.pending_output:
            req = requests[req_id]
            derived[req_id] = ev.EmittedOutput(
                req_id,
                req.output_token_ids[req.num_emitted :],
                req.finish_reason is not None,
                req.finish_reason,
            )
        recorded = {o.req_id: o for o in e.entries}
        if recorded == derived:
            return
        req_id = next(
            r for r in sorted(set(recorded) | set(derived)) if recorded.get(r) != derived.get(r)
        )
        raise self.fail(
            f"the client was given {_describe(recorded.get(req_id))} for request {req_id!r} "
            f"at step {e.step}, but the fold derives {_describe(derived.get(req_id))}",
            ev.OutputsEmitted(e.step, list(derived.values())),
        )


def _describe(out: ev.EmittedOutput | None) -> str:
    if out is None:
        return "nothing"
    return f"tokens {out.token_ids}" + (
        f", finished ({out.finish_reason})" if out.finished else ", not finished"
    )


_BEFORE: dict[type, Callable[[ConsistencyChecker, Any], None]] = {
    ev.StepScheduled: ConsistencyChecker.scheduled,
    ev.RequestPreempted: ConsistencyChecker.preempted,
    ev.PrefixCacheReset: ConsistencyChecker.reset,
    ev.RequestFinished: ConsistencyChecker.finished,
    ev.RequestAborted: ConsistencyChecker.aborted,
    ev.GenerationResumed: ConsistencyChecker.resumed,
    ev.FrameProduced: ConsistencyChecker.frame,
    ev.OutputsEmitted: ConsistencyChecker.outputs,
}
