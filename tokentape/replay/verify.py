"""verify: re-run the scheduler against a tape's recorded frames and check every event.

Like Temporal's replayer: the recorded commands (adds, aborts, pauses, resumes, resets,
weight updates, sleeps and wake-ups) are issued again at the same points, a replay runner
hands back the recorded frames instead of running a model, and every event the engine emits
must equal the next recorded one. The first mismatch is reported with the recorded events
around it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec

from tokentape.engine.config import EngineConfig
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.factory import build_engine_core
from tokentape.engine.runners.base import LoadedLoRA, ScheduledBatch, WeightChunk
from tokentape.engine.tokenizer import ByteTokenizer, MissingTokenizer, Tokenizer
from tokentape.events import schema as ev
from tokentape.events.store import MemoryTape, TapeError
from tokentape.lora.request import LoRARequest
from tokentape.replay.divergence import (
    Diverged,
    Divergence,
    RecordedStream,
    VerifyResult,
    header_divergence,
)
from tokentape.replay.tape import Tape, load_tape
from tokentape.replay.verify_recorded import verify_recorded

_E = TypeVar("_E", bound=ev.Event)

__all__ = [
    "Divergence",
    "VerifyResult",
    "check_consistent",
    "header_divergence",
    "issue_command",
    "verify",
]


class _CheckingTape:
    """A tape writer that compares every appended event with the recording."""

    path = None

    def __init__(self, stream: RecordedStream, header: ev.TapeHeader) -> None:
        self.stream = stream
        self.header = header

    def append(self, event: ev.Event) -> None:
        nxt = self.stream.peek()
        if nxt is None:
            raise self.stream.diverged(
                "the replay emitted an event past the end of the tape", event
            )
        if nxt[1] != ev.as_format(event, self.header.format_version):
            raise self.stream.diverged(f"the replay emitted a different {ev.kind_of(event)}", event)
        self.stream.take()

    def commit(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _StreamReplayRunner:
    """Hands back the frame the recording holds next; the engine then re-emits it."""

    def __init__(self, stream: RecordedStream, header: ev.TapeHeader) -> None:
        self.stream = stream
        self.model_id = header.model_id
        self.eos_token_id = header.eos_token_id
        # Other EOS ids are already in each recorded request's stop_token_ids.
        self.extra_eos_token_ids: tuple[int, ...] = ()
        self.vocab_size = header.vocab_size

    def submit(self, batch: ScheduledBatch) -> None:
        pass

    def collect(self, step: int) -> list[ev.FrameEntry]:
        nxt = self.stream.peek()
        if nxt is None or not isinstance(nxt[1], ev.FrameProduced) or nxt[1].step != step:
            raise self.stream.diverged(f"the replay applies the frame of step {step} here", None)
        return nxt[1].entries

    def update_weights(self, weights_id: object) -> str:
        return self._recorded(ev.WeightsUpdated).weights_id

    def stage_weights(self, weights: object) -> WeightChunk:
        chunk = self._recorded(ev.WeightChunkReceived)
        return WeightChunk(chunk.names, chunk.shapes, chunk.hashes)

    def load_staged_weights(self) -> str:
        return self._recorded(ev.WeightsUpdated).weights_id

    def _recorded(self, kind: type[_E]) -> _E:
        """No weights here: the recorded hashes stand for them (the command is next)."""
        nxt = self.stream.peek()
        if nxt is None or not isinstance(nxt[1], kind):
            raise self.stream.diverged(f"the replay loads weights here ({kind.__name__})", None)
        return nxt[1]

    # Sleep mode (runners.base.SleepsMemory): no memory here; a wake-up that rebuilt the
    # weights gives back the hash the recording has.
    def check_sleep(self, level: int) -> None:
        pass

    def sleep(self, level: int) -> None:
        pass

    def wake_up(self, tags: Sequence[str]) -> str | None:
        nxt = self.stream.peek()
        if nxt is None or not isinstance(nxt[1], ev.EngineWokeUp):
            raise self.stream.diverged("the replay wakes the engine up here", None)
        return nxt[1].weights_id

    # LoRA (runners.base.ServesLoRA): no adapters here; the recorded facts stand for them.
    def add_lora(self, lora_int_id: int, lora_path: str, max_rank: int) -> LoadedLoRA:
        lora = self._recorded(ev.LoRAAdded)
        return LoadedLoRA(lora.adapter_id, lora.rank, lora.scaling, lora.target_modules)

    def remove_lora(self, lora_int_id: int) -> None:
        pass

    def restore_lora(self, record: ev.LoRAAdded) -> None:
        pass

    def close(self) -> None:
        pass


def tape_tokenizer(header: ev.TapeHeader) -> Tokenizer:
    """The tokenizer the recording engine had, for requests with stop strings (the only part of
    a replay that reads text): the byte tokenizer of the built-in and oracle models, a
    checkpoint folder's own (loaded when a request asks for it). A MissingTokenizer when the
    folder is gone: a tape with stop strings then fails to replay, saying so."""
    if not os.path.isdir(header.model_id):
        if os.path.isabs(header.model_id):
            return MissingTokenizer(header.model_id)
        return ByteTokenizer()
    return _LazyTokenizer(header.model_id)


class _LazyTokenizer:
    """A checkpoint's tokenizer, loaded on first use (most tapes have no stop strings)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._tok: Tokenizer | None = None

    def _get(self) -> Tokenizer:
        if self._tok is None:
            from tokentape.engine.model.loader import load_tokenizer

            self._tok = load_tokenizer(self.folder) or ByteTokenizer()  # type: ignore[assignment]
        return self._tok  # type: ignore[return-value]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._get().encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self._get().decode(token_ids)


def replay_config(config: EngineConfig) -> EngineConfig:
    """A recorded engine's config as a replay builds it: without its worker extension. A
    replay runs no worker call's code (the tape has what each did), and the extension's
    module need not import where the tape is read (a laptop, a CI box)."""
    return msgspec.structs.replace(config, worker_extension_cls=None)


def recorded_lora_request(record: ev.LoRAAdded) -> LoRARequest:
    """The LoRARequest a recorded adapter was loaded by."""
    return LoRARequest(record.lora_name, record.lora_int_id, record.lora_path)


def issue_command(engine: EngineCore, event: ev.Event) -> None:
    """Make the client call that a recorded command event stands for."""
    match event:
        case ev.RequestAdded(req_id=req_id, prompt_token_ids=prompt, params=params):
            lora = engine.state.loras.get(event.lora_int_id) if event.lora_int_id else None
            engine.add_request(req_id, prompt, params, lora and recorded_lora_request(lora))
        case ev.RequestAborted(req_id=req_id):
            engine.abort_request(req_id)
        case ev.GenerationPaused(mode=mode, clear_cache=clear_cache):
            engine.pause_generation(mode, clear_cache)
        case ev.GenerationResumed():
            engine.resume_generation()
        case ev.PrefixCacheReset(reset_running_requests=reset_running):
            engine.reset_prefix_cache(reset_running)
        case ev.WeightsUpdated(weights_id=weights_id, weight_version=version):
            if engine.state.weight_update_chunks is not None:  # the finish of a transfer
                engine.finish_weight_update(version)
            else:
                engine.update_weights(weights_id, version)
        case ev.WeightUpdateStarted():
            engine.start_weight_update()
        case ev.WeightChunkReceived():
            engine.update_weights(event)  # the replay runner reads the chunk's record
        case ev.EngineSlept(level=level):
            engine.fall_asleep(level)  # its pause is a command of its own, replayed before it
        case ev.EngineWokeUp(tags=tags):
            engine.wake_up(tags)
        case ev.CollectiveRPC():
            engine.replay_rpc(event)  # the call's code is not on the tape: what it did is
        case ev.LoRAAdded():
            engine.add_lora(recorded_lora_request(event))
        case ev.LoRARemoved(lora_int_id=lora_int_id):
            engine.remove_lora(lora_int_id)
        case _:
            raise TypeError(f"cannot replay command {ev.kind_of(event)}")


def _start_or_check(
    engine: EngineCore, stream: RecordedStream, snapshot: ev.EngineSnapshot
) -> None:
    """A segment's snapshot: where the tape begins, the replay starts from it; further on (a
    directory of segments read as one tape), the replay must have reached that very state."""
    if stream.consumed == 0:
        engine.restore(snapshot)  # recorded on the checking tape: the snapshot itself
        return
    mine = engine.snapshot(snapshot.segment, snapshot.seq_offset)
    if mine.restated() != snapshot.restated():
        raise stream.diverged(
            f"the replay's state differs from segment {snapshot.segment}'s snapshot", mine
        )
    stream.take()


class TapeInconsistentError(ValueError):
    """A tape that fails verify's consistency checks, given to a reader that needs a consistent
    one (diff): it would draw conclusions from events that cannot follow each other."""


def check_consistent(
    source: str | os.PathLike[str] | MemoryTape | Tape,
    progress: Callable[[int], None] | None = None,
) -> Tape:
    """The tape, once `verify` passes on it; TapeInconsistentError naming where it fails."""
    tape = load_tape(source)
    result = verify(tape, progress)
    if not result.ok:
        where = (
            result.first_divergence.summary() if result.first_divergence else "it does not replay"
        )
        raise TapeInconsistentError(
            f"{tape.path or '<memory tape>'} is not internally consistent ({where}); "
            "'tokentape replay verify' shows the events around it"
        )
    return tape


def verify(
    source: str | os.PathLike[str] | MemoryTape | Tape,
    progress: Callable[[int], None] | None = None,
) -> VerifyResult:
    """Re-run the scheduler over the tape's frames; ok when every recorded event reproduces.
    These are the tape's consistency checks: `diff` and `postmortem` run them too. A tape that
    cannot be read raises TapeError. `progress`, if given, is called with the number of events
    checked, every 65536 events. A tape recorded from another engine (header `source`, e.g.
    vllm) cannot be re-run on tokentape's scheduler: its recorded decisions are folded and
    checked against its frames and outputs instead (verify_recorded)."""
    tape = load_tape(source)
    if tape.header.source != "tokentape":
        return verify_recorded(tape, progress)
    bad_header = header_divergence(tape)
    if bad_header is not None:
        return VerifyResult(False, 0, bad_header)
    stream = RecordedStream(tape.events(), progress)
    engine = build_engine_core(
        replay_config(tape.config),
        _CheckingTape(stream, tape.header),
        runner=_StreamReplayRunner(stream, tape.header),
        tokenizer=tape_tokenizer(tape.header),
    )
    try:
        while (nxt := stream.peek()) is not None:
            event = nxt[1]
            kind = ev.kind_of(event)
            if isinstance(event, (ev.EngineError, ev.RecordingStopped)):
                return stream.ended_with_error()
            before = stream.consumed
            try:
                if isinstance(event, ev.EngineSnapshot):
                    _start_or_check(engine, stream, event)
                elif isinstance(event, ev.SegmentClosed):
                    stream.take()  # the writer's record that the run goes on: nothing to redo
                elif kind in ev.COMMAND_KINDS:
                    issue_command(engine, event)
                else:
                    engine.step()
            except Diverged:
                raise
            except TapeError:
                raise
            except Exception as exc:
                last = stream.history[-1][1] if stream.history else None
                if (
                    stream.peek() is None
                    and isinstance(last, ev.EngineError)
                    and last.error_type == type(exc).__name__
                    and stream.consumed > before
                ):
                    # The replay failed where the recording did, recording the same EngineError
                    # (an injected fault such as crash_on_aborted_output fails on replay too).
                    return VerifyResult(
                        True, stream.consumed, None, f"{last.error_type}: {last.message}"
                    )
                raise stream.diverged(
                    f"the replay raised {type(exc).__name__}: {exc}", None
                ) from exc
            if stream.consumed == before:
                raise stream.diverged(
                    "the replay emitted nothing where the tape has an event", None
                )
    except Diverged as d:
        nxt = stream.peek()
        if nxt is not None and isinstance(nxt[1], ev.EngineError):
            # The recorded run failed at this point (inside a step: a runner failure the
            # replay runner cannot repeat); everything before it reproduced.
            return stream.ended_with_error()
        return VerifyResult(False, stream.consumed, d.divergence)
    return VerifyResult(True, stream.consumed)
