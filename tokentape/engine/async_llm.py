"""AsyncLLM: vLLM V1's asyncio API. The engine core (engine, scheduler, runner, tape) runs in
a background process by default; this frontend sends it requests and turns the deltas it
gets back into each request's outputs with the one output processor (output_processor.py),
as vLLM's AsyncLLM does.

    engine = AsyncLLM(model="oracle", tape="run.tape")
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "r1"):
        print(out.outputs[0].text)
    engine.shutdown()

Cancelling a consumer (or leaving its loop) aborts its request, and the abort is on the tape.
`multiprocess_mode=False` steps the same engine core inside the event loop (for debugging).

Here: the engine-facing API (requests, routing of the processor's outputs, engine calls,
lifetime). Per request, `output_collector.py` buffers the outputs its consumer has not taken;
`frontend_inputs.py` prepares prompts and weights.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import Any, Self

import msgspec

from tokentape.engine.arg_utils import UsageContext
from tokentape.engine.config import EngineConfig
from tokentape.engine.core.call_args import (
    check_pause_mode,
    check_sleep_args,
    check_wake_tags,
    resolve_version,
)
from tokentape.engine.core.client import CoreClient, InprocClient, MPClient
from tokentape.engine.core.messages import (
    AddRequest,
    CoreDead,
    CoreMessage,
    CoreOutputs,
    SchedulerStats,
    rebuild_error,
)
from tokentape.engine.frontend_inputs import (
    PromptType,
    check_prompt_tokens,
    frontend_tokenizer,
    prompt_token_ids,
    state_dict_bytes,
)
from tokentape.engine.output_collector import RequestOutputCollector
from tokentape.engine.output_processor import OutputProcessor
from tokentape.engine.outputs import RequestOutput
from tokentape.engine.parallel_sampling import child_request_id
from tokentape.engine.weight_transfer import check_update_info, is_update_info
from tokentape.errors import EngineDeadError
from tokentape.events.schema import SamplingParams
from tokentape.events.segment_dir import SegmentedTapeSpec
from tokentape.events.segmented_store import record_engine_death
from tokentape.events.tape_path import TapeSpec, check_tape_path, with_tape_dir
from tokentape.events.validation import check_int, check_str, shown
from tokentape.extras import require_extra
from tokentape.lora.request import LoRARequest

__all__ = ["AsyncLLM", "PromptType", "frontend_tokenizer"]


class AsyncLLM:
    """vLLM's AsyncLLM over tokentape's engine. Takes LLM's engine arguments; `usage_context`
    (vLLM's) says whose defaults the arguments not given take (arg_utils.create_engine_config):
    the engine's, or for `serve`, vLLM's server's on the CPU."""

    def __init__(
        self,
        model: str = "tiny",
        *,
        tape: TapeSpec = None,
        tape_dir: str | os.PathLike[str] | None = None,
        multiprocess_mode: bool = True,
        stream_interval: int = 1,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        **engine_args: Any,
    ) -> None:
        EngineConfig(model=model, **engine_args)  # a bad argument fails here, before any process
        tape = with_tape_dir(tape, tape_dir)
        check_tape_path(tape)
        self._tape = tape
        self._death_record: threading.Thread | None = None  # writes how a dead core ended
        check_int("stream_interval", stream_interval, 1)
        if multiprocess_mode:  # the engine core process talks ZMQ: the `serve` extra
            require_extra("serve", "AsyncLLM's engine core process", "zmq")
        # Tokens per output after a stream's first (vLLM's --stream-interval): how outputs are
        # grouped for the consumer, after the engine; nothing on the tape changes.
        self.stream_interval = stream_interval
        self.model = model
        self.tokenizer = frontend_tokenizer(model)
        client_cls = MPClient if multiprocess_mode else InprocClient
        # The config is made where the engine runs (arg_utils.create_engine_config): some
        # defaults depend on the device, which only the core, loading torch anyway, asks.
        self.engine_core: CoreClient = client_cls(model, tape, dict(engine_args), usage_context)
        info = self.engine_core.info
        self.model_id, self.vocab_size, self.max_model_len = (
            info.model_id,
            info.vocab_size,
            info.max_model_len,
        )
        self.tape_path: str | None = info.tape_path
        self.stats = SchedulerStats()
        self.output_processor = OutputProcessor(self.tokenizer, stream_interval)
        # By request id: its collector and the engine requests behind it (itself, or its n
        # children).
        self._streams: dict[str, tuple[RequestOutputCollector, list[str]]] = {}
        self._engine_ids: set[str] = set()  # every engine request id of those
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        # Why the engine core failed while serving (None: it did not; a shutdown is no
        # failure), and who wants to know at once (a server stops taking requests).
        self.failure: str | None = None
        self.failure_callbacks: list[Callable[[str], None]] = []

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
            streams = self._streams
            deltas = msg.outputs
            if any(out.error is not None for out in deltas):
                for out in deltas:  # a refusal comes back under the request's own id
                    if out.error is not None and out.request_id in streams:
                        streams[out.request_id][0].fail(rebuild_error(out.error))
                deltas = [out for out in deltas if out.error is None]
            outputs = self.output_processor.process_outputs(deltas)
            if msg.utility is not None and self.stream_interval > 1:
                outputs += self.output_processor.flush()  # a pause's drained tokens go out first
            for output in outputs:
                stream = streams.get(output.request_id)
                if stream is not None:
                    stream[0].put(output)
            if msg.utility is not None:
                self.engine_core.resolve(msg.utility.call_id, msg.utility.result, msg.utility.error)
        elif isinstance(msg, CoreDead):
            self._core_failed(msg.message)

    def _core_failed(self, reason: str) -> None:
        """The core died while serving: every stream and call ends with EngineDeadError."""
        first = self._dead is None
        self._fail_all(reason)
        if first:
            self.failure = reason
            if isinstance(self._tape, SegmentedTapeSpec):  # the flight recorder says how
                self._death_record = threading.Thread(
                    target=record_engine_death,
                    args=(self._tape.directory, reason),
                    name="tokentape-death-record",
                )
                self._death_record.start()
            for callback in self.failure_callbacks:
                callback(reason)

    def _fail_all(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        exc = EngineDeadError(f"the engine cannot serve any more: {reason}")
        for collector, _ in self._streams.values():
            collector.fail(exc)
        self.engine_core.fail_calls(exc)

    # -- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs; the last has `finished=True`. The engine checks the
        request before recording anything: a refused one raises here (ValueError, TypeError;
        LoRAError for an adapter that cannot serve). `lora_request`: its LoRA adapter, loaded
        first unless it is loaded already.

        With n > 1 the engine runs n children "{i}_{request_id}" (parallel_sampling.py) and
        this one stream gathers them, as vLLM's: each output holds the completions (index i)
        with something new, FINAL_ONLY one output with all n; finished when all n are."""
        self._ensure_started()
        self._check_alive()
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {shown(params)}")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {shown(lora_request)}")
        check_str("request_id", request_id)
        if request_id in self._streams or request_id in self._engine_ids:
            raise ValueError(f"request id {request_id!r} is already in use on this engine")
        tokens, text = prompt_token_ids(self.tokenizer, prompt)
        self.check_prompt(tokens)
        n = params.n
        core_ids = [request_id] if n == 1 else [child_request_id(i, request_id) for i in range(n)]
        for core_id in core_ids:
            if core_id in self._engine_ids or core_id in self._streams:
                raise ValueError(
                    f"request {request_id!r} with n={n}: its child id {core_id!r} "
                    "is already in use on this engine"
                )
        collector = RequestOutputCollector(params)
        self._streams[request_id] = (collector, core_ids)
        self._engine_ids.update(core_ids)
        self.output_processor.add_request(request_id, tokens, text, params, core_ids)
        finished = False
        try:
            try:
                self.engine_core.add_request(AddRequest(request_id, tokens, params, lora_request))
            except EngineDeadError as exc:  # the core is gone, though its death is not read yet
                self._core_failed(str(exc))
                raise
            except ValueError:
                finished = True  # refused before it reached the core: nothing to abort
                raise
            while not finished:
                try:
                    out = await collector.get()
                except (ValueError, TypeError, KeyError, RuntimeError):
                    finished = True  # refused (nothing recorded), or the engine is gone
                    raise
                finished = out.finished
                yield out
        finally:
            del self._streams[request_id]
            self._engine_ids.difference_update(core_ids)
            self.output_processor.remove_request(request_id)
            if not finished and self._dead is None:  # cancelled, or the consumer left
                try:
                    self.engine_core.abort(core_ids)
                except EngineDeadError as exc:
                    self._core_failed(str(exc))

    def is_streaming(self, request_id: str) -> bool:
        """Whether a request of that id is being streamed (not finished, not aborted)."""
        return request_id in self._streams

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Refuse a prompt the core would refuse (ids outside the vocabulary or past 64 bits,
        empty, too long), here, before anything is sent (ValueError, TypeError)."""
        check_prompt_tokens(prompt_token_ids, self.vocab_size, self.max_model_len)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (on the tape); their streams end with finish_reason 'abort'.
        Unknown or finished ids are ignored."""
        self._ensure_started()
        self._check_alive()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for i in ids:
            check_str("request_id", i)
        # A request of n > 1 is its children on the engine.
        self.engine_core.abort(
            [c for i in ids for c in (self._streams[i][1] if i in self._streams else [i])]
        )

    async def abort_all(self) -> list[str]:
        """Abort every unfinished request (EngineCore.abort_all, on the tape); their streams
        end with finish_reason 'abort'. Returns the ids aborted; [] on a dead engine (a
        server's drain that ran out calls it whatever the engine's state)."""
        if self._dead is not None:
            return []
        return list(await self._call("abort_all"))

    # -- engine calls ---------------------------------------------------------------------------

    async def _call(self, method: str, *args: Any) -> Any:
        self._ensure_started()
        self._check_alive()
        return await self.engine_core.call(method, *args)

    async def pause_generation(self, *, mode: str = "keep", clear_cache: bool = True) -> None:
        """Pause as vLLM does ("abort", "wait" or "keep"); returns once the engine has
        drained, with the drained tokens already handed to their streams."""
        check_pause_mode("pause_generation", mode)
        await self._call("pause_generation", mode, bool(clear_cache))

    async def resume_generation(self) -> None:
        await self._call("resume_generation")

    async def is_paused(self) -> bool:
        return bool(await self._call("is_paused"))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self._call("reset_prefix_cache", bool(reset_running_requests)))

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep (EngineCore.sleep): pause in `mode`, drain, release the memory (level
        1: weights to the host, KV cache dropped; 2: both dropped; 0: nothing). Returns once
        asleep, with the drained tokens already handed to their streams. Requests that
        arrive while it sleeps wait, and are served after the wake-up."""
        check_sleep_args(level, mode)
        await self._call("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up: restore what `tags` name ("weights", "kv_cache"; None: all);
        generation resumes once nothing sleeps."""
        await self._call("wake_up", check_wake_tags(tags))

    async def is_sleeping(self) -> bool:
        """vLLM's: asleep at any level, a pause included."""
        return bool(await self._call("is_sleeping"))

    async def update_weights(
        self,
        weights: Mapping[str, Any] | str | os.PathLike[str],
        weight_version: str | int | None = None,
    ) -> str | None:
        """Load new weights (a state_dict or a checkpoint folder) while paused; returns their
        content hash, which goes on the tape with `weight_version` (default: the update's
        number). Inside a transfer (`start_weight_update`): one chunk, checked and held (None),
        or with weight_transfer_config a bucket's update_info (weight_transfer.py: its
        tensors stay in the trainer's shared memory; only the dict goes to the engine core).
        Refused without any change on a bad update (EngineCore.update_weights)."""
        if isinstance(weights, (str, os.PathLike)):
            arg: Any = os.fspath(weights)
        elif is_update_info(weights):  # a bucket: the small dict crosses, its tensors are in shm
            arg = check_update_info(weights).as_dict()
        elif isinstance(weights, Mapping):
            arg = (
                weights if isinstance(self.engine_core, InprocClient) else state_dict_bytes(weights)
            )
        else:
            raise TypeError(
                f"update_weights takes a state_dict or a checkpoint folder, got {shown(weights)}"
            )
        if weight_version is not None:  # checked here too: a bool would cross as an int
            resolve_version(weight_version, 0)
        weights_id = await self._call("update_weights", arg, weight_version)
        return None if weights_id is None else str(weights_id)

    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any] | None = None) -> None:
        """vLLM's: ready the weight transfer engine (weight_transfer_config), once before the
        training loop; refused without one."""
        if init_info is not None and not isinstance(init_info, Mapping):
            raise ValueError(f"init_info must be a mapping, got {shown(init_info)}")
        await self._call("init_weight_transfer_engine", dict(init_info or {}))

    async def start_weight_update(self) -> None:
        """Open a chunked transfer (vLLM RFC #31848): `update_weights(chunk)` per chunk, then
        `finish_weight_update`; `resume_generation` is refused until then."""
        await self._call("start_weight_update")

    async def finish_weight_update(self, weight_version: str | int | None = None) -> str:
        """Load the transfer's chunks at once, publish `weight_version`; the SHA-256."""
        if weight_version is not None:
            resolve_version(weight_version, 0)
        return str(await self._call("finish_weight_update", weight_version))

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's AsyncLLM.collective_rpc: call `method` on every worker, in the engine core
        (a list of one result). Across the process boundary `method` is a worker method's
        name (worker_extension_cls's among them) and the arguments and results plain values
        (msgpack); in process (multiprocess_mode=False) a function taking the worker first
        works too. On the tape as CollectiveRPC."""
        in_process = isinstance(self.engine_core, InprocClient)
        if not isinstance(method, str) and not in_process:
            raise TypeError(
                "collective_rpc: the engine core runs in another process; pass the name of a "
                "worker method (worker_extension_cls adds methods), not a function"
            )
        call_args = [method, timeout, list(args), dict(kwargs or {})]
        if not in_process:
            try:
                msgspec.msgpack.encode(call_args)
            except TypeError as exc:
                raise TypeError(
                    f"collective_rpc: the arguments cannot travel to the engine core process "
                    f"({exc}); pass plain values (tensors go through shared memory or a file)"
                ) from None
        return list(await self._call("collective_rpc", *call_args))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: load a LoRA adapter in the engine core (False if it is loaded already);
        LoRAError if it cannot serve. On the tape as LoRAAdded."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"add_lora: expected a LoRARequest, got {shown(lora_request)}")
        return bool(await self._call("add_lora", lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: unload a LoRA adapter (False if none has that id). LoRARemoved."""
        return bool(await self._call("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        """vLLM's: the ids of the LoRA adapters loaded."""
        return set(await self._call("list_loras"))

    async def get_weight_version(self) -> str:
        """The version of the weights serving now (vLLM #49040): "default" until an update."""
        return str(await self._call("get_weight_version"))

    # -- lifetime -------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Abort what is left, close the tape (in the core) and stop the core: a core that has
        not stopped after `timeout_s` is told to stop between steps, then killed
        (MPClient.shutdown). Idempotent."""
        self.engine_core.shutdown(timeout_s)
        self._fail_all("the engine was shut down")
        if self._death_record is not None:
            self._death_record.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()
