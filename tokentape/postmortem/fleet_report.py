"""The fleet postmortem's report: text for the terminal and one self-contained HTML file with a
row per engine (how and where its tape ends, its finding counts, its first error) and each
engine's findings below. Everything taken from the tapes is escaped (HTML) or made safe for a
terminal (text); the page needs no network."""

from __future__ import annotations

import html
import os
from typing import TextIO

from tokentape.postmortem.findings import BUG_CLASSES, Finding
from tokentape.postmortem.fleet import EngineSummary, FleetReport, TapeResult
from tokentape.replay.render import SafeWriter

MAX_FINDINGS_SHOWN = 50  # per engine, in the HTML; the JSON has them all

e = html.escape


def _status(row: EngineSummary) -> str:
    if row.ended == "unreadable" or row.errors:
        return "error"
    return "warning" if row.warnings else "ok"


def _steps(f: Finding) -> str:
    return f"step {f.steps[0]}" if f.steps[0] == f.steps[1] else f"steps {f.steps[0]}-{f.steps[1]}"


def print_fleet_report(report: FleetReport, stream: TextIO) -> None:
    """A line per engine, then the findings of each engine that has any (no excerpts: the
    single-tape postmortem of that tape shows them)."""
    out = SafeWriter(stream)
    s = report.summary
    out.write(
        f"fleet {s.directory}: {s.tapes} tapes, {s.ok} without errors, {s.failed} with errors, "
        f"{s.unreadable} unreadable; {s.errors} error(s), {s.warnings} warning(s)\n"
    )
    ended = ", ".join(f"{k} {v}" for k, v in s.ended.items())
    out.write(f"tapes by end: {ended}\n")
    if s.counts:
        out.write("findings by kind: " + ", ".join(f"{k} {v}" for k, v in s.counts.items()) + "\n")
    width = max(len(name) for name in s.engines)
    for name, row in s.engines.items():
        counts = (
            f"{row.errors} error(s), {row.warnings} warning(s)"
            if row.errors or row.warnings
            else "no findings"
        )
        out.write(f"{name:<{width}}  {_status(row):<7}  {row.ended:<12}  {counts}; {row.where}\n")
    for result in report.tapes:
        if result.findings:
            out.write(f"\n{result.engine} ({result.tape}):\n")
            for f in result.findings:
                reqs = ", ".join(f.request_ids) or "-"
                bug = f" [{f.bug_class}]" if f.bug_class else ""
                out.write(
                    f"  [{f.severity}] {f.kind}  requests {reqs}  {_steps(f)}{bug}\n"
                    f"    {f.message}\n"
                )


def write_fleet_report(report: FleetReport, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_fleet_report(report))


def render_fleet_report(report: FleetReport) -> str:
    s = report.summary
    verdict = (
        f'<p class="verdict bad">{s.failed} of {s.tapes} tapes with errors</p>'
        if s.failed
        else f'<p class="verdict ok">{s.tapes} tapes, no errors</p>'
    )
    facts = {
        "directory": s.directory,
        "tapes": s.tapes,
        "without errors": s.ok,
        "with errors": s.failed,
        "unreadable": s.unreadable,
        "findings": f"{s.errors} error(s), {s.warnings} warning(s)",
        "tapes by end": ", ".join(f"{k} {v}" for k, v in s.ended.items()),
        "findings by kind": ", ".join(f"{k} {v}" for k, v in s.counts.items()) or "none",
    }
    table = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in facts.items())
    head = (
        "<tr><th>engine</th><th>status</th><th>ended</th><th>where</th><th>errors</th>"
        "<th>warnings</th><th>findings by kind</th><th>events</th><th>steps</th><th>requests</th>"
        "<th>policy</th><th>model</th><th>first error</th></tr>"
    )
    rows = [_row(i, name, row) for i, (name, row) in enumerate(s.engines.items())]
    details = [_details(i, r) for i, r in enumerate(report.tapes) if r.findings or r.error]
    return "\n".join(
        [
            _HEAD.replace("{title}", e(f"tokentape fleet postmortem: {s.directory}")),
            f'<h1>tokentape fleet postmortem</h1>\n{verdict}<table class="summary">{table}</table>',
            f'<h2>Engines ({s.tapes})</h2>\n<table class="engines">{head}{"".join(rows)}</table>',
            f"<h2>Findings by engine</h2>\n{''.join(details) or '<p>No findings.</p>'}",
            "</body></html>\n",
        ]
    )


def _row(i: int, name: str, row: EngineSummary) -> str:
    status = _status(row)
    counts = ", ".join(f"{k} {v}" for k, v in row.counts.items()) or "-"
    link = (
        f'<a href="#engine-{i}">{e(name)}</a>'
        if row.counts or row.ended == "unreadable"
        else e(name)
    )
    cells = [
        link,
        f'<span class="st {status}">{status}</span>',
        e(row.ended),
        e(row.where),
        str(row.errors),
        str(row.warnings),
        e(counts),
        str(row.num_events),
        str(row.num_steps),
        str(row.num_requests),
        e(row.discard_policy or "-"),
        e(row.model_id or "-"),
        e(row.first_error or "-"),
    ]
    return (
        f'<tr class="{status}" data-engine="{e(name)}" title="{e(row.tape)}">'
        + "".join(f"<td>{c}</td>" for c in cells)
        + "</tr>"
    )


def _details(i: int, r: TapeResult) -> str:
    parts = [f'<h3 id="engine-{i}">{e(r.engine)} <span class="path">{e(r.tape)}</span></h3>']
    if r.error is not None:
        parts.append(f'<div class="finding error"><p>cannot be opened: {e(r.error)}</p></div>')
    for f in r.findings[:MAX_FINDINGS_SHOWN]:
        bug = (
            f'<p class="bug">Matches {e(f.bug_class)}: {e(BUG_CLASSES.get(f.bug_class, ""))}</p>'
            if f.bug_class
            else ""
        )
        parts.append(
            f'<div class="finding {e(f.severity)}"><p><span class="sev">{e(f.severity)}</span> '
            f"<b>{e(f.kind)}</b> requests {e(', '.join(f.request_ids) or '-')}; {_steps(f)}"
            f"{'' if f.seq is None else f'; event {f.seq}'}</p><p>{e(f.message)}</p>{bug}</div>"
        )
    if len(r.findings) > MAX_FINDINGS_SHOWN:
        parts.append(
            f"<p>... and {len(r.findings) - MAX_FINDINGS_SHOWN} more (see --json, or "
            f"tokentape postmortem {e(r.tape)})</p>"
        )
    return "\n".join(parts)


_HEAD = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #202020; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.5em; } h3 { font-size: 1em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
table.summary th, table.engines th { background: #f3f3f3; }
tr.error td { background: #ffe8e8; } tr.warning td { background: #fff6dc; }
.st { font-weight: bold; } .st.error { color: #b00000; } .st.warning { color: #a06800; }
.st.ok { color: #207020; } .path { font-weight: normal; color: #666; font-size: 0.9em; }
.verdict { font-weight: bold; } .verdict.bad { color: #b00000; } .verdict.ok { color: #207020; }
.finding { border-left: 4px solid #999; padding: 0.2em 0.8em; margin: 0.5em 0; \
background: #fafafa; }
.finding.error { border-color: #c00000; } .finding.warning { border-color: #d09000; }
.sev { text-transform: uppercase; font-size: 0.8em; color: #fff; background: #c00000; \
padding: 1px 5px; }
.finding.warning .sev { background: #d09000; }
</style></head><body>"""
