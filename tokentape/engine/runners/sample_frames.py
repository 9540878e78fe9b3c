"""A step's sampling in the model runner: the sampling rows of every request that samples
(its own and its drafts' positions), the logits processors and the sampler, the logprobs
asked for, the longest prefix of drafts the samples accept, and the step's frame entries."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokentape.engine.model.logits_processors import (
    RowContext,
    apply_logits_processors,
    needs_processing,
    top_logprobs,
)
from tokentape.engine.model.sampler import SamplingRows, position_key, sample, sample_processed
from tokentape.engine.runners.input_batch import EntryInputs
from tokentape.events.schema import FrameEntry, PromptLogprobs

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


def sample_frames(
    samplers: list[EntryInputs],
    logits: torch.Tensor,
    eos_token_id: int | None,
    prompt_logprobs: Callable[[str], PromptLogprobs | None],
    logprobs_mode: str = "raw_logprobs",
) -> dict[str, FrameEntry]:
    """Each sampling entry's frame entry, from its rows of `logits` (one per position it
    samples, in `samplers`' order); the sequences take their accepted tokens.
    `prompt_logprobs(req_id)` hands over a request's prompt logprobs once they are whole;
    `logprobs_mode` (EngineConfig's) says what the sampled tokens' logprobs hold."""
    rows = SamplingRows([], [], [], [])
    contexts: list[RowContext | None] = []
    for e in samplers:
        p, seq = e.seq.params, e.seq
        stop_ids = (
            p.stop_token_ids
            if p.ignore_eos or eos_token_id is None
            else (*p.stop_token_ids, eos_token_id)
        )
        # Below SAMPLING_EPS a temperature is greedy, as vLLM's: dividing by 1e-39
        # overflows the logits to inf and the draw to garbage.
        temperature = p.temperature if p.temperature >= SAMPLING_EPS else 0.0
        for j in range(1 + len(e.drafts)):  # the token at position len(tokens) + j
            rows.temperatures.append(temperature)
            rows.top_ks.append(p.top_k)
            rows.top_ps.append(p.top_p)
            if p.min_p > 0 and rows.min_ps is None:
                rows.min_ps = [0.0] * (len(rows.top_ps) - 1)
            if rows.min_ps is not None:
                rows.min_ps.append(p.min_p)
            rows.keys.append(
                position_key(seq.seed, len(seq.tokens) + j) if temperature > 0 else (0, 0)
            )
            # A draft row sees the drafts before it: they are its history if accepted.
            contexts.append(
                RowContext(p, stop_ids, seq.tokens + e.drafts[:j], seq.num_prompt)
                if needs_processing(p)
                else None
            )
    # vLLM's order: the processors, then sampling; the logprobs of the raw logits (its
    # default mode) or of what the sampler drew from.
    processed = apply_logits_processors(logits, contexts)
    want_logprobs = any(e.seq.params.logprobs is not None for e in samplers)
    # What the logprobs are of (EngineConfig.logprobs_mode): the raw logits, or what the
    # sampler drew from; as log-softmax (*_logprobs) or as they are (*_logits).
    source = logits
    if want_logprobs and logprobs_mode.startswith("processed"):
        sampled_t, source = sample_processed(processed, rows)
    else:
        sampled_t = sample(processed, rows)
    ks = [e.seq.params.logprobs or 0 for e in samplers for _ in range(1 + len(e.drafts))]
    logprobs: list[float] | None = None
    tops: list[tuple[list[int], list[float]]] | None = None
    if want_logprobs:
        values = source.float()
        if logprobs_mode.endswith("logprobs"):
            values = values.log_softmax(dim=-1)
        logprobs = values.gather(1, sampled_t.unsqueeze(1)).squeeze(1).tolist()
        tops = top_logprobs(values, ks) if any(ks) else None
    sampled = sampled_t.tolist()
    frames: dict[str, FrameEntry] = {}
    row = 0
    for e in samplers:
        seq, drafts = e.seq, e.drafts
        out = []
        for j, d in enumerate(drafts):  # accept the longest prefix matching our own samples
            if d != sampled[row + j]:
                break
            out.append(d)
        out.append(sampled[row + len(out)])
        seq.num_computed += len(out) - 1  # the accepted drafts' K/V are valid
        position = len(seq.tokens)  # where its first token goes
        seq.tokens += out
        lp = (
            logprobs[row : row + len(out)]
            if logprobs is not None and seq.params.logprobs is not None
            else None
        )
        top_ids = top_lps = None
        if tops is not None and seq.params.logprobs:
            top_ids = [tops[row + j][0] for j in range(len(out))]
            top_lps = [tops[row + j][1] for j in range(len(out))]
        plp = prompt_logprobs(e.req_id)  # the prompt's, on its last chunk's frame
        frames[e.req_id] = FrameEntry(e.req_id, out, drafts, lp, top_ids, top_lps, position, plp)
        row += 1 + len(drafts)
    return frames
