"""`LLM`: vLLM's offline entry point. Builds an engine, a runner and a tape, and generates."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Sequence
from typing import Self

import msgspec

from tokentape.engine.config import ORACLE_MODELS, EngineConfig
from tokentape.engine.kv_cache_size import with_kv_cache
from tokentape.engine.llm_engine import LLMEngine, make_header
from tokentape.engine.outputs import CompletionOutput, RequestOutput
from tokentape.engine.parallel_sampling import child_request_id
from tokentape.engine.runners.base import ModelRunner
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.engine.scenario import Scenario
from tokentape.engine.stop_strings import stop_text
from tokentape.engine.tokenizer import ByteTokenizer, MissingTokenizer, Tokenizer
from tokentape.events.schema import RequestOutputKind, SamplingParams
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.events.state import RequestState
from tokentape.events.store import MemoryTape, NullTape, TapeWriter
from tokentape.events.validation import check_str, short_repr, shown
from tokentape.progress import RequestProgress

TapeSpec = str | os.PathLike[str] | None | bool

# Called with every new LLM. The postmortem's pytest plugin (--tokentape-dir) uses it to keep
# the tape of every engine a failing test created.
LLM_CREATED_HOOKS: list[Callable[[LLM], None]] = []


def make_runner(config: EngineConfig) -> ModelRunner:
    """The oracle for 'oracle'/'oracle-random'; otherwise the real model: a built-in name
    ('tiny', 'qwen3-0.6b', weights drawn from the engine seed) or a checkpoint folder."""
    if config.model in ORACLE_MODELS:
        return OracleRunner(
            cyclic=config.model == "oracle",
            seed=config.seed,
            prompt_lookup_max=config.prompt_lookup_max,
            prompt_lookup_min=config.prompt_lookup_min,
        )
    from tokentape.engine.model.loader import check_model_folder
    from tokentape.engine.runners.model_runner import build_model_runner

    check_model_folder(config.model)  # "no such folder" rather than "unknown model"
    return build_model_runner(config)


def check_tape_path(tape: TapeSpec) -> None:
    """Refuse a tape path that cannot be created, naming it and why: cheap, so it runs before
    the model is built. (SQLiteTape checks again when it creates the file.)"""
    if tape is None or tape is False:
        return
    if tape is True:
        raise ValueError("tape=True is ambiguous: pass a file path, None (memory) or False (off)")
    if not isinstance(tape, (str, os.PathLike)):
        raise TypeError(
            f"tape must be a file path, None (memory) or False (off), got {shown(tape)}"
        )
    path = os.fspath(tape)
    if not isinstance(path, str):
        raise TypeError(f"tape must be a str path, got {shown(path)}")
    if not path or "\0" in path:
        raise ValueError(f"tape must be a file path, got {short_repr(path)}")
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"tape path {short_repr(path)} cannot be encoded for the file system: {exc.reason}"
        ) from None
    what = f"{path}: cannot create the tape"
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what}: it is a directory; pass a file path inside it")
    if os.path.lexists(path):
        raise FileExistsError(f"{path}: a tape already exists here; choose a new path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise FileNotFoundError(f"{what}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"{what}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{what}: directory {parent} is not writable")


def open_tape_writer(tape: TapeSpec, config: EngineConfig, runner: ModelRunner) -> TapeWriter:
    """A path means an SQLite tape file, None an in-memory tape, False no tape at all."""
    check_tape_path(tape)
    header = make_header(config, runner)
    if tape is None:
        return MemoryTape(header)
    if tape is False:
        return NullTape(header)
    try:
        return SQLiteTape(tape, header)  # type: ignore[arg-type]
    except sqlite3.Error as exc:  # a path the checks above passed but SQLite could not open
        raise OSError(f"{os.fspath(tape)}: cannot create the tape: {exc}") from exc


class LLM:
    """Generate with an event-sourced engine.

    >>> llm = LLM(model="oracle", tape=None)
    >>> outs = llm.generate(["Hello"], SamplingParams(max_tokens=4))
    >>> len(outs[0].outputs[0].token_ids)
    4
    """

    def __init__(
        self, model: str = "tiny", *, tape: TapeSpec = None, **engine_args: object
    ) -> None:
        self.config = EngineConfig(model=model, **engine_args)  # type: ignore[arg-type]
        self.config.check_runnable()  # before the model is built
        check_tape_path(tape)  # before the model is built: a bad path fails in milliseconds
        runner = make_runner(self.config)
        self.tokenizer: Tokenizer = getattr(runner, "tokenizer", None) or ByteTokenizer()
        try:
            self.config = with_kv_cache(self.config, runner)  # blocks, max_model_len, logged
            writer = open_tape_writer(tape, self.config, runner)
        except BaseException:
            runner.close()
            raise
        # A checkpoint without tokenizer.json: the engine gets none, so it refuses stop
        # strings and string bad words rather than look for them in empty text.
        engine_tokenizer = None if isinstance(self.tokenizer, MissingTokenizer) else self.tokenizer
        try:
            self.engine = LLMEngine(self.config, runner, writer, engine_tokenizer)
        except BaseException:
            # Leave nothing behind: no writer process, no tape holding a header and no run.
            runner.close()
            writer.close()
            if writer.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(writer.path)
            raise
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
        use_tqdm: bool = True,
        *,
        scenario: Scenario | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs come back in the order of the prompts.

        `use_tqdm`: a progress bar on stderr, as vLLM's, drawn only when stderr is a terminal.
        `scenario`: engine calls (pause and resume, prefix-cache resets, aborts) made at given
        steps of the run (tokentape.engine.scenario); the request ids are "0", "1", ... in
        the order of the prompts on a fresh LLM."""
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
        # Every request is checked before the first is added: a bad prompt adds none of them.
        requests = []
        first_id = self._next_id
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                tokens = self._prompt_token_ids(i, prompt)
                req_id = self._new_request_id()
                self.engine.check_request(req_id, tokens, params)
                # As vLLM's LLM does: the caller gets the whole output at the end, so the engine
                # builds none before (a copy of every stream at every step otherwise).
                final_only = msgspec.structs.replace(
                    params, output_kind=RequestOutputKind.FINAL_ONLY
                )
                requests.append((req_id, tokens, final_only))
            if scenario is not None:
                scenario.check_requests([r[0] for r in requests])
        except BaseException:
            self._next_id = first_id  # nothing was added: the ids are still free
            raise
        with self.engine.one_commit():  # one call: one commit on the tape
            for req_id, tokens, params in requests:
                self.engine.add_request(req_id, tokens, params)
        return self._run_to_completion(
            [r[0] for r in requests], [r[2].n for r in requests], prompts, use_tqdm, scenario
        )

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
        requests = self.engine.state.requests
        # A parent of n > 1 leaves its children "0_<id>", ... on the engine, not its own id.
        while str(self._next_id) in requests or f"0_{self._next_id}" in requests:
            self._next_id += 1
        self._next_id += 1
        return str(self._next_id - 1)

    def _run_to_completion(
        self,
        ids: list[str],
        ns: list[int],
        prompts: Sequence[object],
        use_tqdm: bool,
        scenario: Scenario | None,
    ) -> list[RequestOutput]:
        wanted = set(ids)
        finished: set[str] = set()
        engine = self.engine
        requests = engine.state.requests
        # The engine's requests behind each output: the request, or a parent's n children.
        members = [
            [i] if n == 1 else [child_request_id(c, i) for c in range(n)] for i, n in zip(ids, ns)
        ]

        def output_tokens() -> int:  # asked for only when the bar is redrawn
            return sum(len(requests[m].output_token_ids) for ms in members for m in ms)

        with RequestProgress(len(ids), enabled=use_tqdm) as bar:
            while len(finished) < len(ids) and engine.has_unfinished_requests():
                if scenario is not None:
                    scenario.apply_due(engine)
                for out in engine.step():  # every request's final output comes, whatever its kind
                    if out.finished and out.request_id in wanted:
                        finished.add(out.request_id)
                bar.update(len(finished), output_tokens)
            # A request that stops on a token leaves the steps scheduled after it in flight;
            # with nothing else to run, collect their frames so the tape ends complete (else
            # the postmortem reads the run as one stopped mid-run: tape_truncated).
            state = engine.state
            while state.in_flight_steps and not (state.waiting or state.running):
                engine.step()
            bar.update(len(finished), output_tokens, force=True)
        engine.tape.flush()  # the run is complete in the tape file when generate returns
        results = []
        for req_id, ms, prompt in zip(ids, members, prompts):
            # Every token the engine delivered (OutputsEmitted is on the tape), whatever the
            # request's output kind: the state holds them.
            completions = [
                self._completion(index, engine.state.requests[m]) for index, m in enumerate(ms)
            ]
            results.append(
                RequestOutput(
                    req_id,
                    requests[ms[0]].prompt_token_ids,
                    completions,
                    req_id in finished,
                    prompt=prompt if isinstance(prompt, str) else None,
                )
            )
        return results

    def _completion(self, index: int, req: RequestState) -> CompletionOutput:
        toks = list(req.output_token_ids)
        lps = list(req.output_logprobs) if req.params.logprobs is not None else None
        top = list(req.output_top_logprobs) if req.params.logprobs else None
        text = (
            stop_text(self.tokenizer.decode, req.params, toks, req.stop_str)
            if req.stop_str
            else self.tokenizer.decode(toks)
        )
        return CompletionOutput(index, text, toks, req.finish_reason, lps, None, top, req.stop_str)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
