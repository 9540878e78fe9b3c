"""diff: align two tapes of the same requests and find where the client's output differs.

What a client saw is on the tape: the `OutputsEmitted` events. `diff(a, b)` gathers each
request's delivered token stream and finish reason from both tapes, aligns them by request id
and output position, and reports the first divergence (the one that appears earliest on tape
A) with the events around it in both tapes. Two tapes of the same requests may come from any
two runs: sync against async, flag against epoch, CI against a laptop.

Tapes of different requests (a request only on one side, or with another prompt) cannot be
aligned: `AlignmentError`. A tape that fails verify's consistency checks is refused before
anything is compared: `TapeInconsistentError`.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tokentape.events import schema as ev
from tokentape.events.store import MemoryTape
from tokentape.replay.render import describe_event, event_requests
from tokentape.replay.tape import Tape, load_tape
from tokentape.replay.verify import check_consistent

_BEFORE = 6  # events shown before the divergence, among those naming the request or engine-wide
_AFTER = 2

TapeSource = str | os.PathLike[str] | MemoryTape | Tape


class AlignmentError(ValueError):
    """The two tapes do not hold the same requests, so their outputs cannot be compared."""


@dataclass(slots=True)
class ClientStream:
    """What the client of one request received, and where on the tape."""

    req_id: str
    prompt_token_ids: list[int]
    added_seq: int
    token_ids: list[int] = field(default_factory=list)
    token_seqs: list[int] = field(default_factory=list)  # the OutputsEmitted of each token
    finish_reason: str | None = None
    finish_seq: int | None = None
    # Unfinished where the tape read ends because the run went on in a later segment: what
    # it received so far is a prefix of the whole stream, not all of it.
    cut_by_window: bool = False


def client_streams(
    tape: Tape, progress: Callable[[int], None] | None = None
) -> dict[str, ClientStream]:
    """Every request's delivered stream, in the order the requests were added. `progress`, if
    given, is called with the number of events read every 65536 events."""
    streams: dict[str, ClientStream] = {}
    event: ev.Event | None = None
    for seq, event in tape.events():
        if progress is not None and not seq & 0xFFFF:
            progress(seq)
        if type(event) is ev.OutputsEmitted:
            for out in event.entries:
                s = streams[out.req_id]
                s.token_ids.extend(out.token_ids)
                s.token_seqs.extend([seq] * len(out.token_ids))
                if out.finished:
                    s.finish_reason, s.finish_seq = out.finish_reason, seq
        elif type(event) is ev.RequestAdded:
            streams[event.req_id] = ClientStream(event.req_id, list(event.prompt_token_ids), seq)
        elif type(event) is ev.EngineSnapshot:  # a segment: requests added before it
            for r in event.requests:
                if r.req_id not in streams:
                    s = streams[r.req_id] = ClientStream(r.req_id, list(r.prompt_token_ids), seq)
                    s.token_ids.extend(r.output_token_ids[: r.num_emitted])
                    s.token_seqs.extend([seq] * r.num_emitted)
    if type(event) is ev.SegmentClosed:
        for s in streams.values():
            s.cut_by_window = s.finish_reason is None
    return streams


@dataclass(slots=True)
class RequestDivergence:
    req_id: str
    position: int  # output position (0 = the first generated token)
    what: str  # "token", "length" or "finish_reason"
    a_token: int | None
    b_token: int | None
    a_seq: int  # where tape A delivered that position (or where its stream ended)
    b_seq: int
    explanation: str


@dataclass(slots=True)
class TapeDiff:
    a_name: str
    b_name: str
    num_requests: int
    divergences: list[RequestDivergence]  # one per differing request, earliest on A first
    a_context: list[tuple[int, ev.Event]] = field(default_factory=list)
    b_context: list[tuple[int, ev.Event]] = field(default_factory=list)
    a_streams: dict[str, ClientStream] = field(default_factory=dict)
    b_streams: dict[str, ClientStream] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return not self.divergences

    @property
    def first(self) -> RequestDivergence | None:
        return self.divergences[0] if self.divergences else None

    def format(self) -> str:
        if self.identical:
            n = self.num_requests
            return (
                f"identical: {n} request{'' if n == 1 else 's'}, the same client-visible output "
                f"in {self.a_name} and {self.b_name}"
            )
        d = self.divergences[0]
        a, b = self.a_streams[d.req_id].token_ids, self.b_streams[d.req_id].token_ids
        lines = [
            (
                f"DIFFERENT: {len(self.divergences)} of {self.num_requests} "
                f"request{'' if self.num_requests == 1 else 's'} "
                f"differ{'s' if len(self.divergences) == 1 else ''} "
                f"between A ({self.a_name}) and B ({self.b_name})"
            ),
            f"first divergence: request {d.req_id}, output position {d.position} ({d.what})",
            f"  A: {_window(a, d.position)}",
            f"  B: {_window(b, d.position)}",
            f"  {d.explanation}",
        ]
        for label, seq, context in (("A", d.a_seq, self.a_context), ("B", d.b_seq, self.b_context)):
            lines.append(f"tape {label} around event {seq}:")
            for s, event in context:
                mark = ">" if s == seq else " "
                lines.append(f"  {mark} {s:>7}  {describe_event(event)}")
        for other in self.divergences[1:]:
            lines.append(
                f"also differs: request {other.req_id} from output position "
                f"{other.position} ({other.what})"
            )
        return "\n".join(lines)


def _window(tokens: list[int], pos: int, width: int = 4) -> str:
    start = max(0, pos - width)
    end = pos + width + 1
    shown = [f"[{t}]" if i == pos else str(t) for i, t in enumerate(tokens[start:end], start)]
    if pos >= len(tokens):
        shown.append("[end]")
    return ("... " if start else "") + " ".join(shown) + (" ..." if end < len(tokens) else "")


def _explain(a: list[int], b: list[int], p: int) -> str:
    def same(x: list[int], y: list[int]) -> bool:
        n = min(len(x), len(y))
        return n > 0 and x[:n] == y[:n]

    if p > 0 and p < len(b) and b[p] == a[p - 1] and same(b[p + 1 :], a[p:]):
        return (
            f"B repeats the token before position {p} ({b[p]}) and then goes on as A: a stale "
            "token was applied, then its position was computed again"
        )
    if p > 0 and p < len(a) and a[p] == b[p - 1] and same(a[p + 1 :], b[p:]):
        return (
            f"A repeats the token before position {p} ({a[p]}) and then goes on as B: a stale "
            "token was applied, then its position was computed again"
        )
    if same(b[p:], a[p + 1 :]):
        return (
            f"B's stream from position {p} is A's from position {p + 1}: B lost A's token {a[p]} "
            "and every later token moved up by one (a valid frame was discarded)"
        )
    if same(a[p:], b[p + 1 :]):
        return (
            f"A's stream from position {p} is B's from position {p + 1}: A lost B's token {b[p]} "
            "and every later token moved up by one (a valid frame was discarded)"
        )
    return "the streams differ from here on"


def _compare(a: ClientStream, b: ClientStream) -> RequestDivergence | None:
    ta, tb = a.token_ids, b.token_ids
    n = min(len(ta), len(tb))
    p = next((i for i in range(n) if ta[i] != tb[i]), None)

    def seq_of(s: ClientStream, pos: int) -> int:
        if pos < len(s.token_seqs):
            return s.token_seqs[pos]
        if s.finish_seq is not None:
            return s.finish_seq
        return s.token_seqs[-1] if s.token_seqs else s.added_seq

    if p is not None:
        return RequestDivergence(
            a.req_id, p, "token", ta[p], tb[p], seq_of(a, p), seq_of(b, p), _explain(ta, tb, p)
        )
    if (a.cut_by_window and len(ta) <= len(tb)) or (b.cut_by_window and len(tb) <= len(ta)):
        return None  # the shorter one is a prefix the window cut: as far as it goes, the same
    if len(ta) != len(tb):
        longer, shorter = ("A", "B") if len(ta) > len(tb) else ("B", "A")
        short = b if len(ta) > len(tb) else a
        ended = f"finished ({short.finish_reason})" if short.finish_reason else "the tape ends"
        return RequestDivergence(
            a.req_id,
            n,
            "length",
            ta[n] if n < len(ta) else None,
            tb[n] if n < len(tb) else None,
            seq_of(a, n),
            seq_of(b, n),
            f"{shorter} delivered {n} tokens and {ended}; "
            f"{longer} delivered {max(len(ta), len(tb))}",
        )
    if a.finish_reason != b.finish_reason:
        return RequestDivergence(
            a.req_id,
            n,
            "finish_reason",
            None,
            None,
            seq_of(a, n),
            seq_of(b, n),
            f"the same {n} tokens, but A finished with {a.finish_reason or 'nothing (unfinished)'} "
            f"and B with {b.finish_reason or 'nothing (unfinished)'}",
        )
    return None


def _align(
    a: dict[str, ClientStream], b: dict[str, ClientStream], a_name: str, b_name: str
) -> None:
    only_a = [r for r in a if r not in b]
    only_b = [r for r in b if r not in a]
    if only_a or only_b:
        which = (
            f"request {only_a[0]!r} is only in A ({a_name})"
            if only_a
            else f"request {only_b[0]!r} is only in B ({b_name})"
        )
        raise AlignmentError(
            f"the tapes cannot be aligned: they hold different requests ({which}; A has {len(a)} "
            f"requests, B has {len(b)})"
        )
    for req_id, sa in a.items():
        if sa.prompt_token_ids != b[req_id].prompt_token_ids:
            raise AlignmentError(
                f"the tapes cannot be aligned: request {req_id!r} has a different prompt in A "
                f"({len(sa.prompt_token_ids)} tokens) "
                f"and B ({len(b[req_id].prompt_token_ids)} tokens)"
            )


def _context(tape: Tape, req_id: str, seq: int) -> list[tuple[int, ev.Event]]:
    """The events before `seq` that name the request or the whole engine, `seq`'s event, and
    a few after it."""
    before: deque[tuple[int, ev.Event]] = deque(maxlen=_BEFORE)
    out: list[tuple[int, ev.Event]] = []
    for s, event in tape.events():
        if s < seq:
            named = event_requests(event)
            if not named or req_id in named:
                before.append((s, event))
        elif s == seq:
            out = [*before, (s, event)]
        elif s > seq + _AFTER:
            break
        else:
            out.append((s, event))
    return out


def diff(a: TapeSource, b: TapeSource, progress: Callable[[int], None] | None = None) -> TapeDiff:
    """Compare the client-visible output of two tapes of the same requests, once each passes
    verify's consistency checks (TapeInconsistentError otherwise: a tape whose events cannot
    follow each other may still hold the same outputs). `progress`, if given, is called with
    the number of events read so far: each tape is read twice, A then B, so 2 * (len(A) +
    len(B)) in all."""
    ta, tb = load_tape(a), load_tape(b)
    a_name, b_name = ta.path or "<memory tape A>", tb.path or "<memory tape B>"
    done = 0

    def passing(n_events: int) -> Callable[[int], None] | None:
        nonlocal done
        offset, done = done, done + n_events
        return None if progress is None else (lambda n: progress(offset + n))

    check_consistent(ta, passing(len(ta)))
    check_consistent(tb, passing(len(tb)))
    sa = client_streams(ta, passing(len(ta)))
    sb = client_streams(tb, passing(len(tb)))
    _align(sa, sb, a_name, b_name)
    divergences = [d for r in sa if (d := _compare(sa[r], sb[r])) is not None]
    divergences.sort(key=lambda d: (d.a_seq, d.b_seq))
    result = TapeDiff(a_name, b_name, len(sa), divergences, a_streams=sa, b_streams=sb)
    if divergences:
        first = divergences[0]
        result.a_context = _context(ta, first.req_id, first.a_seq)
        result.b_context = _context(tb, first.req_id, first.b_seq)
    return result
