"""AsyncLLM's outputs of one request: the deltas of its engine requests (itself, or its n
children) turned into RequestOutputs by the request's output kind, with n > 1 gathered into
one stream as vLLM's (each output holds the completions with something new; FINAL_ONLY one
output with all n, once all n are finished)."""

from __future__ import annotations

from collections.abc import Callable

from tokentape.engine.output_collector import Delta
from tokentape.engine.outputs import CompletionOutput, RequestOutput, build_request_output
from tokentape.engine.stop_strings import stop_decoder
from tokentape.engine.tokenizer import Tokenizer
from tokentape.events.schema import RequestOutputKind, SamplingParams


class _Sequence:
    """Everything one engine request delivered so far, for its outputs by output kind."""

    __slots__ = ("index", "tokens", "logprobs", "top", "finished")

    def __init__(self, index: int, params: SamplingParams) -> None:
        self.index = index
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top: list[dict[int, float]] | None = [] if params.logprobs else None
        self.finished = False


class RequestOutputAssembler:
    """One request's RequestOutputs from the deltas its collector hands over."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "prompt",
        "params",
        "tokenizer",
        "finished",
        "_seqs",
        "_final",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        prompt: str | None,
        params: SamplingParams,
        tokenizer: Tokenizer,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt = prompt
        self.params = params
        self.tokenizer = tokenizer
        self.finished = False  # all n engine requests are
        self._seqs = [_Sequence(i, params) for i in range(params.n)]
        self._final: dict[
            int, CompletionOutput
        ] = {}  # FINAL_ONLY with n > 1: the finished children

    def add(self, deltas: dict[int, Delta]) -> RequestOutput | None:
        """The output for these deltas (by engine request index), None when there is none
        to give yet."""
        completions = [
            c
            for i, d in sorted(deltas.items())
            if (c := self._completion(self._seqs[i], d)) is not None
        ]
        self.finished = all(seq.finished for seq in self._seqs)
        n = len(self._seqs)
        if self.params.output_kind == RequestOutputKind.FINAL_ONLY and n > 1:
            self._final.update((c.index, c) for c in completions)
            if not self.finished:
                return None
            completions = [self._final[i] for i in range(n)]
        if not completions:
            return None
        return RequestOutput(
            self.request_id, self.prompt_token_ids, completions, self.finished, self.prompt
        )

    def _completion(self, seq: _Sequence, d: Delta) -> CompletionOutput | None:
        """One engine request's completion for what it sent (None: FINAL_ONLY, not done)."""
        seq.tokens += d.tokens
        if seq.logprobs is not None and d.logprobs:
            seq.logprobs += d.logprobs
        if seq.top is not None and d.top:
            seq.top += d.top
        seq.finished = d.finish_reason is not None
        params = self.params
        decode: Callable[[list[int]], str] = self.tokenizer.decode
        if d.stop_reason is not None:  # the text is cut at the stop string, as LLM's
            decode = stop_decoder(decode, params, seq.tokens, d.stop_reason)
        out = build_request_output(
            params.output_kind,
            self.request_id,
            self.prompt_token_ids,
            seq.tokens,
            len(d.tokens),
            seq.logprobs,
            d.finish_reason,
            decode,
            self.prompt,
            seq.top,
            d.stop_reason,
        )
        if out is None:
            return None
        completion = out.outputs[0]
        completion.index = seq.index
        return completion
