"""export: a tape as Perfetto (Chrome trace-event JSON), JSON lines, CSV, or a single file.

- `perfetto`: the trace-event format's JSON object form, which the Perfetto UI
  (ui.perfetto.dev) and chrome://tracing open. One process for the tape, one track (thread)
  per request with its phases as complete slices (`ph: "X"`: waiting, prefill, decode,
  preempted, paused, from `tokentape.replay.timeline`) and its preemptions, discarded frames
  and finish as instants (`ph: "i"`), and an `engine` track with the prefix-cache resets,
  pauses, resumes, weight updates and errors. The clock is the tape position: one event is
  one microsecond (`ts` = sequence number), so every step's events line up across tracks.
- `jsonl`: one event per line, `{"seq": ..., "kind": ..., <fields>}`, for jq.
- `csv`: one row per engine step: what was scheduled, what came back, what the client got,
  and the queues at the end of the step (the state `Tape.at(step)` gives).
- `sqlite`: a copy of the tape itself as one self-contained file, taken as one consistent
  snapshot even while the tape is written (`export_sqlite`, through
  `tokentape.events.sqlite_store.copy_tape`). It writes a file, not a text stream.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
from collections.abc import Callable
from typing import Any, TextIO

import msgspec

from tokentape.events import schema as ev
from tokentape.events.reducer import evolve
from tokentape.events.sqlite_reader import SQLiteTapeReader
from tokentape.events.sqlite_store import copy_tape, write_tape
from tokentape.replay.tape import Tape
from tokentape.replay.timeline import Timeline, build_timeline

TEXT_FORMATS = ("perfetto", "jsonl", "csv")
FORMATS = (*TEXT_FORMATS, "sqlite")
_PID = 1
_ENGINE_TID = 0


def to_builtin(value: Any) -> Any:
    """An event (or part of one) as JSON-ready dicts and lists, with field names."""
    if isinstance(value, msgspec.Struct):
        return {name: to_builtin(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, (list, tuple)):
        return [to_builtin(v) for v in value]
    if isinstance(value, bytes):  # a snapshot's block hashes and undecoded text, as hex
        return value.hex()
    return value


# -- perfetto -------------------------------------------------------------------------------


def perfetto_trace(tape: Tape, timeline: Timeline | None = None) -> dict[str, Any]:
    """The Chrome trace-event JSON object for a tape (a dict ready for json.dump)."""
    tl = timeline if timeline is not None else build_timeline(tape)
    tids = {req_id: i + 1 for i, req_id in enumerate(tl.requests)}
    name = tape.path or "memory tape"
    meta: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": _PID,
            "tid": _ENGINE_TID,
            "ts": 0,
            "args": {"name": f"tokentape {name} ({tape.header.discard_policy})"},
        },
        {
            "name": "thread_name",
            "ph": "M",
            "pid": _PID,
            "tid": _ENGINE_TID,
            "ts": 0,
            "args": {"name": "engine"},
        },
        {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": _PID,
            "tid": _ENGINE_TID,
            "ts": 0,
            "args": {"sort_index": 0},
        },
    ]
    for req_id, tid in tids.items():
        meta.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": _PID,
                "tid": tid,
                "ts": 0,
                "args": {"name": f"request {req_id}"},
            }
        )
        meta.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": _PID,
                "tid": tid,
                "ts": 0,
                "args": {"sort_index": tid},
            }
        )
    items: list[dict[str, Any]] = []
    for span in tl.spans:
        items.append(
            {
                "name": span.phase,
                "cat": "request",
                "ph": "X",
                "pid": _PID,
                "tid": tids[span.req_id],
                "ts": span.start_seq,
                "dur": span.end_seq - span.start_seq,
                "args": {
                    "req_id": span.req_id,
                    "first_step": span.start_step,
                    "last_step": span.end_step,
                    "first_event": span.start_seq,
                    "end_event": span.end_seq,
                    "open": span.open,
                },
            }
        )
    for marker in tl.markers:
        engine_wide = marker.req_id is None
        items.append(
            {
                "name": marker.kind
                + (f" ({marker.detail})" if marker.detail and not engine_wide else ""),
                "cat": "engine" if engine_wide else "request",
                "ph": "i",
                "s": "g" if engine_wide else "t",
                "pid": _PID,
                "tid": _ENGINE_TID if marker.req_id is None else tids[marker.req_id],
                "ts": marker.seq,
                "args": {"step": marker.step, "event": marker.seq, "detail": marker.detail},
            }
        )
    # Each track's timestamps never go backwards: sort by time, slices before the instants
    # at the same time, longer slices first (a parent before what it contains).
    items.sort(key=lambda e: (e["ts"], e["ph"] != "X", -e.get("dur", 0)))
    return {
        "traceEvents": meta + items,
        "otherData": {
            "tape": name,
            "clock": "1 us = 1 tape event",
            "events": tl.num_events,
            "steps": tl.num_steps,
            "discard_policy": tl.discard_policy,
            "model": tape.header.model_id,
            "version": tape.header.package_version,
        },
    }


def write_perfetto(tape: Tape, out: TextIO, progress: Callable[[int], None] | None = None) -> None:
    json.dump(perfetto_trace(tape, build_timeline(tape, progress)), out)
    out.write("\n")


# -- jsonl ----------------------------------------------------------------------------------


def write_jsonl(tape: Tape, out: TextIO, progress: Callable[[int], None] | None = None) -> None:
    encode = json.dumps
    for seq, event in tape.events():
        record = {"seq": seq, "kind": ev.kind_of(event), **to_builtin(event)}
        out.write(encode(record) + "\n")
        if progress is not None and not (seq + 1) & 0xFFFF:
            progress(seq + 1)


# -- csv ------------------------------------------------------------------------------------

CSV_COLUMNS = (
    "step",
    "seq",
    "scheduled_requests",
    "scheduled_tokens",
    "spec_tokens",
    "prefill_entries",
    "frames",
    "tokens_delivered",
    "frames_dropped",
    "preemptions",
    "finished",
    "aborted",
    "added",
    "waiting",
    "running",
    "steps_in_flight",
    "paused",
    "prefix_cache_resets",
)


def write_csv(tape: Tape, out: TextIO, progress: Callable[[int], None] | None = None) -> None:
    """One row per step: its StepScheduled and every event up to the next one (the adds
    before the first step count in step 0's row); the queues as they are at the row's end."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    state = tape.initial_state()
    row: dict[str, Any] | None = None
    carried_adds = 0

    def flush() -> None:
        assert row is not None
        row.update(
            waiting=len(state.waiting),
            running=len(state.running),
            steps_in_flight=len(state.in_flight_steps),
            paused=state.paused or "",
            prefix_cache_resets=state.num_prefix_cache_resets,
        )
        writer.writerow([row[c] for c in CSV_COLUMNS])

    for seq, event in tape.events():
        if type(event) is ev.StepScheduled:
            if row is not None:
                flush()
            row = dict.fromkeys(CSV_COLUMNS, 0)
            row.update(
                step=event.step,
                seq=seq,
                added=carried_adds,
                scheduled_requests=len(event.entries),
                scheduled_tokens=sum(e.num_new_tokens for e in event.entries),
                spec_tokens=sum(e.num_spec_tokens for e in event.entries),
            )
            carried_adds = 0
            evolve(state, event)
            requests = state.requests
            row["prefill_entries"] = sum(
                1
                for e in event.entries
                if e.num_computed_before < requests[e.req_id].num_prompt_tokens
            )
            continue
        dropped_before = 0
        if type(event) is ev.FrameProduced:
            # An unknown request is left to evolve, which refuses the frame with a clear error.
            dropped_before = sum(
                r.num_frames_dropped
                for e in event.entries
                if (r := state.requests.get(e.req_id)) is not None
            )
        evolve(state, event)
        if row is None:  # before the first step: only commands
            carried_adds += type(event) is ev.RequestAdded
            continue
        match event:
            case ev.FrameProduced(entries=entries):
                row["frames"] += 1
                row["frames_dropped"] += (
                    sum(state.requests[e.req_id].num_frames_dropped for e in entries)
                    - dropped_before
                )
            case ev.OutputsEmitted(entries=entries):
                row["tokens_delivered"] += sum(len(e.token_ids) for e in entries)
            case ev.RequestPreempted():
                row["preemptions"] += 1
            case ev.RequestFinished():
                row["finished"] += 1
            case ev.RequestAborted():
                row["aborted"] += 1
            case ev.RequestAdded():
                row["added"] += 1
        if progress is not None and not (seq + 1) & 0xFFFF:
            progress(seq + 1)
    if row is not None:
        flush()


WRITERS: dict[str, Callable[[Tape, TextIO, Callable[[int], None] | None], None]] = {
    "perfetto": write_perfetto,
    "jsonl": write_jsonl,
    "csv": write_csv,
}


def export(
    tape: Tape, fmt: str, out: TextIO, progress: Callable[[int], None] | None = None
) -> None:
    """Write the tape in `fmt` (perfetto, jsonl or csv) to `out`."""
    if fmt == "sqlite":
        raise ValueError(
            "the sqlite export writes a file, not a stream: use export_sqlite(tape, path)"
        )
    try:
        writer = WRITERS[fmt]
    except KeyError:
        raise ValueError(
            f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}"
        ) from None
    writer(tape, out, progress)


def export_sqlite(tape: str | os.PathLike[str] | Tape, path: str | os.PathLike[str]) -> int:
    """Copy the tape file `tape` into a new single-file tape at `path` (never overwritten),
    consistent even while `tape` is being written. Returns the number of events copied.
    A loaded Tape that is not one file (a segmented tape's directory, or a window of it; a
    memory tape) is written event by event: its events as the Tape sees them."""
    if not isinstance(tape, Tape):
        return copy_tape(tape, path)
    if isinstance(tape.reader, SQLiteTapeReader):
        return copy_tape(tape.path, path)
    events = itertools.islice(tape.events(), len(tape))  # as long as when it was opened
    return write_tape(path, tape.header, (event for _, event in events))
