"""vLLM's logits processors that change greedy sampling, in vLLM's order: bad words,
min_tokens and logit_bias, then the repetition, frequency and presence penalties (batched
torch ops).

Each row's adjustment is a pure function of its own logits and its own tokens (the prompt and
the output before the row's position), so it gives the same bits whatever else is in the
batch, and a position recomputed after a preemption is adjusted the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

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
    return bool(params.bad_words or params.min_tokens or params.logit_bias or params.has_penalties)


def banned_bad_words(bad_words: Sequence[Sequence[int]], tokens: Sequence[int]) -> set[int]:
    """vLLM's bad words: a word's last token is banned when the tokens before the position
    end with the word's other tokens (a one-token word is always banned)."""
    banned = set()
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(tokens):
            continue
        if prefix == 0 or list(tokens[len(tokens) - prefix :]) == list(word[:prefix]):
            banned.add(word[-1])
    return banned


def _row_token_mask(
    shape: tuple[int, int],
    rows: list[int],
    tokens: list[int],
    device: torch.device,
    counts: bool = False,
) -> torch.Tensor:
    """[R, V]: how often (counts) or whether each (row, token) pair occurs in the flat lists."""
    out = torch.zeros(shape, dtype=torch.int32 if counts else torch.bool)
    if tokens:
        index = (torch.tensor(rows, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64))
        if counts:
            out.index_put_(index, torch.ones(len(tokens), dtype=torch.int32), accumulate=True)
        else:
            out[index] = True
    return out.to(device)


def apply_penalties(logits: torch.Tensor, ctxs: Sequence[RowContext]) -> torch.Tensor:
    """vLLM's penalties on float32 rows [R, V], one row per context, in one pass of torch
    ops over the batch (vLLM's apply_penalties): the repetition penalty divides a positive
    logit of a token in the prompt or the output and multiplies another; then frequency (times
    the token's count in the output) and presence (once per token in the output) are
    subtracted. Returns a new tensor."""
    shape, device = (logits.shape[0], logits.shape[1]), logits.device
    vocab = shape[1]
    prompt_rows: list[int] = []
    prompt_toks: list[int] = []
    out_rows: list[int] = []
    out_toks: list[int] = []
    for i, ctx in enumerate(ctxs):  # flat (row, token) lists: the only per-row Python
        prompt = [t for t in ctx.tokens[: ctx.num_prompt] if t < vocab]
        output = [t for t in ctx.tokens[ctx.num_prompt :] if t < vocab]
        prompt_toks += prompt
        prompt_rows += [i] * len(prompt)
        out_toks += output
        out_rows += [i] * len(output)
    counts = _row_token_mask(shape, out_rows, out_toks, device, counts=True)
    in_output = counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    rep = column([c.params.repetition_penalty for c in ctxs])
    seen = _row_token_mask(shape, prompt_rows, prompt_toks, device) | in_output
    penalties = torch.where(seen, rep, torch.ones((), dtype=torch.float32, device=device))
    logits = torch.where(logits > 0, logits / penalties, logits * penalties)
    logits = logits - column([c.params.frequency_penalty for c in ctxs]) * counts
    return logits - column([c.params.presence_penalty for c in ctxs]) * in_output


def apply_logits_processors(
    logits: torch.Tensor, rows: Sequence[RowContext | None]
) -> torch.Tensor:
    """The logits [S, V] (float32) with each row's processors applied; a row of None (or one
    whose params ask for none) is left as it is. Returns a new tensor when any row changes.

    Bad words and min_tokens ban tokens (-inf), gathered over the batch into one write; the
    penalties then run as batched torch ops over the rows that have them (each row's result
    still depends on its own logits and tokens only)."""
    todo = [
        (i, ctx) for i, ctx in enumerate(rows) if ctx is not None and needs_processing(ctx.params)
    ]
    if not todo:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    ban_rows: list[int] = []
    ban_toks: list[int] = []
    for i, ctx in todo:
        p = ctx.params
        # The engine resolved string bad words to ids before the request reached the runner.
        words = cast(Sequence[Sequence[int]], p.bad_words)
        banned = banned_bad_words(words, ctx.tokens) if words else set()
        if len(ctx.tokens) - ctx.num_prompt < p.min_tokens:
            banned.update(
                ctx.stop_ids
            )  # no stop before min_tokens (vLLM's MinTokensLogitsProcessor)
        in_vocab = sorted(t for t in banned if t < vocab)
        ban_toks += in_vocab
        ban_rows += [i] * len(in_vocab)
    if ban_toks:
        index = (
            torch.tensor(ban_rows, dtype=torch.int64),
            torch.tensor(ban_toks, dtype=torch.int64),
        )
        logits[tuple(x.to(logits.device) for x in index)] = float("-inf")
    bias_rows: list[int] = []
    bias_toks: list[int] = []
    biases: list[float] = []
    for i, ctx in todo:  # vLLM's LogitBiasLogitsProcessor: added to the raw logit
        for token, bias in ctx.params.logit_bias:
            if token < vocab:
                bias_rows.append(i)
                bias_toks.append(token)
                biases.append(bias)
    if biases:
        index = (
            torch.tensor(bias_rows, dtype=torch.int64, device=logits.device),
            torch.tensor(bias_toks, dtype=torch.int64, device=logits.device),
        )
        logits.index_put_(index, torch.tensor(biases, device=logits.device), accumulate=True)
    penalised = [(i, ctx) for i, ctx in todo if ctx.params.has_penalties]
    if penalised:
        index_t = torch.tensor([i for i, _ in penalised], dtype=torch.int64, device=logits.device)
        logits[index_t] = apply_penalties(logits[index_t], [ctx for _, ctx in penalised])
    return logits


def top_logprobs(values: torch.Tensor, ks: Sequence[int]) -> list[tuple[list[int], list[float]]]:
    """Per row, the k most likely token ids and their values (the logprobs, or the logits
    with a *_logits logprobs_mode), best first (ties: lower id first); k = 0 gives empty
    lists."""
    kmax = max(ks, default=0)
    if kmax <= 0:
        return [([], []) for _ in ks]
    # A stable descending sort: equal logprobs keep the lower id first, on any device.
    best, ids = values.sort(dim=-1, descending=True, stable=True)
    top, top_ids = best[:, :kmax].tolist(), ids[:, :kmax].tolist()
    return [(top_ids[i][:k], top[i][:k]) for i, k in enumerate(ks)]
