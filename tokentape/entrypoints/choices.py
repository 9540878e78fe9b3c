"""The logprobs of an OpenAI choice in the API's two shapes, from the output processor's
completions (text, stop strings and their holdback are the processor's: the server only
formats)."""

from __future__ import annotations

from collections.abc import Callable

from tokentape.engine.outputs import CompletionOutput
from tokentape.entrypoints import protocol as p

Decode = Callable[[list[int]], str]


class CompletionLogprobsFormatter:
    """The completions API's shape for one choice, its DELTA completions in order: per token
    its text, logprob, text offset and, with logprobs=k, the top k and the sampled token by
    their text (k = 0: the sampled one)."""

    __slots__ = ("decode", "pieces_len")

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.pieces_len = 0  # characters of the tokens' pieces so far (text_offset)

    def add(self, c: CompletionOutput) -> p.CompletionLogprobs:
        decode = self.decode
        pieces = [decode([t]) for t in c.token_ids]
        offsets = []
        for piece in pieces:
            offsets.append(self.pieces_len)
            self.pieces_len += len(piece)
        lps = list(c.logprobs or ())
        if c.top_logprobs is not None:
            top = [{decode([t]): lp for t, lp in pos.items()} for pos in c.top_logprobs]
        else:  # logprobs=0: the sampled token alone, as vLLM's (OpenAI's top k + 1)
            top = [{piece: lp} for piece, lp in zip(pieces, lps)]
        return p.CompletionLogprobs(pieces, lps, offsets, top)


def chat_logprobs(decode: Decode, c: CompletionOutput, k: int) -> list[p.ChatLogprob]:
    """The chat API's shape: per token its text, logprob and UTF-8 bytes, and the k most
    likely tokens (top_logprobs=k) in the same form, best first."""
    content = []
    tops = c.top_logprobs or [None] * len(c.token_ids)
    for t, lp, top in zip(c.token_ids, c.logprobs or (), tops):
        piece = decode([t])
        alts = []
        if top and k:
            for alt, alt_lp in sorted(top.items(), key=lambda x: (-x[1], x[0]))[:k]:
                s = decode([alt])
                alts.append(
                    {"token": s, "logprob": alt_lp, "bytes": list(s.encode("utf-8", "replace"))}
                )
        content.append(p.ChatLogprob(piece, lp, list(piece.encode("utf-8", "replace")), alts))
    return content
