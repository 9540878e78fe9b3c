"""LLMEngine, as vLLM V1's: the synchronous front end that `LLM` sits on. It holds the input
processing (a text prompt tokenized, a request checked before anything is recorded), the one
OutputProcessor and the engine core, which runs in this process (what vLLM's InprocClient
does). `step()` steps the core and turns its deltas into each request's RequestOutput.

    engine = LLMEngine.from_engine_args(EngineConfig(model="oracle"), tape=None)
    engine.add_request("r1", [5, 6, 7], SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.request_id, out.outputs[0].token_ids)

The engine-level calls (pause and resume, prefix-cache resets, the sleep mode, weight
updates) are the core's, made here as vLLM's LLMEngine makes them through its client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self

from tokentape.engine.config import EngineConfig
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.factory import build_engine_core, runner_tokenizer
from tokentape.engine.output_processor import OutputProcessor
from tokentape.engine.outputs import RequestOutput
from tokentape.engine.tokenizer import Tokenizer
from tokentape.events.schema import SamplingParams
from tokentape.events.tape_path import TapeSpec
from tokentape.lora.request import LoRARequest


class LLMEngine:
    """vLLM's LLMEngine over an in-process EngineCore."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        # The prompts' tokenizer: a checkpoint's own, the byte tokenizer of the built-in
        # models, or one that refuses text (a checkpoint without tokenizer.json).
        self.tokenizer: Tokenizer = runner_tokenizer(engine_core.runner)
        self.output_processor = OutputProcessor(engine_core.tokenizer)

    @classmethod
    def from_engine_args(cls, config: EngineConfig, tape: TapeSpec = None) -> Self:
        """An engine for `config` recording on `tape`, its core built by the engine factory."""
        return cls(build_engine_core(config, tape))

    @property
    def config(self) -> EngineConfig:
        """The engine's settings as it runs (the model's defaults filled in)."""
        return self.engine_core.config

    @property
    def tape_path(self) -> str | None:
        return self.engine_core.tape.path

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Add a request: a text prompt (tokenized here) or its token ids (`prompt_text`: the
        text they came from, for the outputs), with a LoRA adapter or none. Its outputs come
        from `step()`."""
        params = params if params is not None else SamplingParams()
        if isinstance(prompt, str):
            prompt_text, prompt = prompt, self.tokenizer.encode(prompt)
        # The core checks the ids (a sequence of ints in the vocabulary) before it records.
        ids = self.engine_core.add_request(request_id, prompt, params, lora_request)
        self.output_processor.add_request(request_id, list(prompt), prompt_text, params, ids)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: load a LoRA adapter (False if it is loaded already)."""
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's: unload a LoRA adapter (False if none has that id)."""
        return self.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """vLLM's: the ids of the LoRA adapters loaded."""
        return self.engine_core.list_loras()

    def check_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Refuse a request the engine could not serve, before anything is recorded."""
        self.engine_core.check_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (one id or several; a parent of n > 1 aborts its children)."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.engine_core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.get_num_unfinished_requests()

    def one_commit(self) -> contextlib.AbstractContextManager[None]:
        """The calls made inside go to the tape as one commit (EngineCore.one_commit)."""
        return self.engine_core.one_commit()

    # -- stepping ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Step the core once. Returns the outputs of the requests that got tokens or
        finished, each shaped by its `SamplingParams.output_kind` as in vLLM: every token so
        far (CUMULATIVE, the default), the new tokens (DELTA), or nothing until the request
        finishes (FINAL_ONLY)."""
        return self.output_processor.process_outputs(self.engine_core.step())

    # -- engine-level calls --------------------------------------------------------------------

    def pause_generation(self, mode: str = "keep", clear_cache: bool = True) -> None:
        """Pause as vLLM does and return once drained (the drained tokens come with the next
        `step()`): abort, wait or keep; with `clear_cache` the caches are reset once drained."""
        self.engine_core.pause_generation(mode, clear_cache)

    def resume_generation(self) -> None:
        self.engine_core.resume_generation()

    def is_paused(self) -> bool:
        return self.engine_core.is_paused()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache: False while requests hold blocks, unless
        `reset_running_requests` preempts them first."""
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pause in `mode`, drain and release the memory (level 1: weights offloaded, KV cache
        dropped; level 2: both dropped; level 0: scheduling only)."""
        self.engine_core.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `tags` name ("weights", "kv_cache"; None: everything)."""
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def abort_all(self) -> list[str]:
        """Abort every unfinished request; the ids aborted, as they were added."""
        return self.engine_core.abort_all()

    def update_weights(
        self, weights: object, weight_version: str | int | None = None
    ) -> str | None:
        """Load new weights (a state_dict or a folder) while paused, or one chunk of a transfer
        opened by `start_weight_update` (a state_dict, a folder, or with weight_transfer_config
        a bucket's update_info); the new weights' SHA-256 (None for a chunk)."""
        return self.engine_core.update_weights(weights, weight_version)

    def init_weight_transfer_engine(self, init_info: Mapping[str, Any] | None = None) -> None:
        """vLLM's: ready the weight transfer engine (weight_transfer_config), once; then
        `update_weights(update_info)` takes a bucket inside a transfer."""
        self.engine_core.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.engine_core.start_weight_update()

    def finish_weight_update(self, weight_version: str | int | None = None) -> str:
        return self.engine_core.finish_weight_update(weight_version)

    def get_weight_version(self) -> str:
        return self.engine_core.get_weight_version()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's: call a worker method (worker_extension_cls's too) on every worker."""
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def close(self) -> None:
        self.engine_core.close()
