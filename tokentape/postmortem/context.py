"""What the checkers share during the one pass over a tape: the tape's facts, a little
history the checkers need (the scheduling event of each in-flight step, each request's latest
preemption, the latest resume), the token tallies and the findings gathered so far."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tokentape.events import schema as ev
from tokentape.events.state import EngineState
from tokentape.postmortem.findings import Finding, Severity, excerpt_of
from tokentape.replay.tape import Tape

Item = tuple[int, ev.Event]  # (seq, event)
_MAX_REQUESTS = 16  # requests an engine-wide finding lists


@dataclass(slots=True)
class Preemption:
    """A request's latest preemption, as it was when it happened."""

    seq: int
    event: ev.RequestPreempted
    counter_left: int  # the counter policy's count still undrained: a second one overwrites it
    spec_in_flight: bool  # an entry in flight had speculative tokens (counted in tokens)
    resumed: bool = False  # generation was resumed after it
    fresh_frames: int = 0  # frames of the new epoch that came back since


def cite(p: Preemption | None) -> Item | None:
    """The preemption's event, for an excerpt."""
    return (p.seq, p.event) if p is not None else None


@dataclass(slots=True)
class _Draft:
    kind: str
    severity: Severity
    request_ids: list[str]
    first_step: int
    last_step: int
    message: str
    excerpt: list[Item]
    bug_class: str | None
    seq: int | None
    count: int = 1


@dataclass(slots=True)
class Context:
    tape: Tape
    state: EngineState
    scheduled: dict[int, Item] = field(
        default_factory=dict
    )  # step -> its StepScheduled, while in flight
    preemptions: dict[str, Preemption] = field(default_factory=dict)
    last_resume: Item | None = None
    chunked: set[str] = field(default_factory=set)  # requests whose prefill took several chunks
    # Request ids added again that got output of a step scheduled for the earlier request.
    reused: set[str] = field(default_factory=set)
    tokens: Counter[str] = field(default_factory=Counter)
    _drafts: dict[tuple[str, tuple[str, ...], str], _Draft] = field(default_factory=dict)
    _bug_classes: dict[str, str] = field(default_factory=dict)  # request -> its first bug class

    def report(
        self,
        kind: str,
        severity: Severity,
        request_ids: list[str],
        step: int,
        message: str,
        excerpt: list[Item | None],
        bug_class: str | None = None,
        seq: int | None = None,
        key: str = "",
        last_step: int | None = None,
        per_request: bool = True,
    ) -> None:
        """Record a finding; a repeat of the same kind for the same requests (and key) only
        widens the step range and counts, so one cause gives one finding. An engine-wide
        finding (`per_request=False`) gathers the requests of its repeats instead."""
        if bug_class is not None:
            for r in request_ids:
                self._bug_classes.setdefault(r, bug_class)
        dkey = (kind, tuple(request_ids) if per_request else (), key)
        draft = self._drafts.get(dkey)
        if draft is not None:
            draft.count += 1
            for r in request_ids:
                if r not in draft.request_ids and len(draft.request_ids) < _MAX_REQUESTS:
                    draft.request_ids.append(r)
            draft.first_step = min(draft.first_step, step)
            draft.last_step = max(draft.last_step, step if last_step is None else last_step)
            return
        items = [item for item in excerpt if item is not None]
        self._drafts[dkey] = _Draft(
            kind,
            severity,
            list(request_ids),
            step,
            step if last_step is None else last_step,
            message,
            items,
            bug_class,
            seq,
        )

    def has_error_at(self, seq: int) -> bool:
        """Whether an error finding so far shows at tape position `seq`."""
        return any(d.severity == "error" and d.seq == seq for d in self._drafts.values())

    def bug_class_of(self, req_id: str) -> str | None:
        """The bug class of the first finding so far that names the request and has one: the
        cause a later symptom (a shifted stream, a leftover count) follows from."""
        return self._bug_classes.get(req_id)

    def findings(self) -> list[Finding]:
        out = []
        for d in self._drafts.values():
            message = d.message
            if d.count > 1:
                where = (
                    f"step {d.first_step}"
                    if d.first_step == d.last_step
                    else f"steps {d.first_step}-{d.last_step}"
                )
                message += f" ({d.count} times, {where})"
            out.append(
                Finding(
                    d.kind,
                    d.severity,
                    d.request_ids,
                    (d.first_step, d.last_step),
                    message,
                    excerpt_of(d.excerpt, set(d.request_ids)),
                    d.bug_class,
                    d.seq,
                )
            )
        out.sort(key=lambda f: (f.steps[0], f.seq if f.seq is not None else -1, f.kind))
        return out
