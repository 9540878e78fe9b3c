"""The postmortem report's timeline picture: inline SVG drawn from
`tokentape.replay.timeline`, requests against steps, with prefill, decode, preempted and
paused spans, markers for resets, pause/resume and discarded frames, and each finding
highlighted (linked to its entry in the report). Everything taken from the tape is escaped.
"""

from __future__ import annotations

import bisect
import html
from collections.abc import Callable

from tokentape.postmortem.findings import Finding
from tokentape.replay.timeline import Marker, Span, Timeline

MAX_ROWS = 40  # requests drawn in the timeline
MAX_EVENTS = 6000  # events drawn; a longer tape is windowed around the first finding

_PHASE_COLOURS = {
    "waiting": "#c8c8c8",
    "prefill": "#6fa8dc",
    "decode": "#76b86a",
    "preempted": "#f0a040",
    "paused": "#a98bd0",
}
_ENGINE_MARKERS = {
    "reset": "#d03030",
    "pause": "#7050b0",
    "resume": "#2f8f4f",
    "weights": "#505050",
    "sleep": "#3060a0",
    "wake": "#30a0a0",
    "error": "#000000",
    "stopped": "#909090",
}

e = html.escape


class _Axis:
    """Time runs along the tape (event positions), so a pause or a preemption, which
    schedule no step, still has a width; ticks and findings are placed by step."""

    def __init__(
        self,
        timeline: Timeline,
        findings: list[Finding],
        step_seq: dict[int, int],
        left: float,
        width: float,
    ) -> None:
        first: dict[int, int] = dict(step_seq)
        starts = [(s.start_seq, s.start_step) for s in timeline.spans]
        starts += [(m.seq, m.step) for m in timeline.markers]
        for seq, step in starts:
            if seq < first.get(step, 1 << 62):
                first[step] = seq
        for f in findings:
            if f.seq is not None and f.seq < first.get(f.steps[0], 1 << 62):
                first[f.steps[0]] = f.seq
        self.steps = sorted(first)
        self.seqs = [first[s] for s in self.steps]
        total = max(timeline.num_events, 1)
        self.lo, self.hi = 0, total
        if total > MAX_EVENTS:  # a long tape: a window around the first finding
            centre = min((f.seq for f in findings if f.seq is not None), default=0)
            self.lo = max(0, centre - MAX_EVENTS // 4)
            self.hi = min(total, self.lo + MAX_EVENTS)
        self.left, self.width = left, width

    def x(self, seq: float) -> float:
        seq = min(max(seq, self.lo), self.hi)
        return self.left + (seq - self.lo) / max(self.hi - self.lo, 1) * self.width

    def seq_of_step(self, step: int) -> int:
        """The position where `step` starts (the nearest known step at or after it)."""
        i = bisect.bisect_left(self.steps, step)
        return self.seqs[i] if i < len(self.seqs) else self.hi

    def visible(self, start: int, end: int) -> bool:
        return end >= self.lo and start <= self.hi

    def ticks(self) -> list[tuple[int, int]]:
        """(step, seq) pairs to label, about a dozen, inside the window."""
        inside = [(st, sq) for st, sq in zip(self.steps, self.seqs) if self.lo <= sq <= self.hi]
        if not inside:
            return []
        every = max(1, -(-len(inside) // 12))
        return inside[::every]


def timeline_svg(
    timeline: Timeline, findings: list[Finding], watch: list[str], step_seq: dict[int, int]
) -> str:
    rows = list(watch)
    for r in timeline.requests:
        if len(rows) >= MAX_ROWS:
            break
        if r not in rows:
            rows.append(r)
    rows = rows[:MAX_ROWS]
    if not rows:
        return "<p>The tape has no requests.</p>"
    label_w, width, row_h, top = 110, 1100, 18, 28
    axis = _Axis(timeline, findings, step_seq, label_w, width - label_w - 10)
    x = axis.x
    height = top + row_h * len(rows) + 10
    index = {r: i for i, r in enumerate(rows)}

    def y(req_id: str) -> int:
        return top + index[req_id] * row_h

    out = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="requests against steps">'
    ]
    for i, r in enumerate(rows):
        out.append(
            f'<text class="label" x="{label_w - 6}" y="{top + i * row_h + 13}" '
            f'text-anchor="end">{e(_short(r))}<title>{e(r)}</title></text>'
        )
    out.append(f'<text class="tick" x="{label_w - 6}" y="{top - 8}" text-anchor="end">step</text>')
    for step, seq in axis.ticks():
        out.append(
            f'<line class="grid" x1="{x(seq):.1f}" x2="{x(seq):.1f}" '
            f'y1="{top - 4}" y2="{height - 8}"/>'
            f'<text class="tick" x="{x(seq):.1f}" y="{top - 8}" text-anchor="middle">{step}</text>'
        )
    for fi, f in enumerate(findings):  # highlight under the spans
        ys = [y(r) for r in f.request_ids if r in index] or [top]
        y0, y1 = min(ys), (max(ys) + row_h if f.request_ids else height - 10)
        x0 = x(min(axis.seq_of_step(f.steps[0]), f.seq if f.seq is not None else 1 << 62))
        x1 = x(max(axis.seq_of_step(f.steps[1] + 1), (f.seq or 0) + 1))
        out.append(
            f'<a href="#finding-{fi}"><rect class="finding-mark {e(f.severity)}" x="{x0 - 3:.1f}" '
            f'y="{y0 - 2}" width="{max(x1 - x0, 2) + 6:.1f}" height="{y1 - y0 + 4}">'
            f"<title>{e(f.kind)}: {e(f.message)}</title></rect></a>"
        )
    for span in timeline.spans:
        if span.req_id in index and axis.visible(span.start_seq, span.end_seq):
            out.append(_span(span, x, y(span.req_id), row_h))
    for m in timeline.markers:
        if axis.visible(m.seq, m.seq):
            out.append(
                _marker(m, x, y(m.req_id) if m.req_id in index else None, top, height, row_h)
            )
    out.append("</svg>")
    legend = " ".join(
        f'<span class="key" style="background:{c}"></span>{p}' for p, c in _PHASE_COLOURS.items()
    )
    legend += (
        ' <span class="key" style="background:#d03030"></span>reset'
        ' <span class="key" style="background:#7050b0"></span>pause'
        ' <span class="key" style="background:#2f8f4f"></span>resume'
        ' <b class="x">&#215;</b> discarded frame (red: fresh)'
        ' <span class="key hl"></span>finding'
    )
    note = ""
    if (axis.lo, axis.hi) != (0, max(timeline.num_events, 1)):
        note = f" Events {axis.lo} to {axis.hi} of {timeline.num_events} are drawn."
    more = len(set(timeline.requests) - set(rows))
    if more:
        note += f" {more} more requests are not drawn."
    return (
        f'<div class="timeline">{"".join(out)}</div><p class="legend">{legend}</p>'
        f'<p class="note">Time runs along the tape (event by event); ticks mark where steps are '
        f"scheduled.{e(note)}</p>"
    )


def _span(span: Span, x: Callable[[float], float], y0: int, row_h: int) -> str:
    x0, x1 = x(span.start_seq), x(span.end_seq)
    w = max(x1 - x0, 1.5)
    return (
        f'<rect class="span {span.phase}" x="{x0:.1f}" y="{y0 + 3}" '
        f'width="{w:.1f}" height="{row_h - 6}" '
        f'fill="{_PHASE_COLOURS[span.phase]}"><title>{e(span.req_id)}: {span.phase}, steps '
        f"{span.start_step}-{span.end_step}</title></rect>"
    )


def _marker(
    m: Marker, x: Callable[[float], float], y0: int | None, top: int, height: int, row_h: int
) -> str:
    xm = x(m.seq + 0.5)
    title = f"<title>{e(m.kind)} at step {m.step}{': ' + e(m.detail) if m.detail else ''}</title>"
    if m.req_id is None:
        colour = _ENGINE_MARKERS.get(m.kind, "#000")
        return (
            f'<line class="marker {m.kind}" x1="{xm:.1f}" x2="{xm:.1f}" '
            f'y1="{top - 2}" y2="{height - 8}" '
            f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="4 2">{title}</line>'
        )
    if y0 is None:
        return ""
    cy = y0 + row_h / 2
    if m.kind == "discarded":
        colour = "#e00000" if m.detail == "fresh" else "#303030"
        return (
            f'<text class="marker discarded {e(m.detail)}" x="{xm:.1f}" y="{cy + 5:.1f}" '
            f'fill="{colour}" '
            f'text-anchor="middle" font-weight="bold">&#215;{title}</text>'
        )
    if m.kind == "preempt":
        return (
            f'<path class="marker preempt" d="M{xm:.1f},{y0 + 2} l4,6 l-8,0 z" '
            f'fill="#c05000">{title}</path>'
        )
    if m.kind == "finish":
        return (
            f'<rect class="marker finish" x="{xm - 1:.1f}" y="{y0 + 2}" width="2" '
            f'height="{row_h - 4}" fill="#202020">{title}</rect>'
        )
    return ""


def _short(req_id: str) -> str:
    return req_id if len(req_id) <= 14 else req_id[:13] + "\u2026"
