"""What the scheduler hands a model runner, and what every runner must do with it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tokentape.engine.tokenizer import Tokenizer
from tokentape.events.schema import FrameEntry, LoRAAdded, SamplingParams, ScheduledEntry


def prompt_seed(seed: int, prompt_token_ids: Sequence[int]) -> int:
    """A 64-bit key of (seed, prompt): what a request without its own seed samples with, so
    the same prompt gets the same stream whatever its request id or arrival order."""
    data = seed.to_bytes(8, "little", signed=True) + b"".join(
        t.to_bytes(4, "little") for t in prompt_token_ids
    )
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(slots=True)
class NewRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    # Compute the prompt's logprobs as it is prefilled: it asks (prompt_logprobs) and has
    # none on the tape yet (a request re-entering after a preemption usually has them).
    prompt_logprobs: bool = False
    lora_int_id: int = 0  # the LoRA adapter it runs with (0: none)


@dataclass(slots=True)
class ScheduledBatch:
    """A step as the runner sees it: the recorded entries plus what it cannot know itself."""

    step: int
    entries: list[ScheduledEntry]  # the StepScheduled event's entries
    # Confirmed tokens a prefill computes in this step, by request: from position 0 for a
    # request (re)entering the batch, so the runner rebuilds its copy; from
    # num_computed_before for a later chunk. A decode has none: its input is the token the
    # runner sampled in the previous step (in async mode vLLM fills that placeholder on the
    # GPU), so the runner keeps its own copy of every sequence.
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_requests: dict[str, NewRequest] = field(default_factory=dict)
    partial_prefills: set[str] = field(default_factory=set)  # entries that sample nothing
    finished_req_ids: list[str] = field(default_factory=list)


class ModelRunner(Protocol):
    model_id: str
    eos_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]  # stop requests as stop_token_ids do
    vocab_size: int

    def submit(self, batch: ScheduledBatch) -> None:
        """Start executing a step. Steps execute in the order they are submitted."""

    def collect(self, step: int) -> list[FrameEntry]:
        """Wait for the oldest submitted step, which must be `step`, and return its frame."""

    def close(self) -> None: ...


# A runner's optional capabilities, each a Protocol the engine checks once, when it is built
# (EngineCore.__init__), rather than probing for attributes at every call.


@runtime_checkable
class ChecksParams(Protocol):
    """A runner that cannot honour every sampling option (the oracle: no logits)."""

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError for options it cannot honour; called before a request is
        recorded."""


@dataclass(frozen=True, slots=True)
class WeightChunk:
    """What a chunk of a weight transfer held, as the tape records it: per tensor its name,
    shape and SHA-256 (of its name, dtype, shape and bytes, once cast to the model's dtype)."""

    names: list[str]
    shapes: list[list[int]]
    hashes: list[str]


@runtime_checkable
class UpdatesWeights(Protocol):
    """A runner with weights (the real model; the oracle's, which its tokens ignore), which
    an RL loop may replace while paused: whole, or in chunks (vLLM RFC #31848)."""

    def update_weights(self, weights: object) -> str:
        """Validate every tensor, then load them; the new weights' content hash."""

    def stage_weights(self, weights: object) -> WeightChunk:
        """Validate a chunk (names and shapes against the model) and hold it, loading
        nothing; a refused chunk raises and leaves the held ones as they were."""

    def load_staged_weights(self) -> str:
        """Load every chunk held (a later chunk's tensor replaces an earlier one of the same
        name), forget them; the new weights' content hash."""


@dataclass(frozen=True, slots=True)
class LoadedLoRA:
    """What loading a LoRA adapter found, as LoRAAdded records it."""

    adapter_id: str  # SHA-256 of its files
    rank: int
    scaling: float
    target_modules: list[str]


@runtime_checkable
class ServesLoRA(Protocol):
    """A runner that serves LoRA adapters per request (built with enable_lora)."""

    def add_lora(self, lora_int_id: int, lora_path: str, max_rank: int) -> LoadedLoRA:
        """Read and check the PEFT folder, then load it under `lora_int_id`, after the
        steps submitted; LoRAError (before any change) if it cannot serve."""

    def remove_lora(self, lora_int_id: int) -> None:
        """Unload it, after the steps submitted (no request still runs with it)."""

    def restore_lora(self, record: LoRAAdded) -> None:
        """Load a recorded adapter again (an engine starting from a snapshot); LoRAError if
        its folder no longer holds the adapter recorded."""


@runtime_checkable
class RunsWorkerCalls(Protocol):
    """A runner that runs collective_rpc's calls where its steps run (engine/worker.py)."""

    def run_worker_call(
        self, call: Callable[[], Any], timeout: float | None
    ) -> tuple[Any, BaseException | None, str | None]:
        """Run `call` after the steps submitted, before any later one, waiting up to
        `timeout` seconds (TimeoutError). Its result, the exception it raised (None), and
        the weights' content hash after it when it changed them (None: unchanged)."""


@runtime_checkable
class SleepsMemory(Protocol):
    """A runner with memory for vLLM's sleep mode to release (the real model's weights and
    KV cache); the engine calls it only with nothing in flight."""

    def check_sleep(self, level: int) -> None:
        """Raise (ValueError) if it could not sleep at `level`; called before anything is
        recorded."""

    def sleep(self, level: int) -> None:
        """Level 1: the weights to a host copy and the KV cache freed; level 2: both freed;
        level 0: nothing."""

    def wake_up(self, tags: Sequence[str]) -> str | None:
        """Restore what `tags` name (of "weights", "kv_cache"); the content hash of weights
        rebuilt after a level-2 sleep, else None. Raises before any change if it cannot."""


@runtime_checkable
class HasTokenizer(Protocol):
    """A runner whose model comes with its own tokenizer (a checkpoint's tokenizer.json, or
    one that refuses text when the folder has none); other runners use the byte tokenizer."""

    tokenizer: Tokenizer


@runtime_checkable
class HasModelConfig(Protocol):
    """A runner of a real model, whose config gives the model's context length."""

    config: ModelConfigLike


class ModelConfigLike(Protocol):
    @property
    def derived_max_model_len(self) -> int: ...

    @property
    def context_length_source(self) -> str: ...
