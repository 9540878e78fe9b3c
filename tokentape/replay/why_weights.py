"""`tokentape why` on a tape with weight updates: the weights version that computed the token,
and, when the request's prefix came from the prefix cache computed under older weights, the
chain that led there (the pause, the update, the admission that reused the blocks) with the
reason (stale_kv.py). A tape without weight updates costs one lookup and changes nothing.

Unlike the rest of `why`, which seeks a request's own events, this folds the tape up to the
token's frame: which weights computed a block depends on every request that held it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from tokentape.events import schema as ev
from tokentape.events.sqlite_reader import SQLiteTapeReader, open_readonly
from tokentape.replay.stale_kv import StaleHit, track
from tokentape.replay.tape import Tape
from tokentape.replay.why_explain import Link, WhyResult

if TYPE_CHECKING:
    from tokentape.replay.why_trace import RequestTracer


def has_weight_updates(tape: Tape) -> bool:
    if isinstance(tape.reader, SQLiteTapeReader) and tape.path is not None:
        conn = open_readonly(tape.path)
        try:
            row = conn.execute(
                "SELECT 1 FROM events WHERE kind = 'WeightsUpdated' LIMIT 1"
            ).fetchone()
        finally:
            conn.close()
        return row is not None
    return any(type(e) is ev.WeightsUpdated for _, e in tape.events())


def add_weights(tape: Tape, tracer: RequestTracer, res: WhyResult) -> None:
    """Complete `res` (the token's producer found) with its weights and any stale prefix."""
    if res.frame_seq is None or not has_weight_updates(tape):
        return
    frame_seq = res.frame_seq
    tracker = track(tape, itertools.takewhile(lambda x: x[0] <= frame_seq, tape.events()))
    version = tracker.updates[-1].version if tracker.updates else "default"
    res.weight_version = version
    res.verdict += f" Computed under weights version {version!r}."
    hit = next(
        (h for h in reversed(tracker.hits) if h.req_id == tracer.req_id and h.epoch == res.epoch),
        None,
    )
    if hit is None:
        return
    res.chain += _links(hit)
    res.chain.sort(key=lambda x: x.seq)
    res.verdict += (
        f" Its prefix came from the prefix cache: {hit.describe()}; {hit.reason()}. So this "
        "token was computed on the old weights' keys and values for that prefix, not on what "
        f"weights {version!r} give."
    )


def _links(hit: StaleHit) -> list[Link]:
    u = hit.cause
    links = []
    if u.pause is not None:
        seq, pause = u.pause
        links.append(
            Link(
                seq,
                pause.step,
                "GenerationPaused",
                "paused",
                f"mode={pause.mode} clear_cache={pause.clear_cache}"
                + (", yet no prefix-cache reset followed" if pause.clear_cache else ""),
            )
        )
    links.append(
        Link(u.seq, u.event.step, "WeightsUpdated", "weights", f"weights -> version {u.version!r}")
    )
    blocks = ", ".join(map(str, hit.blocks[:6])) + (", ..." if len(hit.blocks) > 6 else "")
    links.append(
        Link(
            hit.seq,
            hit.event.step,
            "StepScheduled",
            "cache hit",
            f"admitted reusing blocks {blocks}, computed in step {hit.computed_step} under "
            f"weights {hit.old_version!r}",
        )
    )
    return links
