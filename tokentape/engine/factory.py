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
import shutil
import sqlite3
from collections.abc import Callable
from typing import cast

import msgspec

from tokentape.engine.config import EngineConfig, resolve_config
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.fault_hooks import FaultInjectingEngineCore
from tokentape.engine.model_registry import BUILTIN_MODELS, MODEL_HELP, ORACLE_MODELS
from tokentape.engine.runners.base import HasTokenizer, ModelRunner
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.engine.tokenizer import ByteTokenizer, MissingTokenizer, Tokenizer
from tokentape.engine.worker import worker_class
from tokentape.events import schema as ev
from tokentape.events.segment_dir import SegmentedTapeSpec
from tokentape.events.segmented_store import SegmentedTape
from tokentape.events.sqlite_store import SQLiteTape, remove_tape_files
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
    """The header of a tape for an engine running `config`, resolved for `runner`
    (config.resolve_config): the values the engine runs with, never a default left open."""
    if not config.is_resolved:
        raise ValueError("make_header: resolve the config for its runner first (resolve_config)")
    return ev.TapeHeader(
        format_version=ev.FORMAT_VERSION,
        config=msgspec.to_builtins(config),  # resolved: as the engine runs
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
    if isinstance(tape, SegmentedTapeSpec):
        return SegmentedTape(tape, header)
    try:
        writer: TapeWriter = SQLiteTape(tape, header)  # type: ignore[assignment]  # path: str
        return writer
    except sqlite3.Error as exc:  # a path the checks passed but SQLite could not open
        raise OSError(f"{os.fspath(tape)}: cannot create the tape: {exc}") from exc


def build_engine_core(
    config: EngineConfig,
    tape: TapeSpec | TapeWriter,
    *,
    runner: ModelRunner | None = None,
    tokenizer: Tokenizer | None = None,
) -> EngineCore:
    """An engine core for `config` recording on `tape`: the tape path checked first (it fails
    in milliseconds), then the runner (a model's sizes its KV cache from the memory budget),
    the settings resolved for it (config.resolve_config), the tape writer. A failure leaves
    nothing behind: no writer process, no tape holding a header and no run.

    `tape` may be a writer of the caller's own (verify's, which checks every event against
    the recording). `runner`: one the caller built (verify's replay runner, a test's oracle);
    it is closed with the engine. `tokenizer`: the tokenizer of the model the requests were
    written for, when it is not the runner's (a replay of a checkpoint's tape on the oracle);
    by default the runner's model's own. A MissingTokenizer (a checkpoint without one) leaves
    the engine without text: it refuses stop strings and string bad words."""
    spec, callers_writer = _tape_arg(tape)
    if callers_writer is None:
        check_tape_path(spec)
    worker_class(config.worker_extension_cls)  # a bad extension fails before the model loads
    runner = make_runner(config) if runner is None else runner
    try:
        config = resolve_config(config, runner)  # blocks, depth, max_model_len; logged
        writer = (
            callers_writer
            if callers_writer is not None  # not `or`: an empty MemoryTape is falsy
            else open_tape_writer(spec, config, runner)
        )
    except BaseException:
        runner.close()
        raise
    if tokenizer is None:
        tokenizer = runner_tokenizer(runner)
    # A checkpoint without tokenizer.json: the engine gets none, so it refuses stop strings
    # and string bad words rather than look for them in empty text.
    text_tokenizer = None if isinstance(tokenizer, MissingTokenizer) else tokenizer
    try:
        # Upstream bugs on purpose (the museum, tests) come with their own engine core.
        core_class = FaultInjectingEngineCore if config.faults else EngineCore
        engine = core_class(config, runner, writer, text_tokenizer)
    except BaseException:
        runner.close()
        if callers_writer is None:  # a tape this build created: closed and removed
            writer.close()
            if writer.path is not None:
                with contextlib.suppress(OSError):
                    if os.path.isdir(writer.path):  # a segmented tape's directory
                        shutil.rmtree(writer.path)
                    else:
                        remove_tape_files(writer.path)
        raise
    for hook in ENGINE_CREATED_HOOKS:
        hook(engine)
    return engine


def _tape_arg(tape: TapeSpec | TapeWriter) -> tuple[TapeSpec, TapeWriter | None]:
    """A tape to open and no writer (a path, None for memory, False for none; check_tape_path
    refuses anything else), or the caller's own writer."""
    if isinstance(tape, (str, os.PathLike, bool)) or not hasattr(tape, "append"):
        return cast(TapeSpec, tape), None
    return None, cast(TapeWriter, tape)
