"""vLLM's logits processors that change greedy sampling, applied per row in vLLM's order:
bad words, min_tokens, then the repetition, frequency and presence penalties.

Each row's adjustment is a pure function of its own logits and its own tokens (the prompt and
the output before the row's position), so it gives the same bits whatever else is in the
batch, and a position recomputed after a preemption is adjusted the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokentape.events.schema import SamplingParams


@dataclass(slots=True)
class RowContext:
    """What a sample row's processors read: its params, the request's stop ids (EOS included
    unless ignore_eos), and the tokens before the row's position."""

    params: SamplingParams
    stop_ids: tuple[int, ...]
    tokens: Sequence[int]  # prompt followed by output, up to the sampled position
    num_prompt: int


def needs_processing(params: SamplingParams) -> bool:
    return bool(params.bad_words or params.min_tokens or params.has_penalties)


def banned_bad_words(bad_words: Sequence[Sequence[int]], tokens: Sequence[int]) -> set[int]:
    """vLLM's bad words: a word's last token is banned when the tokens before the position
    end with the word's other tokens (a one-token word is always banned)."""
    banned = set()
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(tokens):
            continue
        if prefix == 0 or list(tokens[len(tokens) - prefix:]) == list(word[:prefix]):
            banned.add(word[-1])
    return banned


def apply_penalties_row(logits: torch.Tensor, ctx: RowContext) -> None:
    """In place on one float32 row [V], with vLLM's arithmetic: the repetition penalty scales
    every token of the prompt or the output (a positive logit times 1/penalty, another times
    the penalty), then frequency (times the count in the output) and presence (once per
    token in the output) are subtracted."""
    p = ctx.params
    vocab, device = logits.shape[0], logits.device
    output = torch.tensor(list(ctx.tokens[ctx.num_prompt:]), dtype=torch.int64)
    counts = torch.zeros(vocab, dtype=torch.int64).index_add_(
        0, output, torch.ones_like(output)).to(device)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(ctx.tokens[:ctx.num_prompt]), dtype=torch.int64)] = True
        seen = seen.to(device) | (counts > 0)
        penalty = torch.tensor(p.repetition_penalty, dtype=torch.float32, device=device)
        penalties = torch.where(seen, penalty, torch.ones((), dtype=torch.float32, device=device))
        logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
    if p.frequency_penalty != 0.0:
        logits -= torch.tensor(p.frequency_penalty, dtype=torch.float32, device=device) * counts
    if p.presence_penalty != 0.0:
        logits -= torch.tensor(p.presence_penalty, dtype=torch.float32, device=device) * (counts > 0)


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[RowContext | None]) -> torch.Tensor:
    """The logits [S, V] (float32) with each row's processors applied; a row of None (or one
    whose params ask for none) is left as it is. Returns a new tensor when any row changes."""
    todo = [(i, ctx) for i, ctx in enumerate(rows) if ctx is not None and needs_processing(ctx.params)]
    if not todo:
        return logits
    logits = logits.clone()
    for i, ctx in todo:
        row = logits[i]
        p = ctx.params
        banned = banned_bad_words(p.bad_words, ctx.tokens) if p.bad_words else set()
        if len(ctx.tokens) - ctx.num_prompt < p.min_tokens:
            banned.update(ctx.stop_ids)  # no stop before min_tokens (vLLM's MinTokensLogitsProcessor)
        banned = {t for t in banned if t < row.shape[0]}
        if banned:
            row[torch.tensor(sorted(banned), dtype=torch.int64, device=row.device)] = float("-inf")
        if p.has_penalties:
            apply_penalties_row(row, ctx)
    return logits


def top_logprobs(raw_logprobs: torch.Tensor, ks: Sequence[int]) -> list[tuple[list[int], list[float]]]:
    """Per row, the k most likely token ids and their logprobs, best first (ties: lower id
    first); k = 0 gives empty lists."""
    kmax = max(ks, default=0)
    if kmax <= 0:
        return [([], []) for _ in ks]
    # A stable descending sort: equal logprobs keep the lower id first, on any device.
    values, ids = raw_logprobs.sort(dim=-1, descending=True, stable=True)
    values, ids = values[:, :kmax].tolist(), ids[:, :kmax].tolist()
    return [(ids[i][:k], values[i][:k]) for i, k in enumerate(ks)]
