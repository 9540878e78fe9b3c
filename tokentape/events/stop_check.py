"""The stop rule on token ids, as vLLM's `check_stop`: after a frame, the first new output
token that is a stop token (once the output has min_tokens tokens) or that fills the output
to its limit (max_tokens, capped by max_model_len) finishes the request there.

The scheduler applies it after each frame (`Scheduler.update_from_output`) and records what
it decides as RequestFinished, with the output's length at the finish. The reducer applies
that event; it uses the rule itself only to read a tape that does not record the length
(before format 6, or another engine's recording). Compiled (events/_compiled.py): it runs
for every request of every frame.
"""

from __future__ import annotations

from typing import NamedTuple

from tokentape.events.schema import FinishReason
from tokentape.events.state import RequestState


class StopDecision(NamedTuple):
    reason: FinishReason
    stop_reason: int | None  # vLLM's: the stop token id; None for EOS and for a length finish
    num_output_tokens: int  # the output's length at the finish: tokens after it are cut


def check_stop(req: RequestState, start: int, eos_token_id: int | None) -> StopDecision | None:
    """Where the output tokens from `start` on first meet a stop condition, or None.

    Stop tokens are checked before the length, as vLLM does: a stop token that is also the
    last token allowed finishes with "stop"."""
    output = req.output_token_ids
    stop_ids, limit = req.stop_ids, req.max_output_tokens
    min_tokens = req.params.min_tokens
    for i in range(start, len(output)):
        n = i + 1
        token = output[i]
        if token in stop_ids and n >= min_tokens:
            eos = token == eos_token_id and not req.params.ignore_eos
            return StopDecision("stop", None if eos else token, n)
        if n >= limit:
            return StopDecision("length", None, n)
    return None
