"""The postmortem as one self-contained HTML file: no network, no external scripts or styles.

It holds the summary and the findings (each with its excerpt of events), a timeline picture
(inline SVG drawn from `tokentape.replay.timeline`: requests against steps, with prefill,
decode, preempted and paused spans, markers for resets, pause/resume and discarded frames,
and each finding highlighted) and a table of each finding's requests' tokens around it.
Everything taken from the tape is escaped.
"""

from __future__ import annotations

import bisect
import html
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tokentape.events import schema as ev
from tokentape.events.state import EngineState
from tokentape.postmortem.findings import BUG_CLASSES, Finding, Report
from tokentape.postmortem.outputs import oracle_of
from tokentape.replay.tape import Tape
from tokentape.replay.timeline import Marker, Span, Timeline, timeline_from_events

MAX_ROWS = 40  # requests drawn in the timeline
MAX_EVENTS = 6000  # events drawn; a longer tape is windowed around the first finding
MAX_TABLE_REQUESTS = 6
TOKEN_CONTEXT = 4  # tokens shown before and after a finding's steps

_PHASE_COLOURS = {"waiting": "#c8c8c8", "prefill": "#6fa8dc", "decode": "#76b86a",
                  "preempted": "#f0a040", "paused": "#a98bd0"}
_ENGINE_MARKERS = {"reset": "#d03030", "pause": "#7050b0", "resume": "#2f8f4f",
                   "weights": "#505050", "error": "#000000"}

e = html.escape


@dataclass(slots=True)
class _Tokens:
    """Per watched request: the step each delivered token was applied in."""

    steps: dict[str, list[int]]
    step_seq: dict[int, int]  # step -> position of its StepScheduled


def _watched_pass(tape: Tape, watch: set[str], num_events: int,
                  progress: Callable[[int], None] | None = None) -> tuple[Timeline, EngineState, _Tokens]:
    """Build the timeline and, in the same pass, the step of every token of `watch`, over the
    first `num_events` events."""
    state = tape.initial_state()
    steps: dict[str, list[int]] = {r: [] for r in watch}
    step_seq: dict[int, int] = {}

    def events() -> Iterator[tuple[int, ev.Event]]:
        last: ev.Event | None = None
        # islice stops before asking for the event past the readable prefix.
        for item in itertools.islice(tape.events(), num_events):
            _record(last, state, steps)  # the builder has applied `last` by now
            last = item[1]
            if type(last) is ev.StepScheduled:
                step_seq[last.step] = item[0]
            yield item
        _record(last, state, steps)

    timeline = timeline_from_events(events(), state, progress)
    return timeline, state, _Tokens(steps, step_seq)


def _record(event: ev.Event | None, state: EngineState, steps: dict[str, list[int]]) -> None:
    if not isinstance(event, ev.FrameProduced):
        return
    for entry in event.entries:
        got = steps.get(entry.req_id)
        if got is not None:
            req = state.requests.get(entry.req_id)
            if req is not None and len(req.output_token_ids) > len(got):
                got.extend([event.step] * (len(req.output_token_ids) - len(got)))


def write_report(report: Report, tape: Tape, path: str | os.PathLike[str],
                 expected: dict[str, list[int]] | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
    """Render the report (one more pass over the tape, for the timeline) and write it."""
    page = render_report(report, tape, expected, progress)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def _expected_streams(tape: Tape, report: Report, watch: set[str], state: EngineState) -> dict[str, list[int]]:
    """The reference stream of each watched request, when the report had one."""
    ref = report.summary.reference
    out: dict[str, list[int]] = {}
    if ref == "oracle":
        c = tape.config
        oracle = oracle_of(tape)
        for r in watch:
            req = state.requests.get(r)
            if req is not None:
                out[r] = oracle.expected_stream(req.prompt_token_ids, req.params, c.effective_max_model_len)
    return out


def render_report(report: Report, tape: Tape, expected: dict[str, list[int]] | None = None,
                  progress: Callable[[int], None] | None = None) -> str:
    findings = report.findings
    watch: list[str] = []
    for f in findings:
        for r in f.request_ids:
            if r not in watch:
                watch.append(r)
    # The events the report analysed: on a damaged tape, those before the damage.
    timeline, state, tokens = _watched_pass(tape, set(watch), report.summary.num_events, progress)
    if expected is None:
        expected = _expected_streams(tape, report, set(watch[:MAX_TABLE_REQUESTS]), state)
    parts = [_HEAD.replace("{title}", e(f"tokentape postmortem: {report.summary.tape}"))]
    parts.append(f"<h1>tokentape postmortem</h1>\n{_summary(report)}")
    parts.append(f"<h2>Timeline</h2>\n{_timeline_svg(timeline, findings, watch, tokens.step_seq)}")
    parts.append(f"<h2>Findings ({len(findings)})</h2>\n{_findings(findings)}")
    parts.append(f"<h2>Tokens around the findings</h2>\n{_token_tables(findings, watch, state, tokens, expected)}")
    parts.append(_TAIL)
    return "\n".join(parts)


def _summary(report: Report) -> str:
    s = report.summary
    verdict = (f'<p class="verdict bad">{s.errors} error(s), {s.warnings} warning(s)</p>' if s.errors
               else f'<p class="verdict ok">no errors, {s.warnings} warning(s)</p>')
    # Findings are numbered by their place in the list (see _findings), warnings included.
    i, first = next(((i, f) for i, f in enumerate(report.findings) if f.severity == "error"), (0, None))
    cause = ""
    if first is not None:
        bug = f" ({e(BUG_CLASSES.get(first.bug_class, first.bug_class))})" if first.bug_class else ""
        cause = (f'<p class="cause">First error: <a href="#finding-{i}">{e(first.kind)}</a>: '
                 f'{e(first.message)}{bug}</p>')
    rows = {
        "tape": s.tape, "events analysed": f"{s.num_events}" + ("" if s.complete else " (stopped early)"),
        "steps": s.num_steps, "requests": s.num_requests, "discard policy": s.discard_policy,
        "model": s.model_id, "reference": s.reference or "none",
        "tokens": ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in s.tokens.items()),
        "findings by kind": ", ".join(f"{k} {v}" for k, v in s.counts.items()) or "none",
    }
    table = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in rows.items())
    return f'{verdict}{cause}<table class="summary">{table}</table>'


def _findings(findings: list[Finding]) -> str:
    if not findings:
        return "<p>No findings.</p>"
    out = []
    for i, f in enumerate(findings):
        steps = f"step {f.steps[0]}" if f.steps[0] == f.steps[1] else f"steps {f.steps[0]}-{f.steps[1]}"
        bug = (f'<p class="bug">Matches {e(f.bug_class)}: {e(BUG_CLASSES.get(f.bug_class, ""))}</p>'
               if f.bug_class else "")
        rows = "".join(
            f"<tr><td>{x.seq}</td><td>{x.step}</td><td>{e(x.kind)}</td>"
            f"<td><code>{e(json.dumps(x.data))}</code></td></tr>" for x in f.excerpt)
        excerpt = (f'<table class="excerpt"><tr><th>seq</th><th>step</th><th>event</th><th>data</th></tr>'
                   f"{rows}</table>" if rows else "")
        out.append(
            f'<div class="finding {e(f.severity)}" id="finding-{i}">'
            f'<h3><span class="sev">{e(f.severity)}</span> {e(f.kind)}</h3>'
            f"<p>requests: {e(', '.join(f.request_ids) or '-')}; {steps}</p>"
            f"<p>{e(f.message)}</p>{bug}{excerpt}</div>")
    return "\n".join(out)


class _Axis:
    """Time runs along the tape (event positions), so a pause or a preemption, which
    schedule no step, still has a width; ticks and findings are placed by step."""

    def __init__(self, timeline: Timeline, findings: list[Finding], step_seq: dict[int, int],
                 left: float, width: float) -> None:
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


def _timeline_svg(timeline: Timeline, findings: list[Finding], watch: list[str],
                  step_seq: dict[int, int]) -> str:
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

    out = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="requests against steps">']
    for i, r in enumerate(rows):
        out.append(f'<text class="label" x="{label_w - 6}" y="{top + i * row_h + 13}" '
                   f'text-anchor="end">{e(_short(r))}<title>{e(r)}</title></text>')
    out.append(f'<text class="tick" x="{label_w - 6}" y="{top - 8}" text-anchor="end">step</text>')
    for step, seq in axis.ticks():
        out.append(f'<line class="grid" x1="{x(seq):.1f}" x2="{x(seq):.1f}" y1="{top - 4}" y2="{height - 8}"/>'
                   f'<text class="tick" x="{x(seq):.1f}" y="{top - 8}" text-anchor="middle">{step}</text>')
    for fi, f in enumerate(findings):  # highlight under the spans
        ys = [y(r) for r in f.request_ids if r in index] or [top]
        y0, y1 = min(ys), (max(ys) + row_h if f.request_ids else height - 10)
        x0 = x(min(axis.seq_of_step(f.steps[0]), f.seq if f.seq is not None else 1 << 62))
        x1 = x(max(axis.seq_of_step(f.steps[1] + 1), (f.seq or 0) + 1))
        out.append(f'<a href="#finding-{fi}"><rect class="finding-mark {e(f.severity)}" x="{x0 - 3:.1f}" '
                   f'y="{y0 - 2}" width="{max(x1 - x0, 2) + 6:.1f}" height="{y1 - y0 + 4}">'
                   f'<title>{e(f.kind)}: {e(f.message)}</title></rect></a>')
    for span in timeline.spans:
        if span.req_id in index and axis.visible(span.start_seq, span.end_seq):
            out.append(_span(span, x, y(span.req_id), row_h))
    for m in timeline.markers:
        if axis.visible(m.seq, m.seq):
            out.append(_marker(m, x, y(m.req_id) if m.req_id in index else None, top, height, row_h))
    out.append("</svg>")
    legend = " ".join(f'<span class="key" style="background:{c}"></span>{p}' for p, c in _PHASE_COLOURS.items())
    legend += (' <span class="key" style="background:#d03030"></span>reset'
               ' <span class="key" style="background:#7050b0"></span>pause'
               ' <span class="key" style="background:#2f8f4f"></span>resume'
               ' <b class="x">&#215;</b> discarded frame (red: fresh)'
               ' <span class="key hl"></span>finding')
    note = ""
    if (axis.lo, axis.hi) != (0, max(timeline.num_events, 1)):
        note = f" Events {axis.lo} to {axis.hi} of {timeline.num_events} are drawn."
    more = len(set(timeline.requests) - set(rows))
    if more:
        note += f" {more} more requests are not drawn."
    return (f'<div class="timeline">{"".join(out)}</div><p class="legend">{legend}</p>'
            f'<p class="note">Time runs along the tape (event by event); ticks mark where steps are '
            f"scheduled.{e(note)}</p>")


def _span(span: Span, x: Callable[[float], float], y0: int, row_h: int) -> str:
    x0, x1 = x(span.start_seq), x(span.end_seq)
    w = max(x1 - x0, 1.5)
    return (f'<rect class="span {span.phase}" x="{x0:.1f}" y="{y0 + 3}" width="{w:.1f}" height="{row_h - 6}" '
            f'fill="{_PHASE_COLOURS[span.phase]}"><title>{e(span.req_id)}: {span.phase}, steps '
            f"{span.start_step}-{span.end_step}</title></rect>")


def _marker(m: Marker, x: Callable[[float], float], y0: int | None, top: int, height: int, row_h: int) -> str:
    xm = x(m.seq + 0.5)
    title = f"<title>{e(m.kind)} at step {m.step}{': ' + e(m.detail) if m.detail else ''}</title>"
    if m.req_id is None:
        colour = _ENGINE_MARKERS.get(m.kind, "#000")
        return (f'<line class="marker {m.kind}" x1="{xm:.1f}" x2="{xm:.1f}" y1="{top - 2}" y2="{height - 8}" '
                f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="4 2">{title}</line>')
    if y0 is None:
        return ""
    cy = y0 + row_h / 2
    if m.kind == "discarded":
        colour = "#e00000" if m.detail == "fresh" else "#303030"
        return (f'<text class="marker discarded {e(m.detail)}" x="{xm:.1f}" y="{cy + 5:.1f}" fill="{colour}" '
                f'text-anchor="middle" font-weight="bold">&#215;{title}</text>')
    if m.kind == "preempt":
        return f'<path class="marker preempt" d="M{xm:.1f},{y0 + 2} l4,6 l-8,0 z" fill="#c05000">{title}</path>'
    if m.kind == "finish":
        return f'<rect class="marker finish" x="{xm - 1:.1f}" y="{y0 + 2}" width="2" height="{row_h - 4}" fill="#202020">{title}</rect>'
    return ""


def _short(req_id: str) -> str:
    return req_id if len(req_id) <= 14 else req_id[:13] + "\u2026"


def _token_tables(findings: list[Finding], watch: list[str], state: EngineState, tokens: _Tokens,
                  expected: dict[str, list[int]]) -> str:
    if not watch:
        return "<p>No finding names a request.</p>"
    out = []
    for r in watch[:MAX_TABLE_REQUESTS]:
        req = state.requests.get(r)
        if req is None:
            continue
        ranges = [f.steps for f in findings if r in f.request_ids]
        steps = tokens.steps.get(r, [])
        out_tokens = req.output_token_ids
        near = [i for i, s in enumerate(steps) if any(a <= s <= b for a, b in ranges)]
        if near:
            first, last = near[0], near[-1]
        else:  # the finding's steps applied no token of it (a dropped frame): the next ones
            after = [i for i, s in enumerate(steps) if s >= ranges[0][0]] if ranges else []
            first = last = after[0] if after else len(out_tokens) - 1
        lo, hi = max(0, first - TOKEN_CONTEXT), min(len(out_tokens), last + TOKEN_CONTEXT + 1)
        ref = expected.get(r)
        head = "<tr><th>position</th><th>step applied</th><th>delivered</th>" + (
            "<th>expected</th>" if ref is not None else "") + "</tr>"
        rows = []
        for i in range(lo, hi):
            want = ref[i] if ref is not None and i < len(ref) else None
            bad = ref is not None and want != out_tokens[i]
            step = steps[i] if i < len(steps) else "-"
            cells = f"<td>{i}</td><td>{step}</td><td>{out_tokens[i]}</td>"
            if ref is not None:
                cells += f"<td>{'-' if want is None else want}</td>"
            rows.append(f'<tr class="{"differs" if bad else ""}">{cells}</tr>')
        if not rows:
            rows.append('<tr><td colspan="4">no delivered tokens</td></tr>')
        out.append(f"<h3>request {e(r)} ({len(out_tokens)} tokens delivered, "
                   f"{e(req.finish_reason or 'unfinished')})</h3>"
                   f'<table class="tokens">{head}{"".join(rows)}</table>')
    return "\n".join(out)


_HEAD = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #202020; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.5em; } h3 { font-size: 1em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
table.summary th { background: #f3f3f3; }
code { font-size: 0.85em; word-break: break-all; }
.verdict { font-weight: bold; } .verdict.bad { color: #b00000; } .verdict.ok { color: #207020; }
.finding { border-left: 4px solid #999; padding: 0.2em 0.8em; margin: 0.8em 0; background: #fafafa; }
.finding.error { border-color: #c00000; } .finding.warning { border-color: #d09000; }
.sev { text-transform: uppercase; font-size: 0.8em; color: #fff; background: #c00000; padding: 1px 5px; }
.finding.warning .sev { background: #d09000; }
.timeline { overflow-x: auto; border: 1px solid #ddd; }
svg text { font-size: 11px; font-family: system-ui, sans-serif; }
.grid { stroke: #eee; } .tick { fill: #777; }
.finding-mark.error { fill: rgba(220, 0, 0, 0.18); stroke: #d00000; stroke-width: 1.5; }
.finding-mark.warning { fill: rgba(220, 160, 0, 0.2); stroke: #d09000; stroke-width: 1.5; }
.key { display: inline-block; width: 12px; height: 12px; margin: 0 3px 0 10px; vertical-align: middle; }
.key.hl { background: rgba(220, 0, 0, 0.18); border: 1px solid #d00000; }
.x { color: #e00000; margin-left: 10px; }
tr.differs td { background: #ffe0e0; }
</style></head><body>"""

# Records, for tests and tools, whether the browser laid the timeline out.
_TAIL = """<script>
(function () {
  var svg = document.getElementById("timeline");
  var box = svg ? svg.getBBox() : null;
  var spans = svg ? svg.querySelectorAll("rect.span").length : 0;
  document.documentElement.setAttribute("data-timeline",
    box && box.width > 0 && box.height > 0 ? "drawn " + spans + " spans" : "missing");
})();
</script>
</body></html>
"""
