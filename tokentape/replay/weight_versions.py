"""Which weights computed each delivered token, recomputed from a tape alone (offline, as
`CompletionOutput.weight_versions` said live): every token an `OutputsEmitted` delivers was
computed under the weight version in force when it is recorded, since the reducer refuses a
weight change with steps in flight or output undelivered (docs/tape-format.md)."""

from __future__ import annotations

import os

from tokentape.events import schema as ev
from tokentape.events.reducer import evolve
from tokentape.events.store import MemoryTape
from tokentape.replay.tape import Tape, load_tape


def delivered_weight_versions(
    source: str | os.PathLike[str] | MemoryTape | Tape,
) -> dict[str, list[str]]:
    """Per engine request, one weight version per token delivered to it, in order."""
    tape = load_tape(source)
    state = tape.initial_state()
    versions: dict[str, list[str]] = {}
    for _, event in tape.events():
        if type(event) is ev.OutputsEmitted:
            for entry in event.entries:
                versions.setdefault(entry.req_id, []).extend(
                    [state.weight_version] * len(entry.token_ids)
                )
        evolve(state, event)
    return versions
