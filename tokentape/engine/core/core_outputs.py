"""What a step delivers: the new tokens (and finishes) of every request the reducer marked
pending since the last delivery, as the tape records them (`OutputsEmitted`'s entries) and as
an output processor takes them (`EngineCoreOutput`). A pure read of the state, compiled
(events/_compiled.py): it runs once per request per step."""

from __future__ import annotations

from tokentape.engine.outputs import EngineCoreOutput
from tokentape.events import schema as ev
from tokentape.events.state import EngineState


def pending_outputs(state: EngineState) -> tuple[list[ev.EmittedOutput], list[EngineCoreOutput]]:
    """The tape's entries and the core's deltas for `state.pending_output`, in its order."""
    entries: list[ev.EmittedOutput] = []
    deltas: list[EngineCoreOutput] = []
    requests = state.requests
    weight_version = state.weight_version  # weights change only when drained: one per step
    for req_id in state.pending_output:
        req = requests[req_id]
        sent = req.num_emitted
        new_tokens = req.output_token_ids[sent:]
        reason = req.finish_reason
        entries.append(ev.EmittedOutput(req_id, new_tokens, reason is not None, reason))
        logprobs = req.params.logprobs
        deltas.append(
            EngineCoreOutput(
                req_id,
                new_tokens,
                req.output_logprobs[sent:] if logprobs is not None else None,
                reason,
                None,
                req.stop_reason if reason is not None else None,
                req.output_top_logprobs[sent:] if logprobs else None,
                req.prompt_logprobs if not sent else None,  # with the first tokens
                weight_version,
            )
        )
    return entries, deltas
