"""The logprobs of an OpenAI choice in the API's two shapes, from the output processor's
completions (text, stop strings and their holdback are the processor's: the server only
formats)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokentape.engine.outputs import CompletionOutput
from tokentape.entrypoints import protocol as p

Decode = Callable[[list[int]], str]


class CompletionLogprobsFormatter:
    """The completions API's shape for one choice, its DELTA completions in order: per token
    its text, logprob, text offset and, with logprobs=k, the top k and the sampled token by
    their text (k = 0: the sampled one). With echo, the prompt's tokens come first (vLLM's
    OpenAIServingCompletion): the first has no logprob (null), the others the prompt
    logprobs' dicts."""

    __slots__ = ("decode", "pieces_len")

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.pieces_len = 0  # characters of the tokens' pieces so far (text_offset)

    def add(
        self, c: CompletionOutput, before: p.CompletionLogprobs | None = None
    ) -> p.CompletionLogprobs:
        """The logprobs of a completion's new tokens (after `before`'s, the echoed prompt)."""
        decode = self.decode
        pieces = [decode([t]) for t in c.token_ids]
        lps: list[float | None] = list(c.logprobs or ())
        top: list[dict[str, float] | None]
        if c.top_logprobs is not None:
            top = [{decode([t]): lp for t, lp in pos.items()} for pos in c.top_logprobs]
        else:  # logprobs=0: the sampled token alone, as vLLM's (OpenAI's top k + 1)
            top = [{piece: lp} for piece, lp in zip(pieces, c.logprobs or ())]
        out = self._shaped(pieces, lps, top)
        if before is None:
            return out
        return p.CompletionLogprobs(
            before.tokens + out.tokens,
            before.token_logprobs + out.token_logprobs,
            before.text_offset + out.text_offset,
            (before.top_logprobs or []) + (out.top_logprobs or []),
        )

    def add_prompt(
        self, token_ids: list[int], prompt_logprobs: list[dict[int, float] | None] | None
    ) -> p.CompletionLogprobs:
        """The echoed prompt's tokens: a position without logprobs (the first) has null for
        its logprob and its top logprobs, as vLLM's; a logprob is clamped at -9999.0 (vLLM's
        stand-in for -inf, which JSON cannot hold)."""
        decode = self.decode
        pieces = [decode([t]) for t in token_ids]
        rows = prompt_logprobs or []
        lps: list[float | None] = []
        top: list[dict[str, float] | None] = []
        for i, t in enumerate(token_ids):
            row = rows[i] if i < len(rows) else None
            if row is None:
                lps.append(None)
                top.append(None)
                continue
            lps.append(json_logprob(row[t]))
            top.append({decode([alt]): json_logprob(lp) for alt, lp in row.items()})
        return self._shaped(pieces, lps, top)

    def _shaped(
        self, pieces: list[str], lps: list[float | None], top: list[dict[str, float] | None]
    ) -> p.CompletionLogprobs:
        offsets = []
        for piece in pieces:
            offsets.append(self.pieces_len)
            self.pieces_len += len(piece)
        return p.CompletionLogprobs(pieces, lps, offsets, top)


def chat_logprobs(decode: Decode, c: CompletionOutput, k: int) -> list[p.ChatLogprob]:
    """The chat API's shape: per token its text, logprob and UTF-8 bytes, and the k most
    likely tokens (top_logprobs=k) in the same form, best first."""

    def by_text(token_id: int) -> tuple[str, list[int] | None]:
        piece = decode([token_id])
        return piece, list(piece.encode("utf-8", "replace"))

    return _chat_content(c, k, by_text)


def token_id_logprobs(c: CompletionOutput, k: int) -> list[p.ChatLogprob]:
    """The chat API's shape with tokens named by their ids ("token_id:<id>", no bytes), as
    vLLM's /inference/v1/generate gives them: per token its logprob and the k most likely."""
    return _chat_content(c, k, lambda token_id: (f"token_id:{token_id}", None))


def _chat_content(
    c: CompletionOutput, k: int, name: Callable[[int], tuple[str, list[int] | None]]
) -> list[p.ChatLogprob]:
    """Per token: its `name` (the token's string and bytes), logprob and the k most likely
    tokens in the same form, best first (ties: lower id first)."""
    content = []
    tops: Sequence[dict[int, float] | None] = c.top_logprobs or [None] * len(c.token_ids)
    for t, lp, top in zip(c.token_ids, c.logprobs or (), tops):
        alts = []
        if top and k:
            for alt, alt_lp in sorted(top.items(), key=lambda x: (-x[1], x[0]))[:k]:
                s, raw = name(alt)
                alts.append({"token": s, "logprob": alt_lp, "bytes": raw})
        token, raw = name(t)
        content.append(p.ChatLogprob(token, lp, raw, alts))
    return content


def json_logprob(lp: float) -> float:
    """A logprob JSON can hold: -inf clamped at -9999.0, vLLM's stand-in."""
    return max(lp, -9999.0)
