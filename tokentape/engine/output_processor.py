"""The one output processor, as vLLM V1's `OutputProcessor`: it turns the engine core's
per-request deltas (`EngineCoreOutput`, what `OutputsEmitted` records) into the
`RequestOutput`s a client sees. `LLMEngine.step` (so `LLM`), `AsyncLLM` and the server (over
`AsyncLLM`) all get their outputs from here.

Per request it keeps every token, logprob and text piece delivered so far, and does:
- incremental detokenization (detokenizer.py), each token decoded once: here, or, for a
  request with stop strings, in the engine core, which looks for them in the text and sends
  it with the tokens (`EngineCoreOutput.new_text`), held back and cut at the match as the
  client may see it (stop_strings.py);
- output kinds: every token so far (CUMULATIVE), the new ones (DELTA), or nothing until the
  request finishes (FINAL_ONLY, whose text is decoded once, at the end);
- n > 1 fan-in: the children "{i}_{id}" gathered into their parent's outputs (each output
  holds the completions with something new; FINAL_ONLY one output with all n);
- `stream_interval` N > 1 (vLLM's --stream-interval): a completion's first tokens go out at
  once, then every N tokens, at its finish, or when `flush` says so;
- prompt logprobs (SamplingParams.prompt_logprobs): in vLLM's shape, in the request's first
  output only (later ones: [], as vLLM's pop_prompt_logprobs leaves them).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokentape.engine.detokenizer import Detokenizer, detokenizer
from tokentape.engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from tokentape.engine.tokenizer import Tokenizer
from tokentape.events.schema import PromptLogprobs, RequestOutputKind, SamplingParams

_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


class _Completion:
    """Everything one engine request (the request, or one child) delivered so far."""

    __slots__ = (
        "index",
        "tokens",
        "logprobs",
        "top",
        "detok",
        "fed",
        "pieces",
        "marks",
        "sent_tokens",
        "sent_pieces",
        "started",
        "finish_reason",
        "stop_reason",
        "tokenizer",
        "versions",
    )

    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer | None) -> None:
        self.index = index
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top: list[dict[int, float]] | None = [] if params.logprobs else None
        self.tokenizer = tokenizer
        self.detok: Detokenizer = detokenizer(tokenizer)
        self.fed = 0  # tokens given to the detokenizer (or decoded by the engine core)
        self.pieces: list[str] = []  # the detokenizer's text deltas (CUMULATIVE reads them)
        # Where each CUMULATIVE text read so far ends: tokens -> pieces.
        self.marks: dict[int, int] = {0: 0}
        self.sent_tokens = 0  # tokens given out in outputs
        self.sent_pieces = 0  # DELTA: text pieces given out
        self.started = False  # an output was given (stream_interval releases the first at once)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.versions: list[tuple[int, str]] = []  # where each weight version's tokens begin

    def append(self, out: EngineCoreOutput) -> None:
        version = out.weight_version
        if out.new_token_ids and version is not None:
            if not self.versions or self.versions[-1][1] != version:
                self.versions.append((len(self.tokens), version))
        self.tokens += out.new_token_ids
        if out.new_text is not None:  # decoded by the engine core (stop strings)
            self._add_text(out.new_text)
            self.fed = len(self.tokens)
            self.marks[self.fed] = len(self.pieces)
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs += out.new_logprobs
        if self.top is not None and out.new_top_logprobs:
            self.top += out.new_top_logprobs
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason

    def _feed(self, end: int | None = None, final: bool | None = None) -> None:
        """Detokenize the tokens not yet detokenized, up to `end` (default: all of them, and
        `final` when the completion has finished), into `pieces`."""
        end = len(self.tokens) if end is None else end
        new = self.tokens[self.fed : end]
        self.fed = end
        piece = self.detok.add(new, self.finish_reason is not None if final is None else final)
        self._add_text(piece)

    def _add_text(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)

    def text_at(self, end: int, final: bool) -> str | None:
        """The text of the first `end` tokens as the incremental detokenizer gives it there:
        CUMULATIVE text, decoded when it is first read (a consumer that never reads it costs
        no decoding). None when the tokens were decoded past `end` in one go (an older
        output read after a newer one)."""
        if self.fed < end:
            self._feed(end, final)
            self.marks[end] = len(self.pieces)
        num_pieces = self.marks.get(end)
        if num_pieces is None:
            return None
        return "".join(self.pieces[:num_pieces])


def _final_text(c: _Completion, end: int, finished: bool) -> str:
    """A FINAL_ONLY output's text (CompletionOutput's text_of): every token's."""
    c._feed()
    return "".join(c.pieces)


def _cumulative_text(c: _Completion, end: int, finished: bool) -> str:
    """A CUMULATIVE output's text (CompletionOutput's text_of): the first `end` tokens'."""
    text = c.text_at(end, finished)
    if text is None:  # decoded past `end` already: decode the first `end` alone
        text = detokenizer(c.tokenizer).add(c.tokens[:end], finished)
    return text


class _Request:
    """One client request: its completions (n of them) and how its outputs are shaped."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "prompt",
        "params",
        "kind",
        "completions",
        "num_unfinished",
        "prompt_logprobs",
        "prompt_logprobs_sent",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        prompt: str | None,
        params: SamplingParams,
        tokenizer: Tokenizer | None,
    ) -> None:
        self.request_id, self.prompt_token_ids, self.prompt = request_id, prompt_token_ids, prompt
        self.params, self.kind = params, params.output_kind
        self.completions = [_Completion(i, params, tokenizer) for i in range(params.n)]
        self.num_unfinished = params.n
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_logprobs_sent = False

    def take_prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        """For an output about to go out: the prompt logprobs the first time they can, [] after
        (vLLM's), None while they have not come (or were not asked for)."""
        if self.prompt_logprobs_sent:
            return []
        plp = self.prompt_logprobs
        if plp is not None:
            self.prompt_logprobs_sent, self.prompt_logprobs = True, None
        return plp

    def keep_prompt_logprobs(self, plp: PromptLogprobs) -> None:
        """vLLM's list: None for the first prompt token, then per position the prompt token's
        logprob first and the k most likely after it. The first to come is kept (each child
        of n > 1 brings the same)."""
        if self.prompt_logprobs is not None or self.prompt_logprobs_sent:
            return
        tokens = self.prompt_token_ids
        if self.params.prompt_logprobs:
            tops = zip(plp.top_token_ids, plp.top_logprobs, strict=True)
            rows: list[dict[int, float] | None] = [
                {tok: lp, **dict(zip(ids, lps))}
                for tok, lp, (ids, lps) in zip(tokens[1:], plp.token_logprobs, tops)
            ]
        else:
            rows = [{tok: lp} for tok, lp in zip(tokens[1:], plp.token_logprobs)]
        self.prompt_logprobs = [None, *rows]


class OutputProcessor:
    """Turns the core's deltas into each request's RequestOutputs (see the module doc)."""

    def __init__(self, tokenizer: Tokenizer | None, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._requests: dict[str, _Request] = {}
        self._by_engine_id: dict[str, tuple[_Request, _Completion]] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        prompt: str | None,
        params: SamplingParams,
        engine_request_ids: list[str],
    ) -> None:
        """Follow a request whose engine requests (itself, or its n children, in index order)
        are `engine_request_ids`."""
        req = _Request(request_id, prompt_token_ids, prompt, params, self.tokenizer)
        self._requests[request_id] = req
        for engine_id, comp in zip(engine_request_ids, req.completions, strict=True):
            self._by_engine_id[engine_id] = (req, comp)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def remove_request(self, request_id: str) -> None:
        """Stop following a request (its consumer left)."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            for engine_id in [k for k, v in self._by_engine_id.items() if v[0] is req]:
                del self._by_engine_id[engine_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def num_output_tokens(self, request_ids: Iterable[str]) -> int:
        """Tokens delivered so far to these requests (a progress bar's count)."""
        reqs = self._requests
        return sum(len(c.tokens) for r in request_ids if r in reqs for c in reqs[r].completions)

    def process_outputs(self, outputs: Iterable[EngineCoreOutput]) -> list[RequestOutput]:
        """The RequestOutputs for the core's deltas: one per request that has something to
        give, in the order of the deltas. Deltas of engine requests not followed here (added
        to the core directly) are passed over."""
        touched: dict[_Request, list[_Completion]] = {}
        by_engine_id = self._by_engine_id
        for out in outputs:
            entry = by_engine_id.get(out.request_id)
            if entry is None:
                continue
            req, comp = entry
            comp.append(out)
            if out.prompt_logprobs is not None:
                req.keep_prompt_logprobs(out.prompt_logprobs)
            if out.finish_reason is not None:
                req.num_unfinished -= 1
                del by_engine_id[out.request_id]
            elif req.kind is _FINAL_ONLY:
                continue  # nothing to give before the finish (LLM.generate's every step)
            comps = touched.get(req)
            if comps is None:  # n = 1: its list of one, not a new one per step
                touched[req] = req.completions if len(req.completions) == 1 else [comp]
            elif comp not in comps:
                comps.append(comp)
        results = []
        for req, comps in touched.items():
            result = self._request_output(req, comps, force=False)
            if result is not None:
                results.append(result)
            if not req.num_unfinished:
                del self._requests[req.request_id]
        return results

    def flush(self) -> list[RequestOutput]:
        """The outputs held back by `stream_interval` (a pause: the drained tokens go out)."""
        results = []
        for req in self._requests.values():
            if req.kind == _FINAL_ONLY:
                continue
            comps = [c for c in req.completions if len(c.tokens) > c.sent_tokens]
            result = self._request_output(req, comps, force=True) if comps else None
            if result is not None:
                results.append(result)
        return results

    def _request_output(
        self, req: _Request, comps: list[_Completion], force: bool
    ) -> RequestOutput | None:
        finished = not req.num_unfinished
        if req.kind == _FINAL_ONLY:
            if not finished:
                return None
            completions = [self._final(c) for c in req.completions]
        elif len(req.completions) == 1:  # the common case, without a comprehension's frame
            out = self._streamed(req, comps[0], force)
            if out is None:
                return None
            completions = [out]
        else:
            comps = sorted(comps, key=lambda c: c.index)
            completions = [out for c in comps if (out := self._streamed(req, c, force)) is not None]
            if not completions:
                return None
        result = RequestOutput(
            req.request_id, req.prompt_token_ids, completions, finished, req.prompt
        )
        if req.params.prompt_logprobs is not None:
            result.prompt_logprobs = req.take_prompt_logprobs()
        return result

    def _streamed(self, req: _Request, c: _Completion, force: bool) -> CompletionOutput | None:
        """A CUMULATIVE or DELTA completion for what `c` got since its last, or None while
        stream_interval holds it back."""
        end = len(c.tokens)
        done = c.finish_reason is not None
        interval = self.stream_interval
        if interval > 1 and not (done or force) and c.started and end - c.sent_tokens < interval:
            return None
        if req.kind is not _DELTA:  # CUMULATIVE: every token so far, the text when read
            c.started, c.sent_tokens = True, end
            return CompletionOutput.of_span(
                c.index, c, 0, end, _cumulative_text, c.finish_reason, c.stop_reason
            )
        # DELTA: the new tokens and the text they add
        start = c.sent_tokens
        c.started, c.sent_tokens = True, end
        c._feed()
        text = "".join(c.pieces[c.sent_pieces :])
        c.sent_pieces = len(c.pieces)
        return CompletionOutput.of_span(
            c.index, c, start, end, text, c.finish_reason, c.stop_reason
        )

    def _final(self, c: _Completion) -> CompletionOutput:
        """A FINAL_ONLY completion: every token, the text decoded when it is first read."""
        return CompletionOutput.of_span(
            c.index, c, 0, len(c.tokens), _final_text, c.finish_reason, c.stop_reason
        )
