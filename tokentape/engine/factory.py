"""The one engine factory: every caller that needs an engine (`LLMEngine` under `LLM`,
`EngineCoreProc` behind `AsyncLLM` and the server, `replay whatif`, the postmortem's output
check) builds its runner, its tape writer and its EngineCore here, so a model name, a tape
path or a bad argument means the same everywhere.

The model registry is engine/model_registry.py (re-exported here): the oracles and the
built-in models by name; anything else is a checkpoint folder.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sqlite3
from collections.abc import Callable

import msgspec

from tokentape.engine.config import EngineConfig
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.kv_cache_size import with_kv_cache
from tokentape.engine.model_registry import BUILTIN_MODELS, MODEL_HELP, ORACLE_MODELS
from tokentape.engine.runner_defaults import with_runner_defaults
from tokentape.engine.runners.base import HasTokenizer, ModelRunner
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.engine.tokenizer import ByteTokenizer, MissingTokenizer, Tokenizer
from tokentape.events import schema as ev
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.events.store import MemoryTape, NullTape, TapeWriter
from tokentape.events.tape_path import TapeSpec, check_tape_path
from tokentape.version import __version__

__all__ = [
    "BUILTIN_MODELS",
    "ENGINE_CREATED_HOOKS",
    "MODEL_HELP",
    "ORACLE_MODELS",
    "build_engine_core",
    "make_header",
    "make_runner",
    "open_tape_writer",
    "runner_tokenizer",
]

# Called with every engine built here. The postmortem's pytest plugin (--tokentape-dir) uses it
# to keep the tape of every engine a failing test created.
ENGINE_CREATED_HOOKS: list[Callable[[EngineCore], None]] = []


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
    from tokentape.engine.runners.build import build_model_runner

    check_model_folder(config.model)  # "no such folder" rather than "unknown model"
    return build_model_runner(config)


def runner_tokenizer(runner: ModelRunner) -> Tokenizer:
    """The tokenizer of the runner's model: a checkpoint's own, else the byte tokenizer."""
    return runner.tokenizer if isinstance(runner, HasTokenizer) else ByteTokenizer()


def make_header(config: EngineConfig, runner: ModelRunner) -> ev.TapeHeader:
    return ev.TapeHeader(
        format_version=ev.FORMAT_VERSION,
        config=msgspec.to_builtins(with_runner_defaults(config, runner)),  # as the engine runs
        discard_policy=config.discard_policy,
        model_id=runner.model_id,
        seed=config.seed,
        package_version=__version__,
        eos_token_id=runner.eos_token_id,
        vocab_size=runner.vocab_size,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )


def open_tape_writer(tape: TapeSpec, config: EngineConfig, runner: ModelRunner) -> TapeWriter:
    """A path means an SQLite tape file, None an in-memory tape, False no tape at all."""
    check_tape_path(tape)
    header = make_header(config, runner)
    if tape is None:
        return MemoryTape(header)
    if tape is False:
        return NullTape(header)
    assert not isinstance(tape, bool)  # check_tape_path refused True
    try:
        writer: TapeWriter = SQLiteTape(tape, header)  # type: ignore[assignment]  # path: str
        return writer
    except sqlite3.Error as exc:  # a path the checks passed but SQLite could not open
        raise OSError(f"{os.fspath(tape)}: cannot create the tape: {exc}") from exc


def build_engine_core(config: EngineConfig, tape: TapeSpec) -> EngineCore:
    """An engine for `config` recording on `tape`: the cheap checks first (the config, the
    tape path: they fail in milliseconds), then the runner, the KV cache's size from the memory
    budget and max_model_len's default from the model, the tape writer. A failure leaves
    nothing behind: no writer process, no tape holding a header and no run."""
    config.check_runnable()
    check_tape_path(tape)
    runner = make_runner(config)
    try:
        config = with_kv_cache(config, runner)  # blocks, max_model_len, logged
        writer = open_tape_writer(tape, config, runner)
    except BaseException:
        runner.close()
        raise
    # A checkpoint without tokenizer.json: the engine gets none, so it refuses stop strings
    # and string bad words rather than look for them in empty text.
    tokenizer = runner_tokenizer(runner)
    engine_tokenizer = None if isinstance(tokenizer, MissingTokenizer) else tokenizer
    try:
        engine = EngineCore(config, runner, writer, engine_tokenizer)
    except BaseException:
        runner.close()
        writer.close()
        if writer.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(writer.path)
        raise
    for hook in ENGINE_CREATED_HOOKS:
        hook(engine)
    return engine
