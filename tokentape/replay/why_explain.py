"""The answer of `tokentape why`: from one request's traced entries (tokentape/replay/why.py)
to the chain of events that touched one output position, and a verdict in words."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokentape.replay.why_trace import RequestTracer, TracedFrame


class WhyError(ValueError):
    """The tape does not have the request, or the position is not an output position."""


@dataclass(slots=True)
class Link:
    """One event of the chain: where it is, what it did to the position."""

    seq: int
    step: int
    kind: str  # the event's kind
    # added, scheduled, produced, dropped, ignored, preempted, finished, delivered; with
    # weight updates (why_weights.py): paused, weights, cache hit
    role: str
    detail: str


@dataclass(slots=True)
class WhyResult:
    tape: str | None
    request: str
    position: int
    discard_policy: str
    delivered: bool
    token: int | None = None  # the token at the position in the request's output, if any
    step: int | None = None  # the step that scheduled the frame which produced it
    scheduled_seq: int | None = None
    frame_seq: int | None = None
    epoch: int | None = None
    scheduled_for: int | None = None  # the output position that step computed it for
    delivered_seq: int | None = None
    weight_version: str | None = None  # the weights that computed it (a tape with updates)
    verdict: str = ""
    chain: list[Link] = field(default_factory=list)
    events_read: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """The verdict, then the chain, one event a line (tape data is the caller's to escape)."""
        lines = [self.verdict, "", f"chain ({len(self.chain)} events):"]
        lines += [
            f"  @{x.seq:<8} step {x.step:<6} {x.role:<10} {x.kind}: {x.detail}" for x in self.chain
        ]
        return "\n".join(lines)


def _covers(span: tuple[int, int] | None, p: int) -> bool:
    return span is not None and span[0] <= p < span[1]


def _targets(f: TracedFrame, p: int) -> bool:
    return f.first is not None and f.first <= p < f.first + f.span


def _positions(a: int, b: int) -> str:
    return f"position {a}" if b - a == 1 else f"positions {a}..{b - 1}"


def _frame_link(f: TracedFrame, p: int, out: list[int], policy: str) -> Link | None:
    if f.frame_seq is None:
        return None
    epoch = f"epoch {f.epoch}" + (", stale" if f.stale else "")
    if f.fate == "applied" and f.landed is not None:
        a, b = f.landed
        if a <= p < b:
            detail = f"produced token {out[p]} at position {p} ({epoch})"
            if f.stale:
                detail += f": stale output delivered, as the {policy!r} policy does"
            return Link(f.frame_seq, f.step, "FrameProduced", "produced", detail)
        return Link(
            f.frame_seq,
            f.step,
            "FrameProduced",
            "produced",
            f"its tokens went to {_positions(a, b)} ({epoch})",
        )
    if f.fate == "dropped":
        why = (
            f"dropped as stale ({epoch})"
            if f.stale
            else f"dropped by the {policy!r} policy although fresh ({epoch}): its tokens are lost, "
            "and every later token moves up"
        )
        where = f"; they would have gone to {_positions(*f.would)}" if f.would else ""
        return Link(f.frame_seq, f.step, "FrameProduced", "dropped", why + where)
    if f.fate == "ignored":
        return Link(
            f.frame_seq,
            f.step,
            "FrameProduced",
            "ignored",
            f"arrived after the request had stopped ({epoch}): not applied",
        )
    return None


def explain(tracer: RequestTracer, p: int, parked: str | None = None) -> WhyResult:
    """The chain of events that touched output position `p` of the traced request; `parked`:
    why a request never scheduled was parked by a sleep (why_sleep.py), if it was."""
    req, rid = tracer.req, tracer.req_id
    policy = tracer.state.discard_policy
    if p >= req.max_output_tokens:
        raise WhyError(
            f"request {rid!r} asks for at most {req.max_output_tokens} output tokens "
            f"(positions 0..{req.max_output_tokens - 1}); position {p} cannot exist"
        )
    out = req.output_token_ids
    res = WhyResult(None, rid, p, policy, False, events_read=tracer.events_read)
    chain: list[Link] = []
    assert tracer.added is not None
    a_seq, added = tracer.added
    chain.append(
        Link(
            a_seq,
            added.step,
            "RequestAdded",
            "added",
            f"prompt of {len(added.prompt_token_ids)} tokens, max_tokens={added.params.max_tokens}",
        )
    )
    # A fresh frame dropped at or before the position moved every later token: it touched it.
    fresh_drops = [
        f
        for f in tracer.frames.values()
        if f.fate == "dropped" and not f.stale and f.would and f.would[0] <= p
    ]
    touching = [
        f
        for f in tracer.frames.values()
        if _targets(f, p) or _covers(f.landed, p) or _covers(f.would, p) or f in fresh_drops
    ]
    producer = next((f for f in touching if _covers(f.landed, p)), None)
    for f in touching:
        last = f.first + f.span - 1 if f.first is not None else None
        where = f"position {f.first}" if last == f.first else f"positions {f.first}..{last}"
        detail = f"computes {where} in epoch {f.epoch}"
        if f.trusted:
            detail += (
                f", taking its first {len(f.trusted) * tracer.block_size} tokens as computed: "
                f"KV block(s) {f.trusted} it did not compute (a prefix-cache hit, or loaded KV)"
            )
        if f.earlier is not None:
            detail += (
                f", for the earlier request {rid!r} (added at event {f.earlier}), which "
                "finished while it was in flight"
            )
        chain.append(Link(f.sched_seq, f.step, "StepScheduled", "scheduled", detail))
        link = _frame_link(f, p, out, policy)
        if link is not None:
            chain.append(link)
    delivery = next(((s, e, a, b) for s, e, a, b in tracer.emitted if a <= p < b), None)
    first_touch = min((f.sched_seq for f in touching), default=a_seq)
    until = delivery[0] if delivery else 1 << 62
    # The preemption that made a touching frame stale, or set the policy that dropped it.
    discarded = [
        f.frame_seq
        for f in touching
        if f.frame_seq is not None and (f.stale or f.fate == "dropped")
    ]
    if discarded:
        first_touch = min(
            first_touch,
            max(
                (seq for seq, _, _ in tracer.preemptions if seq < min(discarded)),
                default=first_touch,
            ),
        )
    for seq, e, length in tracer.preemptions:
        if first_touch <= seq <= until:
            chain.append(
                Link(
                    seq,
                    e.step,
                    "RequestPreempted",
                    "preempted",
                    f"reason {e.reason}, {e.in_flight} step(s) in flight, {length} tokens so far",
                )
            )
    if tracer.finish is not None and (p >= len(out) - 1):
        f_seq, f_event = tracer.finish
        reason = getattr(f_event, "reason", "abort")
        chain.append(
            Link(
                f_seq,
                f_event.step,
                type(f_event).__name__,
                "finished",
                f"reason {reason}, {len(out)} output tokens",
            )
        )
    if delivery is not None:
        d_seq, d_event, a, b = delivery
        chain.append(
            Link(
                d_seq,
                d_event.step,
                "OutputsEmitted",
                "delivered",
                f"gave the client {_positions(a, b)}",
            )
        )
    chain.sort(key=lambda x: x.seq)
    res.chain = chain

    if p < len(out):
        res.token = out[p]
    if producer is not None:
        res.step, res.scheduled_seq, res.frame_seq = (
            producer.step,
            producer.sched_seq,
            producer.frame_seq,
        )
        res.epoch = producer.epoch
        assert producer.first is not None and producer.landed is not None
        res.scheduled_for = producer.first + (p - producer.landed[0])
        if producer.sampled_at is not None:  # what the runner computed, from its frame
            res.scheduled_for = producer.sampled_at + (p - producer.landed[0])
        if producer.earlier is not None:  # a position of another request
            res.scheduled_for = None
    res.delivered = delivery is not None
    res.delivered_seq = delivery[0] if delivery else None
    res.verdict = _verdict(res, tracer, p, fresh_drops) + _museum_notes(tracer, producer, parked)
    return res


def _museum_notes(tracer: RequestTracer, producer: TracedFrame | None, parked: str | None) -> str:
    """What the bug family's newer members leave at a position (docs/postmortem.md)."""
    notes = []
    if producer is not None and producer.earlier is not None:
        notes.append(
            f"Step {producer.step} was scheduled for the earlier request {tracer.req_id!r} "
            f"(added at event {producer.earlier}), which finished while the step was in "
            f"flight; the id was added again at event {tracer.readded}, and the old step's "
            "output landed on the new request (a stale output on a reused request id: "
            "vLLM #42492)."
        )
    first = min(tracer.frames.values(), key=lambda f: f.step, default=None)
    if first is not None and first.trusted:
        notes.append(
            f"Its first step took KV block(s) {first.trusted} as already holding its first "
            f"{len(first.trusted) * tracer.block_size} tokens; `tokentape postmortem` says "
            "whether a step still in flight wrote other tokens into them "
            "(block_reused_while_in_flight, vLLM #45357)."
        )
    if parked is not None and not tracer.frames:
        notes.append(parked)
    elif not tracer.frames and tracer.added is not None:
        end = tracer.finish[1].step if tracer.finish is not None else None
        until = f"until step {end}" if end is not None else "to the end of the tape"
        notes.append(
            f"It was never scheduled: it waited from step {tracer.added[1].step} {until} "
            "(`tokentape postmortem` names a stalled admission: admission_stalled, "
            "vLLM #53130)."
        )
    return "".join(" " + n for n in notes)


def _verdict(res: WhyResult, tracer: RequestTracer, p: int, fresh_drops: list[TracedFrame]) -> str:
    req = tracer.req
    head = f"request {res.request!r}, output position {p}: "
    if res.step is not None:
        text = (
            head + f"token {res.token}, scheduled by step {res.step} (event {res.scheduled_seq}) "
            f"in epoch {res.epoch}, produced by its frame (event {res.frame_seq})"
        )
        text += (
            f", delivered by event {res.delivered_seq}."
            if res.delivered
            else ", never delivered: the tape ends first."
        )
        if res.scheduled_for is not None and res.scheduled_for < p:
            text += (
                f" Step {res.step} computed it for position {res.scheduled_for}, which the "
                f"request already had: position {res.scheduled_for} was delivered twice and "
                f"this token comes {p - res.scheduled_for} place(s) late (duplicated_token: "
                "a step that sampled a delivered position again, as tenstorrent/vllm #395's "
                "stale input does)."
            )
        elif res.scheduled_for is not None and res.scheduled_for != p:
            text += (
                f" Step {res.step} computed it for position {res.scheduled_for}: "
                f"{len(fresh_drops)} fresh frame(s) dropped before it moved it up "
                f"{res.scheduled_for - p} place(s) (the shift of vLLM #42043)."
            )
        return text
    n = len(req.output_token_ids)
    if req.finish_reason is not None:
        text = head + f"never produced: the request finished ({req.finish_reason}) with {n} tokens."
    else:
        text = head + f"not produced: the tape ends with the request unfinished ({n} tokens)."
    if fresh_drops:
        text += f" {len(fresh_drops)} fresh frame(s) were dropped before it."
    return text
