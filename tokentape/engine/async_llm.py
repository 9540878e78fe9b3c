"""AsyncLLM: vLLM V1's asyncio API. The engine core (engine, scheduler, runner, tape) runs in
a background process by default; this frontend sends it requests and turns the token deltas
it gets back into each request's outputs, by the request's output kind.

    engine = AsyncLLM(model="oracle", tape="run.tape")
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "r1"):
        print(out.outputs[0].text)
    engine.shutdown()

Cancelling a consumer (or leaving its loop) aborts its request, and the abort is on the tape.
`multiprocess_mode=False` steps the same engine core inside the event loop (for debugging).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from typing import Any

from tokentape.engine.config import EngineConfig
from tokentape.engine.core.client import CoreClient, InprocClient, MPClient
from tokentape.engine.core.messages import CoreDead, CoreMessage, CoreOutput, CoreOutputs, SchedulerStats, AddRequest, rebuild_error
from tokentape.engine.llm import TapeSpec, check_tape_path
from tokentape.engine.llm_engine import PAUSE_MODES, EngineDeadError
from tokentape.engine.outputs import CompletionOutput, RequestOutput, build_request_output
from tokentape.engine.parallel_sampling import child_request_id
from tokentape.engine.stop_strings import stop_decoder
from tokentape.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tokentape.events.schema import RequestOutputKind, SamplingParams
from tokentape.events.validation import check_int, check_str, shown

PromptType = str | Sequence[int] | Mapping[str, Any]


def frontend_tokenizer(model: str) -> Tokenizer:
    """The tokenizer the engine uses, without loading the model: a checkpoint folder's
    tokenizer.json, else the byte tokenizer (the built-in models and the oracle)."""
    file = os.path.join(model, "tokenizer.json")
    if os.path.isdir(model) and os.path.exists(file):
        return HFTokenizer(file)
    return ByteTokenizer()


class Delta:
    """What one engine request (a request, or a child of n > 1) sent since its consumer last
    took: new tokens, their logprobs and top-k alternatives, the finish."""

    __slots__ = ("tokens", "logprobs", "top", "finish_reason", "stop_reason")

    def __init__(self, with_logprobs: bool, with_top: bool) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if with_logprobs else None
        self.top: list[dict[int, float]] | None = [] if with_top else None
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None


class RequestOutputCollector:
    """A request's deltas not yet taken by its consumer, merged per engine request (index 0,
    or the child's index for n > 1): a slow consumer gets one output with everything new
    instead of a queue of them (as vLLM's collector).

    With `stream_interval` N > 1 (vLLM's --stream-interval) the consumer is woken for an
    engine request's first tokens, then once N tokens have gathered, at its finish, on an
    error, or when `flush` says so (a pause): fewer, larger outputs, so a server spends less
    per token, and the tokens reach the client up to N - 1 steps later."""

    __slots__ = ("with_logprobs", "with_top", "deltas", "error", "_ready", "_interval", "_started")

    def __init__(self, params: SamplingParams, stream_interval: int = 1) -> None:
        self.with_logprobs = params.logprobs is not None
        self.with_top = bool(params.logprobs)
        self.deltas: dict[int, Delta] = {}
        self.error: Exception | None = None
        self._ready = asyncio.Event()
        self._interval = stream_interval
        self._started: set[int] = set()  # the engine requests whose first tokens were released

    def put(self, index: int, out: CoreOutput) -> None:
        if out.error is not None:
            self.error = rebuild_error(out.error)
        else:
            d = self.deltas.get(index)
            if d is None:
                d = self.deltas[index] = Delta(self.with_logprobs, self.with_top)
            d.tokens += out.new_token_ids
            if d.logprobs is not None and out.new_logprobs:
                d.logprobs += out.new_logprobs
            if d.top is not None and out.new_top_logprobs:
                d.top += out.new_top_logprobs
            if out.finish_reason is not None:
                d.finish_reason, d.stop_reason = out.finish_reason, out.stop_reason
            if self._interval > 1 and out.finish_reason is None and index in self._started \
                    and len(d.tokens) < self._interval:
                return  # gathering: the consumer is woken at N tokens, the finish or a flush
            self._started.add(index)
        self._ready.set()

    def flush(self) -> None:
        """Wake the consumer for whatever has gathered (a pause: drained tokens go out)."""
        if self.deltas:
            self._ready.set()

    def fail(self, exc: Exception) -> None:
        self.error = exc
        self._ready.set()

    async def get(self) -> dict[int, Delta]:
        await self._ready.wait()
        self._ready.clear()
        if self.error is not None:
            raise self.error
        got, self.deltas = self.deltas, {}
        return got


class _Sequence:
    """Everything one engine request delivered so far, for its outputs by output kind."""

    __slots__ = ("index", "tokens", "logprobs", "top", "finished")

    def __init__(self, index: int, params: SamplingParams) -> None:
        self.index = index
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top: list[dict[int, float]] | None = [] if params.logprobs else None
        self.finished = False


class AsyncLLM:
    """vLLM's AsyncLLM over tokentape's engine. Takes LLM's engine arguments."""

    def __init__(
        self,
        model: str = "tiny",
        *,
        tape: TapeSpec = None,
        multiprocess_mode: bool = True,
        stream_interval: int = 1,
        **engine_args: Any,
    ) -> None:
        EngineConfig(model=model, **engine_args)  # a bad argument fails here, before any process
        check_tape_path(tape)
        check_int("stream_interval", stream_interval, 1)
        # Tokens per output after a stream's first (vLLM's --stream-interval): how outputs are
        # grouped for the consumer, after the engine; nothing on the tape changes.
        self.stream_interval = stream_interval
        self.model = model
        self.tokenizer = frontend_tokenizer(model)
        client_cls = MPClient if multiprocess_mode else InprocClient
        self.engine_core: CoreClient = client_cls(model, tape, dict(engine_args))
        info = self.engine_core.info
        self.model_id, self.vocab_size, self.max_model_len = info.model_id, info.vocab_size, info.max_model_len
        self.tape_path: str | None = info.tape_path
        self.stats = SchedulerStats()
        # By request id: its collector and the engine requests behind it (itself, or its n
        # children); by engine request id: the collector and the child's index.
        self._streams: dict[str, tuple[RequestOutputCollector, list[str]]] = {}
        self._routes: dict[str, tuple[RequestOutputCollector, int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None

    # -- state ----------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine cannot serve any more: {self._dead}")

    def _ensure_started(self) -> None:
        """Bind to the running event loop on first use (a closed earlier loop is replaced)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("this AsyncLLM is in use by another running event loop")
        self._loop = loop
        self.engine_core.start(self._dispatch)

    def _dispatch(self, msg: CoreMessage) -> None:
        if isinstance(msg, CoreOutputs):
            self.stats = msg.stats
            routes = self._routes
            for out in msg.outputs:
                route = routes.get(out.request_id)
                if route is not None:
                    route[0].put(route[1], out)
            if msg.utility is not None:
                if self.stream_interval > 1:  # a pause's drained tokens reach their streams first
                    for collector, _ in self._streams.values():
                        collector.flush()
                self.engine_core.resolve(msg.utility.call_id, msg.utility.result, msg.utility.error)
        elif isinstance(msg, CoreDead):
            self._fail_all(msg.message)

    def _fail_all(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        exc = EngineDeadError(f"the engine cannot serve any more: {reason}")
        for collector, _ in self._streams.values():
            collector.fail(exc)
        self.engine_core.fail_calls(exc)

    # -- requests -------------------------------------------------------------------------------

    def _prompt_token_ids(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, Mapping):  # vLLM's TextPrompt / TokensPrompt
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, str):
            check_str("prompt", prompt)
            return self.tokenizer.encode(prompt), prompt
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise TypeError(f"prompt must be a string or a list of token ids, got {shown(prompt)}")
        return list(prompt), None

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs; the last has `finished=True`. The engine checks the
        request before recording anything: a refused one raises here (ValueError, TypeError).

        With n > 1 the engine runs n children "{i}_{request_id}" (parallel_sampling.py) and
        this one stream gathers them, as vLLM's: each output holds the completions (index i)
        with something new, FINAL_ONLY one output with all n; finished when all n are."""
        self._ensure_started()
        self._check_alive()
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {shown(params)}")
        check_str("request_id", request_id)
        if request_id in self._streams or request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is already in use on this engine")
        tokens, text = self._prompt_token_ids(prompt)
        n = params.n
        core_ids = [request_id] if n == 1 else [child_request_id(i, request_id) for i in range(n)]
        for core_id in core_ids:
            if core_id in self._routes:
                raise ValueError(f"request {request_id!r} with n={n}: its child id {core_id!r} "
                                 "is already in use on this engine")
        collector = RequestOutputCollector(params, self.stream_interval)
        self._streams[request_id] = (collector, core_ids)
        # The request's own id too: a refusal of n > 1 comes back under it.
        for i, core_id in enumerate(dict.fromkeys([*core_ids, request_id])):
            self._routes[core_id] = (collector, i)
        seqs = [_Sequence(i, params) for i in range(n)]
        final: dict[int, CompletionOutput] = {}  # FINAL_ONLY with n > 1: the finished children
        finished = False
        try:
            self.engine_core.add_request(AddRequest(request_id, tokens, params))
            while not finished:
                try:
                    deltas = await collector.get()
                except (ValueError, TypeError, KeyError, EngineDeadError):
                    finished = True  # refused (nothing recorded), or the engine is gone
                    raise
                completions = [c for i, d in sorted(deltas.items())
                               if (c := self._completion(seqs[i], d, params, request_id, tokens, text)) is not None]
                finished = all(seq.finished for seq in seqs)
                if params.output_kind == RequestOutputKind.FINAL_ONLY and n > 1:
                    final.update((c.index, c) for c in completions)
                    if not finished:
                        continue
                    completions = [final[i] for i in range(n)]
                if completions:
                    yield RequestOutput(request_id, tokens, completions, finished, text)
        finally:
            del self._streams[request_id]
            for core_id in (*core_ids, request_id):
                self._routes.pop(core_id, None)
            if not finished and self._dead is None:  # cancelled, or the consumer left
                self.engine_core.abort(core_ids)

    def _completion(self, seq: _Sequence, d: Delta, params: SamplingParams, request_id: str,
                    prompt_token_ids: list[int], text: str | None) -> CompletionOutput | None:
        """One engine request's completion for what it sent (None: FINAL_ONLY, not done)."""
        seq.tokens += d.tokens
        if seq.logprobs is not None and d.logprobs:
            seq.logprobs += d.logprobs
        if seq.top is not None and d.top:
            seq.top += d.top
        seq.finished = d.finish_reason is not None
        decode = self.tokenizer.decode
        if d.stop_reason is not None:  # the text is cut at the stop string, as LLM's
            decode = stop_decoder(decode, params, seq.tokens, d.stop_reason)
        out = build_request_output(params.output_kind, request_id, prompt_token_ids, seq.tokens, len(d.tokens),
                                   seq.logprobs, d.finish_reason, decode, text, seq.top, d.stop_reason)
        if out is None:
            return None
        completion = out.outputs[0]
        completion.index = seq.index
        return completion

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (on the tape); their streams end with finish_reason 'abort'.
        Unknown or finished ids are ignored."""
        self._ensure_started()
        self._check_alive()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for i in ids:
            check_str("request_id", i)
        # A request of n > 1 is its children on the engine.
        self.engine_core.abort([c for i in ids for c in (self._streams[i][1] if i in self._streams else [i])])

    # -- engine calls ---------------------------------------------------------------------------

    async def _call(self, method: str, *args: Any) -> Any:
        self._ensure_started()
        self._check_alive()
        return await self.engine_core.call(method, *args)

    async def pause_generation(self, *, mode: str = "keep", clear_cache: bool = True) -> None:
        """Pause as vLLM does ("abort", "wait" or "keep"); returns once the engine has
        drained, with the drained tokens already handed to their streams."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call("pause_generation", mode, bool(clear_cache))

    async def resume_generation(self) -> None:
        await self._call("resume_generation")

    async def is_paused(self) -> bool:
        return bool(await self._call("is_paused"))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self._call("reset_prefix_cache", bool(reset_running_requests)))

    async def update_weights(self, weights: Mapping[str, Any] | str | os.PathLike[str]) -> str:
        """Load new weights (a state_dict or a checkpoint folder) while paused; returns their
        content hash, which goes on the tape. Refused without any change on a bad update."""
        if isinstance(weights, (str, os.PathLike)):
            arg: Any = os.fspath(weights)
        elif isinstance(weights, Mapping):
            arg = weights if isinstance(self.engine_core, InprocClient) else _state_dict_bytes(weights)
        else:
            raise TypeError(f"update_weights takes a state_dict or a checkpoint folder, got {shown(weights)}")
        return str(await self._call("update_weights", arg))

    # -- lifetime -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Abort what is left, close the tape (in the core) and stop the core. Idempotent."""
        self.engine_core.shutdown()
        self._fail_all("the engine was shut down")

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()


def _state_dict_bytes(weights: Mapping[str, Any]) -> bytes:
    """A state_dict as safetensors bytes, to cross the process boundary (tied tensors are
    copied apart: safetensors refuses shared storage)."""
    import torch
    from safetensors.torch import save

    tensors = {}
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"update_weights: {name!r} is not a tensor ({shown(t)}); nothing was changed")
        tensors[name] = t.detach().to("cpu").contiguous().clone()
    return save(tensors)
