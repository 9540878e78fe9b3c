"""The postmortem's report as text, for a terminal or a file: `tokentape postmortem` prints it,
the chaos campaign and the pytest keeper write it beside their tapes."""

from __future__ import annotations

import json
from typing import TextIO

from tokentape.postmortem.findings import BUG_CLASSES, Report
from tokentape.replay.render import SafeWriter, plural


def print_report(report: Report, stream: TextIO) -> None:
    """The report as text (everything from the tape made safe for a terminal)."""
    out = SafeWriter(stream)
    s = report.summary
    # Read to its end, which may not be the run's (still written, or cut): "ends mid-run".
    state = "complete" if s.complete else "ends mid-run" if s.read_to_end else "stopped early"
    out.write(
        f"{s.tape}: {plural(s.num_events, 'event')} ({state}), {plural(s.num_steps, 'step')}, "
        f"{plural(s.num_requests, 'request')}, policy {s.discard_policy}, model {s.model_id}, "
        f"reference {s.reference or 'none'}\n"
    )
    if s.segments:
        ended = s.ended or "not recorded (the server still runs, or its machine stopped)"
        out.write(
            f"segments: {plural(len(s.segments), 'segment')} ({s.segments[0]} to "
            f"{s.segments[-1]}); the run ended: {ended}\n"
        )
    t = s.tokens
    out.write(
        f"tokens: {t['produced']} produced, {t['applied']} applied, {t['dropped_stale']} "
        f"dropped stale, {t['dropped_fresh']} dropped fresh, {t['after_stop']} after a stop, "
        f"{t['lost']} lost\n"
    )
    if not report.findings:
        out.write("no findings\n")
        return
    out.write(f"{plural(s.errors, 'error')}, {plural(s.warnings, 'warning')}\n")
    for f in report.findings:
        reqs = ("request " if len(f.request_ids) == 1 else "requests ") + (
            ", ".join(f.request_ids) or "-"
        )
        steps = (
            f"step {f.steps[0]}" if f.steps[0] == f.steps[1] else f"steps {f.steps[0]}-{f.steps[1]}"
        )
        out.write(f"\n[{f.severity}] {f.kind}  {reqs}  {steps}\n  {f.message}\n")
        if f.bug_class:  # the description names the upstream issue (the JSON has the key)
            out.write(f"  matches {BUG_CLASSES.get(f.bug_class, f.bug_class)}\n")
        for x in f.excerpt:
            out.write(f"    {x.seq:>8}  step {x.step:<6} {x.kind} {json.dumps(x.data)}\n")
