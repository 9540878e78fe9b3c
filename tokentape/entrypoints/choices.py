"""One OpenAI choice as its DELTA outputs arrive: the text (incremental, held back and cut at
a stop string as vLLM's front end does) and the logprobs in OpenAI's two shapes.

Stop strings: the engine finds a stop string after the frame that completes it and records
it as the finish's `stop_reason`. Text streamed before then may already hold the string's
beginning, so, as vLLM's detokenizer does, the last `len(longest stop) - 1` characters are
held back while the choice runs (none with include_stop_str_in_output: nothing after a
match can have been sent); the final delta is whatever of the cut text (stop_strings.py) is
still unsent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tokentape.engine.outputs import CompletionOutput
from tokentape.engine.stop_strings import stop_text
from tokentape.entrypoints import protocol as p
from tokentape.events.schema import SamplingParams

Decode = Callable[[list[int]], str]


class Detokenizer(Protocol):
    def add(self, new_tokens: list[int], final: bool) -> str: ...


class ChoiceText:
    __slots__ = ("detok", "decode", "params", "holdback", "tokens", "unsent", "sent", "pieces_len")

    def __init__(self, detok: Detokenizer, decode: Decode, params: SamplingParams) -> None:
        self.detok, self.decode, self.params = detok, decode, params
        stops = params.stop
        self.holdback = (
            max(map(len, stops)) - 1 if stops and not params.include_stop_str_in_output else 0
        )
        self.tokens: list[int] = []  # for the final cut at a stop string
        # Only the decoded text not yet given out is kept (the holdback window): appending to
        # an attribute copies it each time, quadratic over a long stream.
        self.unsent = ""
        self.sent = 0  # characters given out
        self.pieces_len = 0  # characters of the tokens' pieces so far (text_offset)

    def add(self, c: CompletionOutput) -> str:
        """The text delta of a DELTA completion (its finish_reason set on the last)."""
        final = c.finish_reason is not None
        self.tokens += c.token_ids
        unsent = self.unsent + self.detok.add(c.token_ids, final)
        if not final:
            end = len(unsent) - self.holdback
            if end <= 0:
                self.unsent = unsent
                return ""
            delta, self.unsent = unsent[:end], unsent[end:]
            self.sent += end
            return delta
        delta = unsent
        if c.stop_reason is not None:
            delta = stop_text(self.decode, self.params, self.tokens, c.stop_reason)[self.sent :]
        self.unsent = ""
        self.sent += len(delta)
        return delta

    def completion_logprobs(self, c: CompletionOutput) -> p.CompletionLogprobs:
        """The completions API's shape: per token its text, logprob, text offset and, with
        logprobs=k, the top k and the sampled token by their text (k = 0: the sampled one)."""
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
