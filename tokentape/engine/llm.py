"""`LLM`: vLLM's offline entry point. Builds an engine, a runner and a tape, and generates."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from tokentape.engine.config import EngineConfig
from tokentape.engine.llm_engine import LLMEngine, make_header
from tokentape.engine.outputs import CompletionOutput, RequestOutput
from tokentape.engine.runners.base import ModelRunner
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.engine.tokenizer import ByteTokenizer, Tokenizer
from tokentape.events.schema import SamplingParams
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.events.store import MemoryTape, NullTape, TapeWriter

TapeSpec = str | os.PathLike[str] | None | bool

# Called with every new LLM. The postmortem's pytest plugin (--tokentape-dir) uses it to keep
# the tape of every engine a failing test created.
LLM_CREATED_HOOKS: list[Callable[[LLM], None]] = []


def make_runner(config: EngineConfig) -> ModelRunner:
    """The oracle for 'oracle'/'oracle-random'; otherwise the real model: a built-in name
    ('tiny', 'qwen3-0.6b', weights drawn from the engine seed) or a checkpoint folder."""
    if config.model in ("oracle", "oracle-random"):
        return OracleRunner(
            cyclic=config.model == "oracle",
            seed=config.seed,
            prompt_lookup_max=config.prompt_lookup_max,
            prompt_lookup_min=config.prompt_lookup_min,
        )
    from tokentape.engine.runners.model_runner import build_model_runner

    return build_model_runner(config)


def open_tape_writer(tape: TapeSpec, config: EngineConfig, runner: ModelRunner) -> TapeWriter:
    """A path means an SQLite tape file, None an in-memory tape, False no tape at all."""
    header = make_header(config, runner)
    if tape is None:
        return MemoryTape(header)
    if tape is False:
        return NullTape(header)
    if tape is True:
        raise ValueError("tape=True is ambiguous: pass a file path, None (memory) or False (off)")
    return SQLiteTape(tape, header)


class LLM:
    """Generate with an event-sourced engine.

    >>> llm = LLM(model="oracle", tape=None)
    >>> outs = llm.generate(["Hello"], SamplingParams(max_tokens=4))
    >>> len(outs[0].outputs[0].token_ids)
    4
    """

    def __init__(self, model: str = "tiny", *, tape: TapeSpec = None, **engine_args: object) -> None:
        self.config = EngineConfig(model=model, **engine_args)  # type: ignore[arg-type]
        runner = make_runner(self.config)
        self.tokenizer: Tokenizer = getattr(runner, "tokenizer", None) or ByteTokenizer()
        writer = open_tape_writer(tape, self.config, runner)
        self.engine = LLMEngine(self.config, runner, writer, self.tokenizer)
        self._next_id = 0
        for hook in LLM_CREATED_HOOKS:
            hook(self)

    @property
    def tape_path(self) -> str | None:
        return self.engine.tape.path

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs come back in the order of the prompts."""
        if self.engine.is_paused():
            raise RuntimeError("generate: the engine is paused; call resume_generation() first")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts"
                )
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        ids = []
        for tokens, params in zip(token_lists, params_list):
            req_id = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(req_id, tokens, params)
            ids.append(req_id)
        return self._run_to_completion(ids, prompts)

    def _run_to_completion(self, ids: list[str], prompts: Sequence[object]) -> list[RequestOutput]:
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list[float]] = {i: [] for i in ids}
        reasons: dict[str, str | None] = {}
        engine = self.engine
        while len(reasons) < len(ids) and engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id in tokens:
                    tokens[out.request_id].extend(out.outputs[0].token_ids)
                    logprobs[out.request_id].extend(out.outputs[0].logprobs or ())
                    if out.finished:
                        reasons[out.request_id] = out.outputs[0].finish_reason
        engine.tape.flush()  # the run is complete in the tape file when generate returns
        results = []
        for req_id, prompt in zip(ids, prompts):
            req = engine.state.requests[req_id]
            toks = tokens[req_id]
            lps = logprobs[req_id] if req.params.logprobs is not None else None
            completion = CompletionOutput(0, self.tokenizer.decode(toks), toks, reasons.get(req_id), lps)
            results.append(RequestOutput(
                req_id, req.prompt_token_ids, [completion], req_id in reasons,
                prompt=prompt if isinstance(prompt, str) else None,
            ))
        return results

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
