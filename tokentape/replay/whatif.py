"""what-if replay: run a tape's recorded commands again under another configuration.

The commands are the client's calls, as recorded: `RequestAdded`, `RequestAborted`,
`GenerationPaused`, `GenerationResumed`, `PrefixCacheReset`, `WeightsUpdated`, the sleep
mode's `EngineSlept` (after the pause a sleep starts with) and `EngineWokeUp`, and the LoRA
adapters' `LoRAAdded` (loaded again from the recorded folder, which must still hold the
adapter of the recorded SHA-256) and `LoRARemoved`. A
`CollectiveRPC` is not repeated (its code is not on the tape): noted, or refused with the
model when it changed the weights. Each is
issued to a fresh engine at the step it was recorded at (the engine is stepped until it
reaches that step, or has nothing left to do), and the engine runs to completion afterwards.
Events that a pause causes (its aborts under `mode="abort"`, its prefix-cache reset under
`clear_cache=True`) and the resume a full wake-up causes are not commands: the new engine
makes its own.

The configuration is the tape header's, with the discard policy and the pipeline depth
changed as asked; the runner is, by default, the one that recorded the tape (the oracle for
an oracle tape, else the model the header names), or the one asked for. A weight update
names its weights but the tape does not hold them: the oracle skips it (its tokens do not
depend on weights; the result notes it), the model refuses the run. The new run is
recorded on its own tape, and `diff` compares its client-visible output with the recording.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokentape.engine.config import EngineConfig
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.factory import ORACLE_MODELS, build_engine_core, make_runner
from tokentape.engine.runners.base import ModelRunner
from tokentape.errors import LoRAError
from tokentape.events import schema as ev
from tokentape.events.snapshot import for_recompute
from tokentape.events.store import MemoryTape
from tokentape.replay.diff import TapeDiff, TapeSource, diff
from tokentape.replay.tape import Tape, load_tape
from tokentape.replay.verify import issue_command, replay_config, tape_tokenizer

RUNNERS = ("oracle", "model")
DEFAULT_MODEL = "tiny"  # the real model served when the tape was recorded with the oracle


class WhatIfError(ValueError):
    """The what-if run cannot be set up or cannot replay one of the recorded commands."""


@dataclass(slots=True)
class WhatIfResult:
    config: EngineConfig  # what the new run used
    tape: Tape  # the new run's tape
    diff: TapeDiff  # the recording (A) against the new run (B)
    notes: list[str] = field(default_factory=list)  # recorded commands that were not repeated


def recorded_runner(tape: Tape) -> str:
    """The runner that recorded the tape: what a what-if replays with unless told otherwise."""
    return "oracle" if tape.config.model in ORACLE_MODELS else "model"


def whatif_config(
    tape: Tape,
    discard_policy: str | None = None,
    pipeline_depth: int | None = None,
    runner: str | None = None,
) -> EngineConfig:
    """The header's config with the changes applied (runner None: the recorded one)."""
    runner = recorded_runner(tape) if runner is None else runner
    if runner not in RUNNERS:
        raise WhatIfError(f"unknown runner {runner!r}: choose one of {', '.join(RUNNERS)}")
    changes: dict[str, Any] = {}
    if discard_policy is not None:
        changes["discard_policy"] = discard_policy
    if pipeline_depth is not None:
        changes["pipeline_depth"] = pipeline_depth
        changes["async_scheduling"] = pipeline_depth > 1
    if "max_logprobs" not in tape.header.config:
        changes["max_logprobs"] = -1  # recorded before the limit: its requests had none
    model = tape.config.model
    if runner == "oracle" and model not in ORACLE_MODELS:
        changes["model"] = "oracle"
    elif runner == "model" and model in ORACLE_MODELS:
        changes["model"] = DEFAULT_MODEL
    try:
        return msgspec.structs.replace(tape.config, **changes)
    except (ValueError, TypeError) as exc:
        raise WhatIfError(f"invalid what-if configuration: {exc}") from None


def on_this_machine(config: EngineConfig, runner: str) -> tuple[EngineConfig, str | None]:
    """The header's config as this machine can run it: CPU threads at most its CPUs, and a
    device it lacks (a tape recorded on CUDA, replayed on a CPU-only laptop) replaced by the
    CPU, with a note saying so; the oracle needs neither."""
    if runner != "model":
        return config, None
    from tokentape.engine.runners.devices import clamped_cpu_threads, device_problem

    config = msgspec.structs.replace(config, cpu_threads=clamped_cpu_threads(config.cpu_threads))
    problem = device_problem(config.device)
    if problem is None:
        return config, None
    note = f"{problem}: replayed on the CPU instead (tokens may differ from the recording's)"
    return msgspec.structs.replace(config, device="cpu"), note


def _make_runner(config: EngineConfig, runner: str) -> ModelRunner:
    try:
        return make_runner(config)
    except ValueError as exc:
        raise WhatIfError(
            f"--runner {runner}: cannot build a runner for model {config.model!r} ({exc})"
        ) from None


def _advance_to(engine: EngineCore, step: int, limit: int, goal: str | None = None) -> None:
    """Step the engine until it is about to schedule `step`, or can do nothing more (left
    paused, or every request finished)."""
    state = engine.state
    for _ in range(limit):
        if state.step >= step or not engine.has_unfinished_requests():
            return
        before = state.num_events
        engine.step()
        if state.num_events == before:  # paused, or nothing schedulable: waiting cannot help
            return
    raise WhatIfError(
        f"the what-if run did not {goal or f'reach step {step}'} within {limit} engine steps"
    )


def _issue(engine: EngineCore, event: ev.Event, runner: str, notes: list[str]) -> None:
    if isinstance(event, ev.CollectiveRPC):
        # Its code and arguments are not on the tape, only what it did to the weights.
        if event.weights_id is not None and runner != "oracle":
            raise WhatIfError(
                f"collective_rpc {event.method!r} at step {event.step} changed the weights; "
                "the tape does not hold its code or the weights, so a run with the model "
                "cannot repeat it (use --runner oracle)"
            )
        notes.append(f"collective_rpc {event.method!r} at step {event.step} not repeated")
        return
    if isinstance(event, (ev.WeightsUpdated, ev.WeightUpdateStarted, ev.WeightChunkReceived)):
        # The tape names the weights (hashes) but does not hold them.
        if runner == "oracle":
            if isinstance(event, ev.WeightsUpdated):  # a transfer's start and chunks: silently
                notes.append(
                    f"weight update to {event.weights_id!r} at step {event.step} skipped: "
                    "the oracle's tokens do not depend on weights"
                )
            return
        raise WhatIfError(
            f"the tape updates the weights at step {event.step} ({ev.kind_of(event)}); the "
            "weights are not on the tape, so a run with the model cannot repeat the update "
            "(use --runner oracle)"
        )
    try:
        issue_command(engine, event)
        if isinstance(event, ev.LoRAAdded):  # loaded again from its folder: the same adapter?
            from tokentape.lora.peft_adapter import check_recorded_adapter  # torch: when used

            loaded = engine.state.loras[event.lora_int_id].adapter_id
            check_recorded_adapter(event.lora_name, event.lora_path, event.adapter_id, loaded)
    except (TypeError, LoRAError) as exc:
        raise WhatIfError(str(exc)) from None
    except ValueError as exc:  # the oracle refuses options it cannot honour (penalties, ...)
        if runner == "oracle" and isinstance(event, ev.RequestAdded):
            raise WhatIfError(f"{exc} (replay with --runner model)") from None
        raise


def recorded_commands(tape: Tape) -> list[ev.Event]:
    """The client's calls on a tape, in order, without the events a pause caused."""
    commands: list[ev.Event] = []
    after_abort_pause = False  # the aborts right after a pause(mode="abort") are its own
    pending_resets = 0  # a pause with clear_cache resets the prefix cache itself, once drained
    after_wake = False  # the resume right after a wake-up is its own
    for _, event in tape.events():
        kind = ev.kind_of(event)
        if after_wake and isinstance(event, ev.GenerationResumed):
            after_wake = False
            continue
        after_wake = isinstance(event, ev.EngineWokeUp)
        if kind not in ev.COMMAND_KINDS:
            if kind != "RequestAborted":
                after_abort_pause = False
            continue
        if isinstance(event, ev.RequestAborted) and after_abort_pause:
            continue
        after_abort_pause = False
        if isinstance(event, ev.PrefixCacheReset) and pending_resets:
            pending_resets -= 1
            continue
        commands.append(event)
        if isinstance(event, ev.GenerationPaused):
            after_abort_pause = event.mode == "abort"
            pending_resets += event.clear_cache
    return commands


def whatif(
    source: TapeSource,
    *,
    discard_policy: str | None = None,
    pipeline_depth: int | None = None,
    runner: str | None = None,
    out: str | os.PathLike[str] | None = None,
) -> WhatIfResult:
    """Re-run the recorded commands under the changed configuration and diff the outputs.

    `runner` is "oracle" or "model"; None replays with the runner that recorded the tape.
    `out` is the new tape's path (an SQLite file, never overwritten); None keeps it in memory.
    """
    original = load_tape(source)
    runner = recorded_runner(original) if runner is None else runner
    config, device_note = on_this_machine(
        replay_config(whatif_config(original, discard_policy, pipeline_depth, runner)), runner
    )
    # The requests' text (their stop strings) is the recording model's, whatever runs them.
    engine = build_engine_core(
        config,
        None if out is None else os.fspath(out),
        runner=_make_runner(config, runner),
        tokenizer=tape_tokenizer(original.header),
    )
    writer = engine.tape
    first = next(original.events(), None)
    if first is not None and isinstance(first[1], ev.EngineSnapshot):
        # A segment: its requests start again from their confirmed tokens (no K/V here).
        num_blocks = engine.config.num_kv_blocks
        assert num_blocks is not None  # resolved by the factory
        engine.restore(for_recompute(first[1], num_blocks))
    # Generous: a changed pipeline may need more steps than the recording, never unboundedly more.
    limit = 10 * len(original) + 10_000
    notes: list[str] = [device_note] if device_note else []
    try:
        for command in recorded_commands(original):
            _advance_to(engine, command.step, limit)
            _issue(engine, command, runner, notes)
        _advance_to(engine, sys.maxsize, limit, "finish")
        engine.tape.flush()
    finally:
        engine.close()
    new = load_tape(writer if isinstance(writer, MemoryTape) else writer.path)  # type: ignore[arg-type]
    return WhatIfResult(config, new, diff(original, new), notes)
