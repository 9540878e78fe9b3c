"""The postmortem as one self-contained HTML file: no network, no external scripts or styles.

It holds the summary and the findings (each with its excerpt of events), a timeline picture
(inline SVG, drawn in report_timeline.py) and a table of each finding's requests' tokens
around it. Everything taken from the tape is escaped.
"""

from __future__ import annotations

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
from tokentape.postmortem.report_timeline import timeline_svg
from tokentape.replay.tape import Tape
from tokentape.replay.timeline import Timeline, timeline_from_events

MAX_TABLE_REQUESTS = 6
TOKEN_CONTEXT = 4  # tokens shown before and after a finding's steps

e = html.escape


@dataclass(slots=True)
class _Tokens:
    """Per watched request: the step each delivered token was applied in."""

    steps: dict[str, list[int]]
    step_seq: dict[int, int]  # step -> position of its StepScheduled


def _watched_pass(
    tape: Tape, watch: set[str], num_events: int, progress: Callable[[int], None] | None = None
) -> tuple[Timeline, EngineState, _Tokens]:
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


def write_report(
    report: Report,
    tape: Tape,
    path: str | os.PathLike[str],
    expected: dict[str, list[int]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Render the report (one more pass over the tape, for the timeline) and write it."""
    page = render_report(report, tape, expected, progress)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def _expected_streams(
    tape: Tape, report: Report, watch: set[str], state: EngineState
) -> dict[str, list[int]]:
    """The reference stream of each watched request, when the report had one."""
    ref = report.summary.reference
    out: dict[str, list[int]] = {}
    if ref == "oracle":
        c = tape.config
        oracle = oracle_of(tape)
        for r in watch:
            req = state.requests.get(r)
            if req is not None:
                out[r] = oracle.expected_stream(
                    req.prompt_token_ids, req.params, c.effective_max_model_len
                )
    return out


def render_report(
    report: Report,
    tape: Tape,
    expected: dict[str, list[int]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> str:
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
    parts.append(f"<h2>Timeline</h2>\n{timeline_svg(timeline, findings, watch, tokens.step_seq)}")
    parts.append(f"<h2>Findings ({len(findings)})</h2>\n{_findings(findings)}")
    parts.append(
        "<h2>Tokens around the findings</h2>\n"
        f"{_token_tables(findings, watch, state, tokens, expected)}"
    )
    parts.append(_TAIL)
    return "\n".join(parts)


def _summary(report: Report) -> str:
    s = report.summary
    verdict = (
        f'<p class="verdict bad">{s.errors} error(s), {s.warnings} warning(s)</p>'
        if s.errors
        else f'<p class="verdict ok">no errors, {s.warnings} warning(s)</p>'
    )
    # Findings are numbered by their place in the list (see _findings), warnings included.
    i, first = next(
        ((i, f) for i, f in enumerate(report.findings) if f.severity == "error"), (0, None)
    )
    cause = ""
    if first is not None:
        bug = (
            f" ({e(BUG_CLASSES.get(first.bug_class, first.bug_class))})" if first.bug_class else ""
        )
        cause = (
            f'<p class="cause">First error: <a href="#finding-{i}">{e(first.kind)}</a>: '
            f"{e(first.message)}{bug}</p>"
        )
    rows = {
        "tape": s.tape,
        "events analysed": f"{s.num_events}" + ("" if s.read_to_end else " (stopped early)"),
        "steps": s.num_steps,
        "requests": s.num_requests,
        "discard policy": s.discard_policy,
        "model": s.model_id,
        "reference": s.reference or "none",
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
        steps = (
            f"step {f.steps[0]}" if f.steps[0] == f.steps[1] else f"steps {f.steps[0]}-{f.steps[1]}"
        )
        bug = (
            f'<p class="bug">Matches {e(f.bug_class)}: {e(BUG_CLASSES.get(f.bug_class, ""))}</p>'
            if f.bug_class
            else ""
        )
        rows = "".join(
            f"<tr><td>{x.seq}</td><td>{x.step}</td><td>{e(x.kind)}</td>"
            f"<td><code>{e(json.dumps(x.data))}</code></td></tr>"
            for x in f.excerpt
        )
        excerpt = (
            f'<table class="excerpt"><tr><th>seq</th><th>step</th><th>event</th><th>data</th></tr>'
            f"{rows}</table>"
            if rows
            else ""
        )
        out.append(
            f'<div class="finding {e(f.severity)}" id="finding-{i}">'
            f'<h3><span class="sev">{e(f.severity)}</span> {e(f.kind)}</h3>'
            f"<p>requests: {e(', '.join(f.request_ids) or '-')}; {steps}</p>"
            f"<p>{e(f.message)}</p>{bug}{excerpt}</div>"
        )
    return "\n".join(out)


def _token_tables(
    findings: list[Finding],
    watch: list[str],
    state: EngineState,
    tokens: _Tokens,
    expected: dict[str, list[int]],
) -> str:
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
        head = (
            "<tr><th>position</th><th>step applied</th><th>delivered</th>"
            + ("<th>expected</th>" if ref is not None else "")
            + "</tr>"
        )
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
        out.append(
            f"<h3>request {e(r)} ({len(out_tokens)} tokens delivered, "
            f"{e(req.finish_reason or 'unfinished')})</h3>"
            f'<table class="tokens">{head}{"".join(rows)}</table>'
        )
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
.finding { border-left: 4px solid #999; padding: 0.2em 0.8em; margin: 0.8em 0; \
background: #fafafa; }
.finding.error { border-color: #c00000; } .finding.warning { border-color: #d09000; }
.sev { text-transform: uppercase; font-size: 0.8em; color: #fff; background: #c00000; \
padding: 1px 5px; }
.finding.warning .sev { background: #d09000; }
.timeline { overflow-x: auto; border: 1px solid #ddd; }
svg text { font-size: 11px; font-family: system-ui, sans-serif; }
.grid { stroke: #eee; } .tick { fill: #777; }
.finding-mark.error { fill: rgba(220, 0, 0, 0.18); stroke: #d00000; stroke-width: 1.5; }
.finding-mark.warning { fill: rgba(220, 160, 0, 0.2); stroke: #d09000; stroke-width: 1.5; }
.key { display: inline-block; width: 12px; height: 12px; margin: 0 3px 0 10px; \
vertical-align: middle; }
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
