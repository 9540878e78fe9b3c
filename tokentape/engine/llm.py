"""`LLM`: vLLM's offline entry point, on an LLMEngine (its core built by the engine factory)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Self

import msgspec

from tokentape.engine.config import EngineConfig
from tokentape.engine.llm_engine import LLMEngine
from tokentape.engine.model_registry import DEFAULT_MODEL
from tokentape.engine.outputs import RequestOutput
from tokentape.engine.parallel_sampling import child_request_id
from tokentape.engine.scenario import Scenario
from tokentape.engine.tokenizer import Tokenizer
from tokentape.events.schema import RequestOutputKind, SamplingParams
from tokentape.events.tape_path import TapeSpec, with_tape_dir
from tokentape.events.validation import check_str, shown
from tokentape.lora.request import LoRARequest
from tokentape.progress import RequestProgress

__all__ = ["LLM", "TapeSpec"]


class LLM:
    """Generate with an event-sourced engine.

    >>> llm = LLM(model="oracle", tape=None)
    >>> outs = llm.generate(["Hello"], SamplingParams(max_tokens=4))
    >>> len(outs[0].outputs[0].token_ids)
    4
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        tape: TapeSpec = None,
        tape_dir: str | os.PathLike[str] | None = None,
        **engine_args: object,
    ) -> None:
        config = EngineConfig(model=model, **engine_args)  # type: ignore[arg-type]
        self.llm_engine = LLMEngine.from_engine_args(config, with_tape_dir(tape, tape_dir))
        self.config = self.llm_engine.config  # with max_model_len's default from the model
        # The prompts' tokenizer (a checkpoint's own; one that refuses text without one).
        self.tokenizer: Tokenizer = self.llm_engine.tokenizer
        self._next_id = 0

    @property
    def engine(self) -> LLMEngine:
        """`llm_engine` (vLLM's name), under the name earlier releases gave it."""
        return self.llm_engine

    @property
    def tape_path(self) -> str | None:
        return self.llm_engine.tape_path

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        scenario: Scenario | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs come back in the order of the prompts.

        `use_tqdm`: a progress bar on stderr, as vLLM's, drawn only when stderr is a terminal.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model), as vLLM's; an adapter not loaded yet is loaded first (add_lora).
        `scenario`: engine calls (pause and resume, prefix-cache resets, aborts) made at given
        steps of the run (tokentape.engine.scenario); the request ids are "0", "1", ... in
        the order of the prompts on a fresh LLM."""
        self.llm_engine.engine_core.check_awake("generate")  # it would wait for ever
        if self.llm_engine.is_paused():
            raise RuntimeError("generate: the engine is paused; call resume_generation() first")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item,assignment]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        # Every request is checked before the first is added: a bad prompt adds none of them.
        requests = []
        first_id = self._next_id
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                tokens = self._prompt_token_ids(i, prompt)
                req_id = self._new_request_id()
                self.llm_engine.check_request(req_id, tokens, params)
                # As vLLM's LLM does: the caller gets the whole output at the end, so the engine
                # builds none before (a copy of every stream at every step otherwise).
                final_only = msgspec.structs.replace(
                    params, output_kind=RequestOutputKind.FINAL_ONLY
                )
                requests.append((req_id, tokens, final_only))
            if scenario is not None:
                scenario.check_requests([r[0] for r in requests])
            # The adapters first (each its own command): one that cannot load adds no request.
            for adapter in dict.fromkeys(x for x in loras if x is not None):
                self.llm_engine.add_lora(adapter)
        except BaseException:
            self._next_id = first_id  # nothing was added: the ids are still free
            raise
        with self.llm_engine.one_commit():  # one call: one commit on the tape
            for (req_id, tokens, params), prompt, lora in zip(requests, prompts, loras):
                text = prompt if isinstance(prompt, str) else None
                self.llm_engine.add_request(
                    req_id, tokens, params, prompt_text=text, lora_request=lora
                )
        return self._run_to_completion([r[0] for r in requests], use_tqdm, scenario)

    def _prompt_token_ids(self, index: int, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            check_str(f"prompts[{index}]", prompt)  # a lone surrogate, before any tokenizer sees it
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise TypeError(
                f"prompts[{index}] must be a string or a list of token ids, got {shown(prompt)}"
            )
        return list(prompt)

    def _new_request_id(self) -> str:
        """The next number not already used on this engine (the engine API may have used some)."""
        requests = self.llm_engine.engine_core.state.requests
        # A parent of n > 1 leaves its children on the engine, not its own id.
        while str(self._next_id) in requests or child_request_id(0, str(self._next_id)) in requests:
            self._next_id += 1
        self._next_id += 1
        return str(self._next_id - 1)

    def _run_to_completion(
        self, ids: list[str], use_tqdm: bool, scenario: Scenario | None
    ) -> list[RequestOutput]:
        """Step until every request has its final output (the output processor's: each is
        FINAL_ONLY), and return them in the order of `ids`."""
        finals: dict[str, RequestOutput] = {}
        wanted = set(ids)
        engine = self.llm_engine
        processor = engine.output_processor

        def output_tokens() -> int:  # asked for only when the bar is redrawn
            return processor.num_output_tokens(ids)

        with RequestProgress(len(ids), enabled=use_tqdm) as bar:
            while len(finals) < len(ids) and engine.has_unfinished_requests():
                if scenario is not None:
                    scenario.apply_due(engine.engine_core)
                for out in engine.step():  # others' outputs too (added by the engine API)
                    if out.finished and out.request_id in wanted:
                        finals[out.request_id] = out
                bar.update(len(finals), output_tokens)
            # A request that stops on a token leaves the steps scheduled after it in flight;
            # with nothing else to run, collect their frames so the tape ends complete (else
            # the postmortem reads the run as one stopped mid-run: tape_truncated).
            state = engine.engine_core.state
            while state.in_flight_steps and not (state.waiting or state.running):
                engine.step()
            bar.update(len(finals), output_tokens, force=True)
        engine.engine_core.tape.flush()  # the run is in the tape file when generate returns
        missing = [i for i in ids if i not in finals]
        if missing:  # cannot happen: a request leaves the engine only finished
            raise RuntimeError(f"generate: requests {missing} ended without a final output")
        return [finals[i] for i in ids]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's LLM.reset_prefix_cache: forget the cached prefixes (recorded on the tape).
        False while requests hold blocks, unless `reset_running_requests` preempts them."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's LLM.sleep (LLMEngine.sleep): pause, drain and release the memory."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's LLM.wake_up (LLMEngine.wake_up): restore what `tags` name (None: all)."""
        self.llm_engine.wake_up(tags)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's LLM.collective_rpc: call `method` on every worker (tokentape runs one: a
        list of one result). `method` is a worker method's name, one of the class given as
        `worker_extension_cls` among them, or a function called with the worker first. On
        the tape as CollectiveRPC (engine/core/engine_core.py)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def close(self) -> None:
        self.llm_engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
