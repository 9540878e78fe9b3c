"""vLLM's objects as tokentape's: the tape header from vLLM's config, a request's sampling
parameters, and finish reasons. Reads vLLM's objects by attribute (vLLM itself is imported only
by the scheduler module), and refuses what the tape cannot represent, before it is recorded."""

from __future__ import annotations

import datetime
import re
from typing import Any

import msgspec

from tokentape.engine.config import EngineConfig
from tokentape.events import schema as ev
from tokentape.version import __version__

# vLLM's RequestStatus and FinishReason names, as tokentape's finish reasons. The tape knows
# stop, length and abort: an error finish reads as an abort, repetition detection as a stop.
_STATUS_REASONS: dict[str, ev.FinishReason] = {
    "FINISHED_STOPPED": "stop",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_ABORTED": "abort",
    "FINISHED_IGNORED": "abort",
    "FINISHED_ERROR": "abort",
    "FINISHED_REPETITION": "stop",
}
_FINISH_REASONS: dict[str, ev.FinishReason] = {
    "STOP": "stop",
    "LENGTH": "length",
    "ABORT": "abort",
    "ERROR": "abort",
    "REPETITION": "stop",
}


_RANDOM_SUFFIX = re.compile(r".+-[0-9a-f]{8}")


class UnsupportedByRecorder(ValueError):
    """A vLLM configuration or request the tape cannot represent; raised before recording."""


def client_request_id(internal: str, randomized: bool) -> str:
    """The id the client gave: vLLM's front end appends `-` and 8 random hex digits to it
    (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION), and the engine core sees only that."""
    return internal[:-9] if randomized and _RANDOM_SUFFIX.fullmatch(internal) else internal


def status_reason(status: Any) -> ev.FinishReason:
    return _STATUS_REASONS[status.name]


def finish_reason(reason: Any) -> ev.FinishReason | None:
    return None if reason is None else _FINISH_REASONS[reason.name]


def engine_config(
    vllm_config: Any,
    block_size: int,
    num_blocks: int,
    max_num_scheduled_tokens: int,
    discard_policy: str,
    asynchronous: bool,
    faults: list[str] | None = None,
) -> EngineConfig:
    """The EngineConfig a vLLM run corresponds to: what the reducer and the checkers read;
    `discard_policy` re-applies the release's discard mechanism and `faults` the bugs its
    engine core shipped that the reducer must follow (releases.py), `asynchronous`
    says whether the scheduler is an AsyncScheduler (vLLM's CPU platform turns the config's
    async_scheduling off, but a caller may still build one)."""
    model, sched, cache = (
        vllm_config.model_config,
        vllm_config.scheduler_config,
        vllm_config.cache_config,
    )
    parallel, spec = vllm_config.parallel_config, vllm_config.speculative_config
    for name, size in (
        ("pipeline_parallel_size", parallel.pipeline_parallel_size),
        ("data_parallel_size", parallel.data_parallel_size),
    ):
        if size != 1:
            raise UnsupportedByRecorder(
                f"the tokentape recorder records one engine core without "
                f"pipeline or data parallelism; {name} is {size}"
            )
    lookup: dict[str, int] = {}
    if spec is not None:
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if isinstance(getattr(spec, name, None), int):
                lookup[name] = getattr(spec, name)
    dtype = str(model.dtype).removeprefix("torch.")
    try:
        return EngineConfig(
            model=str(model.model),
            async_scheduling=asynchronous,
            pipeline_depth=2 if asynchronous else 1,  # vLLM's batch queue without PP
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            discard_policy=discard_policy,
            faults=list(faults or ()),
            block_size=block_size,
            num_kv_blocks=num_blocks,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=max_num_scheduled_tokens,
            max_model_len=model.max_model_len,
            enable_prefix_caching=bool(cache.enable_prefix_caching),
            seed=model.seed if model.seed is not None else 0,
            device=str(vllm_config.device_config.device_type),
            dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "auto",
            **lookup,
        )
    except (TypeError, ValueError) as exc:
        raise UnsupportedByRecorder(
            f"this vLLM configuration cannot be described on a tape: {exc}"
        ) from None


def make_header(
    config: EngineConfig, vllm_config: Any, vllm_version: str, note: str = ""
) -> ev.TapeHeader:
    model = vllm_config.model_config
    return ev.TapeHeader(
        format_version=ev.FORMAT_VERSION,
        config=msgspec.to_builtins(config),
        discard_policy=config.discard_policy,
        model_id=str(model.model),
        seed=config.seed,
        package_version=__version__,
        eos_token_id=None,  # vLLM's EOS is per request: each RequestAdded has it in stop_token_ids
        vocab_size=int(model.get_vocab_size()),
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        source="vllm",
        source_version=vllm_version,
        source_note=note,
    )


def sampling_params(request: Any, vocab_size: int) -> ev.SamplingParams:
    """What the reducer needs of a vLLM request's SamplingParams: its stop conditions (EOS,
    when vLLM checks it, joins stop_token_ids), the sampling knobs and the output kind.
    Options that shape only what is sampled (penalties, min_tokens, logit bias...) act through
    the recorded frames; they are not recorded. Refuses what the tape cannot represent."""
    rid = request.request_id
    p = request.sampling_params
    if p is None or request.pooling_params is not None:
        raise UnsupportedByRecorder(
            f"request {rid!r}: pooling requests cannot be recorded (no sampling)"
        )
    if request.prompt_token_ids is None:
        raise UnsupportedByRecorder(
            f"request {rid!r}: a prompt given as embeddings cannot be recorded "
            "(the tape holds token ids)"
        )
    if getattr(request, "resumable", False):
        raise UnsupportedByRecorder(f"request {rid!r}: streaming-input sessions cannot be recorded")
    stop = list(p.stop_token_ids or ())
    if p.eos_token_id is not None and p.eos_token_id not in stop:  # None under ignore_eos
        stop.append(p.eos_token_id)
    logprobs = p.logprobs if p.logprobs is None or p.logprobs >= 0 else vocab_size  # -1: all
    try:
        return ev.SamplingParams(
            max_tokens=request.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=max(p.top_k, 0),
            seed=p.seed,
            stop_token_ids=tuple(stop),
            ignore_eos=p.ignore_eos,
            logprobs=logprobs,
            output_kind=p.output_kind.value,
        )
    except (TypeError, ValueError) as exc:
        raise UnsupportedByRecorder(f"request {rid!r}: {exc}") from None
