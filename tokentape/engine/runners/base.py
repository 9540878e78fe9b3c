"""What the scheduler hands a model runner, and what every runner must do with it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokentape.events.schema import FrameEntry, SamplingParams


@dataclass(slots=True)
class RunnerEntry:
    """One request's share of a step, with the token ids the runner cannot know by itself."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    epoch: int
    num_computed_before: int
    num_new_tokens: int
    num_spec_tokens: int
    # Confirmed tokens the step computes. For a request (re)entering the batch they start at
    # position 0, so the runner can rebuild its own copy; decodes carry none, their input is
    # the token the runner sampled in the previous step (vLLM fills it on the GPU).
    token_ids: list[int]
    is_new: bool
    samples: bool


@dataclass(slots=True)
class ScheduledBatch:
    step: int
    entries: list[RunnerEntry]
    finished_req_ids: list[str] = field(default_factory=list)


class ModelRunner(Protocol):
    model_id: str
    eos_token_id: int | None
    vocab_size: int

    def submit(self, batch: ScheduledBatch) -> None:
        """Start executing a step. Steps execute in the order they are submitted."""

    def collect(self, step: int) -> list[FrameEntry]:
        """Wait for the oldest submitted step, which must be `step`, and return its frame."""

    def close(self) -> None: ...
