"""The state the reducer derives from a tape: one RequestState per request, one EngineState.

Nothing outside `tokentape.events.reducer` writes these fields. The scheduler and the
engine read them to decide; replay folds a tape into the same structures.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tokentape.events.schema import (
    FinishReason,
    LoRAAdded,
    PauseMode,
    PromptLogprobs,
    SamplingParams,
    ScheduledEntry,
)


# Not StrEnum: str() of a member would change (the value, not "RequestStatus.X"), and the
# module is compiled by mypyc.
class RequestStatus(str, Enum):  # noqa: UP042
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"


FINISHED_STATUS: dict[str, RequestStatus] = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclass(slots=True)
class InFlightStep:
    """A scheduled step whose frame has not come back yet."""

    step: int
    entries: list[ScheduledEntry]  # as recorded in StepScheduled
    requests: list[RequestState]  # the entries' requests, in the same order
    partial: set[str]  # requests whose entry is a prefill chunk short of the end: no token

    def samples(self, entry: ScheduledEntry) -> bool:
        return entry.req_id not in self.partial


@dataclass(slots=True)
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_step: int
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # per output token, when asked
    # Per output token, with logprobs=k > 0: the k most likely token ids -> logprobs.
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # With prompt_logprobs: those of the first frame applied that carried them (later ones,
    # from a recompute, are the same facts again).
    prompt_logprobs: PromptLogprobs | None = None
    num_computed_tokens: int = 0
    # vLLM's counter of output positions scheduled but not yet returned. Under the
    # historical policies it can drift from the truth; the in-flight counts are the truth.
    num_output_placeholders: int = 0
    epoch: int = 0
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Scheduled entries whose frame has not come back, in three kinds (see num_in_flight):
    num_stale_in_flight: int = 0  # scheduled before the latest preemption: frames are stale
    num_fresh_in_flight: int = 0  # current epoch, sampling a token: each yields at least one
    num_partial_in_flight: int = 0  # current epoch, a prefill chunk that samples nothing
    # An entry of the current epoch reached the end of the sequence: from then on the runner
    # holds every confirmed token (it sampled them), and each step is a decode.
    prefill_complete: bool = False
    # Historical discard policies: vLLM's counter (#42117) and flag (before #42117).
    async_tokens_to_discard: int = 0
    discard_latest_async_tokens: bool = False
    # `deliver` (vLLM since #48245): the stale frames in flight are dropped, not delivered.
    drop_stale_output: bool = False
    num_frames_dropped: int = 0  # frames thrown away by the discard policy, stale or not
    num_emitted: int = 0  # output tokens delivered to the client before its pending ones
    finish_reason: FinishReason | None = None  # set when the request finished
    # vLLM's stop_reason: the stop string or stop token id that finished it (RequestFinished).
    stop_reason: str | int | None = None
    # Fixed when the request is added, so the stop check per token is two comparisons.
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids, plus EOS unless ignore_eos
    has_stop_strings: bool = False  # params.stop is not empty
    max_output_tokens: int = 0  # max_tokens, capped by max_model_len
    # The LoRA adapter it runs with (0: none), and that adapter's content hash: its KV
    # differs from the base model's, so its prefix-cache hashes are salted with it.
    lora_int_id: int = 0
    lora_adapter_id: str = ""
    num_prompt_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Confirmed tokens: prompt plus delivered output, never placeholders."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end], without building the whole list."""
        p = self.num_prompt_tokens
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_in_flight(self) -> int:
        return self.num_stale_in_flight + self.num_fresh_in_flight + self.num_partial_in_flight

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None  # set exactly when the request finishes


@dataclass(slots=True)
class EngineState:
    discard_policy: str
    async_scheduling: bool = True  # the discard policies act only when steps can be in flight
    eos_token_id: int | None = None
    max_model_len: int = 1 << 62
    faults: frozenset[str] = frozenset()  # reducer faults (tokentape.events.faults), tests only
    # The reducer's handler per event type, the faults' among them (reducer.initial_state).
    handlers: dict[type, Callable[[EngineState, Any], None]] = field(default_factory=dict)
    step: int = 0  # the number of steps scheduled so far; the next step's number
    paused: PauseMode | None = None
    requests: dict[str, RequestState] = field(default_factory=dict)
    waiting: deque[str] = field(default_factory=deque)
    running: list[str] = field(default_factory=list)
    in_flight_steps: deque[InFlightStep] = field(default_factory=deque)
    # Requests with tokens or a finish the client has not been given yet, in order.
    pending_output: dict[str, None] = field(default_factory=dict)
    # The requests the latest frame added tokens to, each with its output length before the
    # frame: where the scheduler's stop check begins (Scheduler.update_from_output).
    frame_outputs: list[tuple[RequestState, int]] = field(default_factory=list)
    num_prefix_cache_resets: int = 0
    weights_id: str | None = None  # the SHA-256 of the latest update; None: the initial weights
    # vLLM's weight_version (#49040): "default" until an update names one; an update without
    # a name is its number ("1", "2", ...). Every token delivered was computed under the
    # version in force when its OutputsEmitted was recorded (an update needs a drained engine).
    weight_version: str = "default"
    num_weight_updates: int = 0
    # A chunked transfer (start_weight_update) not finished yet: the chunks it received so far.
    # None when no transfer is open; resume_generation refuses while one is.
    weight_update_chunks: int | None = None
    # vLLM's sleep mode: the level slept at (None: awake; set by EngineSlept, cleared by the
    # EngineWokeUp that wakes the last tag) and the memory still released (MEMORY_TAGS).
    sleep_level: int | None = None
    sleeping_tags: tuple[str, ...] = ()
    # The LoRA adapters loaded (LoRAAdded, less LoRARemoved), by lora_int_id, in load order.
    loras: dict[int, LoRAAdded] = field(default_factory=dict)
    num_events: int = 0
    error: str | None = None
    recording_stopped: str | None = None  # why another engine's recorder stopped (its last event)

    def in_flight_entries(self, req_id: str) -> list[tuple[int, ScheduledEntry]]:
        """(step, entry) for each of the request's entries still in flight, oldest first."""
        return [(s.step, e) for s in self.in_flight_steps for e in s.entries if e.req_id == req_id]

    def lora_users(self, lora_int_id: int) -> list[str]:
        """The unfinished requests that run with LoRA adapter `lora_int_id`, in order."""
        return [
            r.req_id
            for r in self.requests.values()
            if r.lora_int_id == lora_int_id and not r.is_finished
        ]

    @property
    def unfinished(self) -> list[RequestState]:
        return [r for r in self.requests.values() if not r.is_finished]
