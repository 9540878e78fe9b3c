"""Prompt logprobs in the model runner (vLLM's `SamplingParams.prompt_logprobs`).

A request that asks for them is prefilled from position 0 (the scheduler gives it no
prefix-cache hits: a cached block has no logits). Each prefill chunk scores the prompt
positions it computes, the logits of position p giving the logprob of prompt token p + 1, and
the rows are kept here until the chunk that finishes the prompt: its frame carries the whole
prompt's `PromptLogprobs`, as vLLM's runner returns them once the prefill is complete
(`_get_prompt_logprobs_dict`). A request that leaves the batch (finished, preempted) forgets
its rows; if it comes back without them on the tape, the scheduler asks again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokentape.engine.model.logits_processors import top_logprobs
from tokentape.engine.runners.base import NewRequest
from tokentape.engine.runners.input_batch import EntryInputs
from tokentape.events.schema import PromptLogprobs

# Logits rows computed at a time: a long prompt's [positions, vocab] logits never exist whole
# (8,192 positions of a 151,936-token vocabulary would be 5 GB of float32).
ROWS_PER_PASS = 256

ScoredRows = tuple[list[float], list[list[int]], list[list[float]]]


@dataclass(slots=True)
class _Progress:
    """One request's prompt logprobs so far (positions 1 .. len(scored))."""

    prompt: list[int]
    k: int
    token_logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


class PromptLogprobsTracker:
    """The runner's prompt logprobs in progress, by request id."""

    __slots__ = ("_reqs",)

    def __init__(self) -> None:
        self._reqs: dict[str, _Progress] = {}

    def enter(self, req_id: str, new: NewRequest) -> None:
        """A request (re)enters the batch from position 0: score its prompt if asked."""
        k = new.params.prompt_logprobs
        if new.prompt_logprobs and k is not None:
            self._reqs[req_id] = _Progress(new.prompt_token_ids, k)
        else:
            self._reqs.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def clear(self) -> None:
        self._reqs.clear()

    def targets(self, req_id: str, start: int, num_inputs: int) -> list[int]:
        """The prompt tokens an entry computing positions start .. start + num_inputs - 1
        scores: token p + 1 for each of its positions p before the prompt's last."""
        progress = self._reqs.get(req_id)
        if progress is None:
            return []
        if start != len(progress.token_logprobs):  # chunks come in order, from position 0
            raise RuntimeError(
                f"request {req_id!r}: a prefill chunk from position {start}, but its prompt "
                f"logprobs reach position {len(progress.token_logprobs)}"
            )
        end = min(start + num_inputs, len(progress.prompt) - 1)
        return progress.prompt[start + 1 : end + 1]

    def add(self, req_id: str, rows: ScoredRows) -> None:
        progress = self._reqs[req_id]
        lps, ids, tops = rows
        progress.token_logprobs += lps
        if progress.k:
            progress.top_token_ids += ids
            progress.top_logprobs += tops

    def take(self, req_id: str) -> PromptLogprobs | None:
        """The whole prompt's logprobs once every position is scored (for the frame of the
        chunk that finished the prompt), and forget them; else None."""
        progress = self._reqs.get(req_id)
        if progress is None or len(progress.token_logprobs) < len(progress.prompt) - 1:
            return None
        del self._reqs[req_id]
        return PromptLogprobs(
            progress.token_logprobs, progress.top_token_ids, progress.top_logprobs
        )


def score_prompts(
    entries: list[EntryInputs],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[tuple[str, ScoredRows]]:
    """The prompt rows of a forward pass's entries (those with prompt targets): per entry,
    each target's raw log-softmax and, with prompt_logprobs = k > 0, the k most likely ids."""
    scored = []
    row = 0  # the hidden row of each entry's first input
    for e in entries:
        targets = e.prompt_targets
        if targets:
            k = e.seq.params.prompt_logprobs or 0
            scored.append(
                (e.req_id, score_rows(hidden[row : row + len(targets)], targets, k, compute_logits))
            )
        row += len(e.inputs)
    return scored


def score_rows(
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> ScoredRows:
    """Logprobs of `targets` under the logits of `hidden`'s rows, ROWS_PER_PASS at a time."""
    lps: list[float] = []
    ids: list[list[int]] = []
    tops: list[list[float]] = []
    for i in range(0, len(targets), ROWS_PER_PASS):
        logprobs = compute_logits(hidden[i : i + ROWS_PER_PASS]).float().log_softmax(dim=-1)
        chosen = torch.tensor(targets[i : i + ROWS_PER_PASS], device=logprobs.device)
        lps += logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        if k:
            for top_ids, top_lps in top_logprobs(logprobs, [k] * logprobs.shape[0]):
                ids.append(top_ids)
                tops.append(top_lps)
    return lps, ids, tops
