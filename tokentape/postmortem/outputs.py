"""Checkers of what the client received.

- `output_mismatch`: an `OutputsEmitted` event records what the client was given; the
  reducer derives what it should have been given (the pending requests' new tokens, finished
  flag and finish reason). They must agree.
- Against a reference stream per request (a reference tape's outputs, or the oracle's
  expected stream when the tape was made with the oracle): the first delivered token that
  differs is classified as `token_duplicated` (the stream repeats a token: a stale token got
  through), `token_shifted` (the stream skips tokens: a fresh token was dropped) or
  `token_mismatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from tokentape.engine.factory import make_runner
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.events import schema as ev
from tokentape.events.state import RequestState
from tokentape.postmortem.base import Checker, Hook
from tokentape.postmortem.context import Context
from tokentape.replay.tape import Tape

_MAX_SHIFT = 4  # tokens a stream may be duplicated or shifted by and still be classified
_LOOKAHEAD = 8  # extra reference tokens, so that a shifted stream can be matched at its end


class OutputChecker(Checker):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._finished: dict[str, tuple[int, ev.Event]] = {}  # finishes not yet delivered

    def before(self) -> dict[type, Hook]:
        return {ev.OutputsEmitted: self._emitted}

    def after(self) -> dict[type, Hook]:
        return {ev.RequestFinished: self._finish, ev.RequestAborted: self._finish}

    def _finish(self, seq: int, e: ev.RequestFinished | ev.RequestAborted) -> None:
        self._finished[e.req_id] = (seq, e)

    def _emitted(self, seq: int, e: ev.OutputsEmitted) -> None:
        requests = self.state.requests
        derived = {}
        for req_id in self.state.pending_output:
            req = requests[req_id]
            derived[req_id] = (
                req.output_token_ids[req.num_emitted :],
                req.finish_reason is not None,
                req.finish_reason,
            )
        recorded = {o.req_id: (o.token_ids, o.finished, o.finish_reason) for o in e.entries}
        finished, self._finished = self._finished, {}
        if recorded == derived:
            return
        for req_id in sorted(set(recorded) | set(derived)):
            got, want = recorded.get(req_id), derived.get(req_id)
            if got == want:
                continue
            bug = None
            if (
                want is not None
                and want[2] == "abort"
                and got is not None
                and got[2] not in ("abort", None)
            ):
                bug = "vllm#26400"
            self.ctx.report(
                "output_mismatch",
                "error",
                [req_id],
                e.step,
                f"the client was given {_describe(got)} for request {req_id!r} at step {e.step}, "
                f"but the reducer derives {_describe(want)}",
                [finished.get(req_id), (seq, e)],
                bug,
                seq,
            )


def _oracle_length(longer: list[int], req: RequestState) -> int:
    """The length of the oracle's stream for the request, from a longer copy of it."""
    limit = min(req.max_output_tokens, len(longer))
    for i in range(limit):
        if longer[i] in req.stop_ids:
            return i + 1
    return limit


def _describe(out: tuple[list[int], bool, str | None] | None) -> str:
    if out is None:
        return "nothing"
    tokens, finished, reason = out
    return f"tokens {tokens}" + (f", finished ({reason})" if finished else ", not finished")


@dataclass(slots=True)
class _Divergence:
    index: int  # first output position that differs
    step: int
    seq: int
    event: ev.FrameProduced
    scheduled: tuple[int, ev.Event] | None


class ReferenceChecker(Checker):
    """Compares each request's delivered tokens with a reference stream as they arrive."""

    def __init__(
        self,
        ctx: Context,
        reference: dict[str, tuple[list[int], list[int], str | None]] | None,
        source: str,
    ) -> None:
        """`reference` maps request ids to (prompt, output tokens, finish reason); None uses
        the oracle."""
        super().__init__(ctx)
        self.source = source
        self.reference = reference  # None: the oracle's expected stream, built per request
        self.streams: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}  # where a reference stream that finished normally ends
        self.checked: dict[str, int] = {}
        self.diverged: dict[str, _Divergence] = {}
        self.oracle = None
        if reference is None:
            self.oracle = oracle_of(ctx.tape)
            self.max_model_len = ctx.tape.config.effective_max_model_len

    def after(self) -> dict[type, Hook]:
        return {
            ev.RequestAdded: self._added,
            ev.EngineSnapshot: self._restored,
            ev.FrameProduced: self._frame,
            ev.RequestFinished: self._finished,
            ev.RequestAborted: self._finished,
        }

    def _added(self, seq: int, e: ev.RequestAdded) -> None:
        self._follow(e.req_id, e.prompt_token_ids, e.params)

    def _restored(self, seq: int, e: ev.EngineSnapshot) -> None:
        """A segment's requests that were added before it: followed from here, their output
        so far checked with the next frame that gives them tokens."""
        for r in e.requests:
            if r.req_id not in self.checked and r.finish_reason is None:
                self._follow(r.req_id, r.prompt_token_ids, r.params)

    def _follow(self, req_id: str, prompt: list[int], params: ev.SamplingParams) -> None:
        if self.oracle is not None:
            longer = msgspec.structs.replace(params, max_tokens=params.max_tokens + _LOOKAHEAD)
            self.streams[req_id] = self.oracle.expected_stream(
                prompt, longer, self.max_model_len + _LOOKAHEAD
            )
        elif self.reference is not None and req_id in self.reference:
            ref_prompt, tokens, reason = self.reference[req_id]
            if ref_prompt == prompt:  # the same request id may name another request
                self.streams[req_id] = tokens
                if reason in ("stop", "length"):
                    self.lengths[req_id] = len(tokens)
        self.checked[req_id] = 0

    def _frame(self, seq: int, e: ev.FrameProduced) -> None:
        streams, checked, requests = self.streams, self.checked, self.state.requests
        for entry in e.entries:
            req_id = entry.req_id
            ref = streams.get(req_id)
            if ref is None or req_id in self.diverged:
                continue
            out = requests[req_id].output_token_ids
            start = checked[req_id]
            if len(out) == start:
                continue
            if out[start:] != ref[start : len(out)]:
                i = next(i for i in range(start, len(out)) if i >= len(ref) or out[i] != ref[i])
                self.diverged[req_id] = _Divergence(
                    i, e.step, seq, e, self.ctx.scheduled.get(e.step)
                )
            checked[req_id] = len(out)

    def _finished(self, seq: int, e: ev.RequestFinished | ev.RequestAborted) -> None:
        """A finished request takes no more tokens: judge it now and forget its stream."""
        req = self.state.requests.get(e.req_id)
        if req is not None and e.req_id in self.streams:
            self._settle(req)

    def finish(self) -> None:
        requests = self.state.requests
        for req_id in list(self.streams):
            self._settle(requests[req_id])

    def _settle(self, req: RequestState) -> None:
        ref = self.streams.pop(req.req_id)
        self.checked.pop(req.req_id, None)
        d = self.diverged.pop(req.req_id, None)
        if d is not None:
            self._classify(req.req_id, req.output_token_ids, ref, d)
            return
        want = self.lengths.pop(req.req_id, None)
        if req.finish_reason not in ("stop", "length") or isinstance(req.stop_reason, str):
            return  # a stop string ends it where the text matched: its tokens were compared
        if self.oracle is not None:
            # The oracle knows where the stream must end: its stop condition, within the lookahead.
            want = _oracle_length(ref, req)
        if want is not None and len(req.output_token_ids) != want:
            self.ctx.report(
                "token_mismatch",
                "error",
                [req.req_id],
                req.arrival_step,
                f"request {req.req_id!r} finished ({req.finish_reason}) with "
                f"{len(req.output_token_ids)} tokens where the {self.source} stream has {want}",
                [],
                None,
                None,
            )

    def _classify(self, req_id: str, out: list[int], ref: list[int], d: _Divergence) -> None:
        """Name how the delivered stream leaves the reference at position d.index: the rest of
        it is the reference moved back (duplicated tokens) or up (skipped tokens), or not."""
        i = d.index

        def moved(shift: int) -> bool:  # out[i:] is the reference moved by `shift`, to its end
            rest = out[i:]
            lo, hi = i + shift, i + shift + len(rest)
            if lo < 0 or lo >= len(ref):
                return False
            return rest[: len(ref) - lo] == ref[lo:hi]

        shifts = [s for s in range(1, _MAX_SHIFT + 1) for s in (-s, s) if moved(s)]
        where = f"output position {i} (step {d.step})"
        got = out[i] if i < len(out) else None
        expected = ref[i] if i < len(ref) else None
        excerpt = [d.scheduled, (d.seq, d.event)]
        bug = self.ctx.bug_class_of(req_id)
        if shifts and shifts[0] < 0:
            self.ctx.report(
                "token_duplicated",
                "error",
                [req_id],
                d.step,
                f"request {req_id!r} repeats {-shifts[0]} token(s) at {where} against the "
                f"{self.source} "
                f"stream: got {got}, expected {expected}; every later token comes one place late",
                excerpt,
                bug,
                d.seq,
            )
        elif shifts:
            self.ctx.report(
                "token_shifted",
                "error",
                [req_id],
                d.step,
                f"request {req_id!r} skips {shifts[0]} token(s) at {where} against the "
                f"{self.source} "
                f"stream: got {got}, expected {expected}; every later token moved up",
                excerpt,
                bug,
                d.seq,
            )
        else:
            near = [
                j
                for j in range(max(0, i - _MAX_SHIFT), min(len(ref), i + _MAX_SHIFT + 1))
                if j != i and ref[j] == got
            ]
            whose = f" (the token of position {near[0]})" if near else ""
            back = next(
                (
                    j
                    for j in range(i + 1, len(out))
                    if j < len(ref) and out[j:] == ref[j : len(out)]
                ),
                None,
            )
            after = f"; from position {back} on it matches again" if back is not None else ""
            self.ctx.report(
                "token_mismatch",
                "error",
                [req_id],
                d.step,
                f"request {req_id!r} differs from the {self.source} stream at {where}: got "
                f"{got}{whose}, expected {expected}{after}",
                excerpt,
                bug,
                d.seq,
            )


def oracle_of(tape: Tape) -> OracleRunner:
    """The oracle a tape was recorded with, built as the engine built it (model and seed come
    from the tape's config), for its expected streams."""
    runner = make_runner(tape.config)
    if not isinstance(runner, OracleRunner):
        raise ValueError(f"the tape was recorded with {tape.config.model!r}, not the oracle")
    return runner
