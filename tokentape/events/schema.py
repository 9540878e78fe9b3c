"""The tape's event schema: msgspec tagged structs, encoded as msgpack.

Every event that changes engine or request state is one of the structs below. They are
frozen and array-encoded (positional), so the tape stays small and decoding stays fast.
`docs/tape-format.md` documents every field; bump FORMAT_VERSION on any incompatible change.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec
import msgspec.structs

from tokentape.events.sampling_checks import check_sampling_options
from tokentape.events.validation import check_bool, check_int, check_number, shown

# 2: the sampling options (SamplingParams from `n` on), top-k logprobs in FrameEntry and the
# matched stop string in RequestFinished; every new field is last, with a default, so a
# version-1 tape reads unchanged. 3: min_p and logit_bias in SamplingParams (last, with
# defaults: a version-2 tape reads unchanged). 4: prompt_logprobs in SamplingParams and
# FrameEntry, the position each frame entry was sampled at (FrameEntry.position, default
# -1: unknown), the weight version in WeightsUpdated (each last, with a default: a
# version-3 tape reads unchanged, its updates named by the counter), and the chunked
# transfer's WeightUpdateStarted and WeightChunkReceived, which an older reader cannot
# decode. 5: the sleep-mode events EngineSlept and EngineWokeUp (a version-4 tape reads
# unchanged; a version-4 reader refuses a version 5). 6: RequestFinished says the output's
# length at the finish (num_output_tokens: a frame's tokens after its stop are cut there, no
# longer by the reducer as it applies the frame) and takes vLLM's stop_reason, the stop
# token id too; a version-5 tape reads unchanged, its finishes cut by the stop rule
# (events/stop_check.py), where its reducer cut them. 7: EngineSnapshot, the event a segment of
# a segmented tape opens with (a version-6 tape reads unchanged; a version-6 reader refuses
# a version 7). 8: LoRA adapters: LoRAAdded and LoRARemoved, the adapter a request runs with
# (RequestAdded.lora_int_id, RequestSnapshot.lora_int_id) and the adapters an EngineSnapshot
# holds, each last with a default (a version-7 tape reads unchanged; a version-7 reader
# refuses a version 8).
FORMAT_VERSION = 8

PreemptReason = Literal["kv_pressure", "reset_prefix_cache"]
PauseMode = Literal["abort", "wait", "keep"]
FinishReason = Literal["stop", "length", "abort"]
# vLLM's sleep mode: what a sleep at level >= 1 releases, and the tags wake_up takes
# ("scheduling" wakes a level-0 sleep, which released nothing).
MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache")
WAKE_TAGS: tuple[str, ...] = (*MEMORY_TAGS, "scheduling")
SLEEP_LEVELS: tuple[int, ...] = (0, 1, 2)


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what each output of a request holds."""

    CUMULATIVE = 0  # every token so far (the default)
    DELTA = 1  # only the tokens new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes, with every token


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """vLLM's SamplingParams, reduced to what this engine honours. Validated on creation."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Last, with a default: a tape written before it decodes with CUMULATIVE.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Format 2, vLLM's sampling options, last with defaults (a version-1 tape reads as before).
    n: int = 1  # parallel sampling: the engine fans it out into n requests of n=1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # stop tokens and EOS are masked, and stop strings ignored, until then
    stop: tuple[str, ...] = ()  # stop strings, matched in the detokenized text
    include_stop_str_in_output: bool = False
    # Token-id sequences (the last id is banned after the rest), or strings as vLLM takes them:
    # the engine encodes a string before recording, so a tape holds token ids only.
    bad_words: tuple[str | tuple[int, ...], ...] = ()
    # Format 3: vLLM's min_p, and logit_bias as (token id, bias) pairs in id order (a mapping
    # is accepted, as vLLM's dict, and normalised, so a params object equals its decoded copy).
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Format 4: vLLM's prompt_logprobs (k): the logprob of every prompt token after the first,
    # with the k most likely tokens there. Such a request takes no prefix-cache hits.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Every field must survive the tape's round trip (msgspec decodes strictly: a bool is
        # not an int) and fit in 64 bits; a refused value raises here, before any recording.
        check_int("max_tokens", self.max_tokens, 1)
        # Normalised to float, so that a params object equals its decoded copy from the tape.
        set_field = msgspec.structs.force_setattr
        set_field(self, "temperature", check_number("temperature", self.temperature, 0))
        set_field(self, "top_p", check_number("top_p", self.top_p, 0, 1, lo_open=True))
        check_int("top_k", self.top_k, 0)
        check_int("seed", self.seed, optional=True)
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of token ids, got {shown(stop)}")
        set_field(self, "stop_token_ids", tuple(stop))
        for i, token in enumerate(self.stop_token_ids):
            check_int(f"stop_token_ids[{i}]", token, 0)
        check_bool("ignore_eos", self.ignore_eos)
        check_int("logprobs", self.logprobs, 0, optional=True)
        check_int("prompt_logprobs", self.prompt_logprobs, 0, optional=True)
        kind = self.output_kind
        if type(kind) is not RequestOutputKind:
            check_int("output_kind", kind)
            if kind not in RequestOutputKind._value2member_map_:
                raise ValueError(
                    f"output_kind must be a RequestOutputKind (0, 1 or 2), got {kind!r}"
                )
            set_field(self, "output_kind", RequestOutputKind(kind))
        check_sampling_options(self, set_field)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class TapeHeader(msgspec.Struct, frozen=True):
    """Written once when a tape is created; readers check format_version before anything else."""

    format_version: int
    config: dict[str, Any]
    discard_policy: str
    model_id: str
    seed: int
    package_version: str
    eos_token_id: int | None = None
    vocab_size: int = 0
    created_at: str = ""
    # The engine that made the tape: "tokentape", or "vllm" for a run recorded by
    # tokentape.integrations.vllm; source_version is that engine's version ("" for tokentape's
    # own: package_version says). Last, with defaults: older tapes read as tokentape's own.
    source: str = "tokentape"
    source_version: str = ""
    # What the recorder says of that engine: "untaught release: ..." for a vLLM release it
    # records by its code alone (tokentape/integrations/vllm/releases.py); "" otherwise.
    source_note: str = ""


class Event(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    """Base of every tape event. `step` is the engine step the event belongs to."""

    step: int


# -- commands from the client -------------------------------------------------------------


class RequestAdded(Event, frozen=True, tag="RequestAdded"):
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Format 8: the LoRA adapter it runs with (a LoRAAdded's lora_int_id); 0: the base model,
    # as vLLM's lora_int_id 0 means no adapter.
    lora_int_id: int = 0


class RequestAborted(Event, frozen=True, tag="RequestAborted"):
    req_id: str


class GenerationPaused(Event, frozen=True, tag="GenerationPaused"):
    mode: PauseMode
    clear_cache: bool


class GenerationResumed(Event, frozen=True, tag="GenerationResumed"):
    pass


class PrefixCacheReset(Event, frozen=True, tag="PrefixCacheReset"):
    """Recorded before the preemptions it causes; `ok` is the call's return value."""

    reset_running_requests: bool
    ok: bool


class WeightsUpdated(Event, frozen=True, tag="WeightsUpdated"):
    """New weights serve from here on: a whole update, or the finish of a chunked transfer
    (`finish_weight_update`, when a WeightUpdateStarted is open). `weights_id` is the SHA-256
    of every parameter once loaded."""

    weights_id: str
    # Format 4: vLLM's weight_version, as given or the update's number ("1", "2", ...); ""
    # (a version-3 tape) reads as that number too.
    weight_version: str = ""


class WeightUpdateStarted(Event, frozen=True, tag="WeightUpdateStarted"):
    """`start_weight_update()` (vLLM RFC #31848): chunks follow, then WeightsUpdated."""


class WeightChunkReceived(Event, frozen=True, tag="WeightChunkReceived"):
    """One `update_weights(chunk)` of an open transfer, checked against the model and held
    until the finish: per tensor its name, shape and SHA-256 (the tensors are not taped)."""

    names: list[str]
    shapes: list[list[int]]
    hashes: list[str]


class EngineSlept(Event, frozen=True, tag="EngineSlept"):
    """vLLM's sleep(level): recorded once the pause it starts with (a GenerationPaused, its
    aborts, drained frames and cache reset) is done, when the memory is released: level 1
    offloads the weights and drops the KV cache, level 2 drops both, level 0 releases nothing
    (scheduling only). No step may be scheduled until the engine wakes up."""

    level: int
    in_flight: list[int]  # steps still in flight when the memory went: none in tokentape
    kept: list[str]  # the unfinished requests, kept to be served after the wake-up


class EngineWokeUp(Event, frozen=True, tag="EngineWokeUp"):
    """vLLM's wake_up(tags): `tags` as called (None: everything). Once nothing sleeps, the
    engine records the GenerationResumed that follows."""

    tags: list[str] | None
    # The weights' content hash when a level-2 sleep's weights were rebuilt (None otherwise).
    weights_id: str | None = None


class CollectiveRPC(Event, frozen=True, tag="CollectiveRPC"):
    """Format 7: vLLM's `collective_rpc(method, args, kwargs)` ran on the worker (a method of
    tokentape's worker, or of the `worker_extension_cls` mixed into it). The call's code and
    arguments are not on the tape: a digest of the arguments is. `weights_id` is the
    weights' SHA-256 after the call when it changed them (None: unchanged), so a replay can
    tell which calls changed the weights; `error` is how the method failed ("Type: message";
    the engine serves on)."""

    method: str
    args_digest: str
    weights_id: str | None = None
    error: str | None = None


class LoRAAdded(Event, frozen=True, tag="LoRAAdded"):
    """Format 8: vLLM's add_lora(LoRARequest): a PEFT adapter loaded, under vLLM's name and
    integer id, from `lora_path`. `adapter_id` is the SHA-256 of its files (adapter_config.json,
    then adapter_model.safetensors): a replay that loads the adapter again checks it against
    this. Its rank, scaling and the modules it changes are recorded for the reader."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    adapter_id: str
    rank: int
    scaling: float
    target_modules: list[str]


class LoRARemoved(Event, frozen=True, tag="LoRARemoved"):
    """Format 8: vLLM's remove_lora(lora_int_id): the adapter no longer serves; no request
    still running used it."""

    lora_int_id: int


# -- decisions of the scheduler -----------------------------------------------------------


class ScheduledEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    req_id: str
    epoch: int
    num_computed_before: int
    num_new_tokens: int
    num_spec_tokens: int
    new_block_ids: list[int]


class StepScheduled(Event, frozen=True, tag="StepScheduled"):
    entries: list[ScheduledEntry]


class RequestPreempted(Event, frozen=True, tag="RequestPreempted"):
    req_id: str
    reason: PreemptReason
    in_flight: int  # steps of this request still in flight when it was preempted


class RequestFinished(Event, frozen=True, tag="RequestFinished"):
    req_id: str
    reason: FinishReason
    # vLLM's stop_reason: the stop string (format 2) or the stop token id (format 6) that
    # finished it; None for every other finish, EOS included.
    stop_reason: str | int | None = None
    # Format 6: the output's length at the finish. The frame that reached the stop may carry
    # tokens after it (drafts accepted past a stop token, or past max_tokens): they are cut
    # here. None (older tapes): where the stop rule (events/stop_check.py) says.
    num_output_tokens: int | None = None


def as_format(event: Event, format_version: int) -> Event:
    """`event` as a tape of an older format holds it (what a replay of that tape compares
    with its events): before format 6, a RequestFinished without its output's length, its
    stop_reason only a stop string."""
    if format_version < 6 and isinstance(event, RequestFinished):
        stop = event.stop_reason if isinstance(event.stop_reason, str) else None
        return msgspec.structs.replace(event, stop_reason=stop, num_output_tokens=None)
    return event


# -- facts from the runner and what the client saw ----------------------------------------


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Format 4: the prompt's logprobs (SamplingParams.prompt_logprobs = k), for prompt
    positions 1 .. P-1 (the first token has none, as in vLLM): each prompt token's raw
    log-softmax given the tokens before it, and with k > 0 the k most likely ids there and
    their logprobs (best first, ties: lower id first)."""

    token_logprobs: list[float]
    top_token_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []


# The draft_token_ids of an entry without drafts, shared (never mutated: readers only read),
# so that a decode step does not allocate an empty list per request.
NO_DRAFTS: list[int] = []


class FrameEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    req_id: str
    token_ids: list[int]  # accepted draft tokens followed by one sampled token
    draft_token_ids: list[int] = []  # what the drafter proposed (empty without spec decoding)
    logprobs: list[float] | None = None
    # Format 2, with SamplingParams.logprobs = k > 0: per token, the k most likely token ids
    # and their logprobs (raw log-softmax, best first), beside the sampled token's above.
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # Format 4: the sequence position (prompt + output index) of the first token, as the runner
    # computed it; -1 where unknown (older tapes, vLLM's). Checks that no position is
    # delivered twice (the postmortem's duplicated_token).
    position: int = -1
    # Format 4: on the frame of the prefill chunk that finishes the prompt (and samples the
    # first token), the whole prompt's logprobs; earlier chunks' rows wait in the runner.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


class FrameProduced(Event, frozen=True, tag="FrameProduced"):
    entries: list[FrameEntry]


class EmittedOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    req_id: str
    token_ids: list[int]  # tokens newly delivered to the client
    finished: bool
    finish_reason: FinishReason | None = None


class OutputsEmitted(Event, frozen=True, tag="OutputsEmitted"):
    entries: list[EmittedOutput]


class EngineError(Event, frozen=True, tag="EngineError"):
    error_type: str
    message: str


class RecordingStopped(Event, frozen=True, tag="RecordingStopped"):
    """The recorder of another engine stopped here and the run went on unrecorded: something
    changed the engine's state outside the calls the recorder follows (a test setting vLLM's
    scheduler state by hand), so the tape could no longer describe it. The last event."""

    reason: str


# -- snapshots: where a segment of a segmented tape begins ---------------------------------


class RequestSnapshot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A request the reducer still changes, as it holds it (events/state.py's RequestState,
    field by field, but for what the reducer derives from the params when it is added)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_step: int
    status: str  # a RequestStatus value
    output_token_ids: list[int]
    output_logprobs: list[float]
    output_top_logprobs: list[dict[int, float]]
    prompt_logprobs: PromptLogprobs | None
    num_computed_tokens: int
    num_output_placeholders: int
    epoch: int
    num_preemptions: int
    block_ids: list[int]
    num_stale_in_flight: int
    num_fresh_in_flight: int
    num_partial_in_flight: int
    prefill_complete: bool
    async_tokens_to_discard: int
    discard_latest_async_tokens: bool
    drop_stale_output: bool
    num_frames_dropped: int
    num_emitted: int
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    lora_int_id: int = 0  # format 8


class InFlightSnapshot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A step scheduled whose frame had not come back: its entries, and the requests whose
    entry is a prefill chunk that samples nothing."""

    step: int
    entries: list[ScheduledEntry]
    partial: list[str]


class KVCacheSnapshot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The KV cache manager's bookkeeping: the free queue in eviction order, as runs of
    consecutive block ids (first id, count: a pool of 65536 blocks untouched is one run),
    the reference count of every block in use, the prefix cache (block and the hash it
    holds), and how many of each request's blocks are hashed. A request's hash chain is not
    kept: it is a function of its tokens, computed again when needed."""

    free_runs: list[tuple[int, int]]
    ref_counts: list[tuple[int, int]]
    cached_blocks: list[tuple[int, bytes]]
    num_cached: list[tuple[str, int]]


class StopStreamSnapshot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The stop-string checker's stream of one request (engine/stop_strings.py): the output
    tokens decoded, the characters held back, released and not yet taken, and its
    incremental detokenizer's position (offsets into the tokens decoded, or the bytes of a
    character cut between tokens)."""

    req_id: str
    fed: int
    tail: str
    num_chars: int
    num_released: int
    outbox: str
    finished: bool
    detok_chars: int
    prefix_offset: int = 0
    read_offset: int = 0
    pending_bytes: bytes = b""


class EngineSnapshot(Event, frozen=True, tag="EngineSnapshot"):
    """Format 7: the first event of every segment of a segmented tape: everything the
    reducer and a replay need to start there without the segments before it. It restates
    the state and changes nothing: the engine that takes it applies nothing, a fold that
    starts with it restores it, and a replay that reaches one mid-tape compares it with its
    own. `step` is the next step to schedule. Sampling carries no state of its own (a
    request's seed and the position decide every draw), so none is kept."""

    segment: int  # the segment's number in its directory, from 0
    seq_offset: int  # events written in the segments before this one
    wall_time: float  # seconds since the epoch when it was taken
    requests: list[RequestSnapshot]  # every request not settled (unfinished, or owed output)
    waiting: list[str]
    running: list[str]
    in_flight_steps: list[InFlightSnapshot]
    pending_output: list[str]
    paused: PauseMode | None
    sleep_level: int | None
    sleeping_tags: list[str]
    num_prefix_cache_resets: int
    weights_id: str | None
    weight_version: str
    num_weight_updates: int
    weight_update_chunks: int | None
    kv_cache: KVCacheSnapshot
    stop_streams: list[StopStreamSnapshot]
    loras: list[LoRAAdded] = []  # format 8: the adapters loaded, in the order they were added

    def restated(self) -> EngineSnapshot:
        """The snapshot without where and when it was taken: what two snapshots of the same
        state share."""
        return msgspec.structs.replace(self, segment=0, seq_offset=0, wall_time=0.0)


class SegmentClosed(Event, frozen=True, tag="SegmentClosed"):
    """Format 7: the last event of a segment that the run went on from: it continues in the
    segment numbered `next_segment`, which opens with the snapshot of this step boundary.
    Changes nothing; a segment without it at its end is where the recording stopped."""

    next_segment: int


AnyEvent = (
    RequestAdded
    | RequestAborted
    | GenerationPaused
    | GenerationResumed
    | PrefixCacheReset
    | WeightsUpdated
    | WeightUpdateStarted
    | WeightChunkReceived
    | EngineSlept
    | EngineWokeUp
    | StepScheduled
    | RequestPreempted
    | RequestFinished
    | FrameProduced
    | OutputsEmitted
    | EngineError
    | RecordingStopped
    | EngineSnapshot
    | SegmentClosed
    | CollectiveRPC
    | LoRAAdded
    | LoRARemoved
)

EVENT_TYPES: tuple[type[Event], ...] = AnyEvent.__args__  # type: ignore[attr-defined]
EVENT_KINDS: dict[str, type[Event]] = {t.__struct_config__.tag: t for t in EVENT_TYPES}  # type: ignore[misc]

# Events that a client command starts. Replay re-issues these as commands; everything else
# must be re-derived by the engine itself.
COMMAND_KINDS = frozenset(
    {
        "RequestAdded",
        "RequestAborted",
        "GenerationPaused",
        "GenerationResumed",
        "PrefixCacheReset",
        "WeightsUpdated",
        "WeightUpdateStarted",
        "WeightChunkReceived",
        "EngineSlept",  # the release that ends a sleep call (its pause is recorded before it)
        "EngineWokeUp",
        "CollectiveRPC",
        "LoRAAdded",
        "LoRARemoved",
    }
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)
_header_decoder = msgspec.msgpack.Decoder(TapeHeader)


KIND_OF_TYPE: dict[type, str] = {t: kind for kind, t in EVENT_KINDS.items()}


def kind_of(event: Event) -> str:
    return KIND_OF_TYPE[type(event)]


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes | bytearray | memoryview) -> AnyEvent:
    return _decoder.decode(data)


def encode_header(header: TapeHeader) -> bytes:
    return _encoder.encode(header)


def decode_header(data: bytes | bytearray | memoryview) -> TapeHeader:
    return _header_decoder.decode(data)
