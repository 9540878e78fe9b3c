"""What a postmortem reports: findings (msgspec structs) and the report that gathers them."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tokentape.events import schema as ev
from tokentape.replay.export import to_builtin

Severity = Literal["error", "warning"]

# Upstream bug classes a finding can match (see /work/shared/DESIGN.md and docs/postmortem.md).
BUG_CLASSES: dict[str, str] = {
    "vllm#42043": "vLLM #42043: a preemption flag drops the first token after resume",
    "vllm#42117-overwrite": "vLLM #42117 review: a second preemption overwrites a discard counter "
    "that has not drained, so a stale token slips through",
    "vllm#42117-spec-units": "vLLM #42117 follow-up: the discard counter is set in tokens "
    "but drained per frame, so with speculative decoding fresh frames are dropped",
    "vllm#46066": "vLLM #46066: before it, a stale frame dropped after "
    "reset_prefix_cache(reset_running_requests=True) still took its rejected drafts off the "
    "placeholders of the request scheduled again, which went below zero silently",
    "vllm#42043-one-frame": "vLLM before #42117: a reset sets one boolean flag, which drops one "
    "frame, so with several steps in flight (pipeline depth 3 or more) the "
    "other stale frames are applied; #42117's counter replaced the flag",
    "vllm#47900": "vLLM #47900: output placeholders go negative after a KV-pressure "
    "preemption with output in flight",
    "vllm#26400": "vLLM #26400/#29987: an abort during the final step is reported as a "
    "normal finish",
    "vllm#38624": "vLLM #38624: in-flight tokens are discarded after a reset's preemption "
    "only, not after a KV-pressure preemption, so its stale output is applied",
    "vllm#40768": "vLLM #40768: -1 draft placeholder ids of a preempted request leak into the "
    "input ids of the step that admits it again",
    "vllm#41190": "vLLM #41190 (fixed by #49620): with speculative decoding the discard budget is "
    "counted as 1 + k tokens per frame, outlives the stale frames and drops fresh ones",
    "vllm#49860": "vLLM #49860: placeholders inflated after a drain, or after a reset's "
    "discard of the output in flight, so a request is scheduled past max_tokens and its stop "
    "comes late",
    "vllm#57562": "vLLM #57562: output placeholders go negative with chunked prefill and other "
    "requests in the step, without speculative decoding or preemption",
    "vllm#33377": "vLLM #33377: the KV blocks of a request aborted with a step in flight are freed "
    "twice (async scheduling + abort)",
    "vllm#52969": "vLLM #52969: the engine crashes on output for a request aborted while its step "
    "was in flight",
    "nemo-rl#4018": "NeMo-RL #4018 (the class of lmdeploy #4917 and SGLang #26792): the prefix "
    "cache is not reset across a weight update, so new requests reuse KV computed by old weights",
    # Issue 25's newer members of the family.
    "vllm#42492": "vLLM #42492: after an abort and a re-add of the same request id with a step "
    "in flight, the old step's output lands on the new request (placeholders below zero)",
    "vllm#45357": "vLLM #45357/#47728: KV blocks freed while a step that writes them is in "
    "flight are reallocated, and the stale write corrupts the new owner's KV",
    "tenstorrent-vllm#395": "tenstorrent/vllm #395: the overlap path submits step N+1 before "
    "step N's tokens are applied, so a position is sampled again and delivered twice",
    "vllm#53130": "vLLM #53130: admission stops once running plus skipped-waiting requests reach "
    "max_num_seqs, while the engine stays healthy",
    "vllm-omni#5183": "vllm-omni #5183: a downstream copy of #42043 sets the discard count to 1 "
    "whatever is in flight, dropping a fresh frame or applying a stale one",
    # The sleep races.
    "vllm#45268": "vLLM #45268: a request that arrives while the engine sleeps is parked in the "
    "waiting queue and never scheduled, after the wake-up too",
    "vllm#45520": "vLLM #45520: a sleep with decodes in flight does not drain them: the memory "
    "is released under a running step, the engine dies on it, and /sleep answered 200",
    "vllm#44395": "vLLM #44395 (fixed by #44483): a wake-up of the weights alone resumes "
    "scheduling, and steps run on the KV cache still released (an illegal memory access)",
}


class ExcerptEvent(msgspec.Struct, frozen=True):
    """One tape event of a finding's excerpt, cut down to the finding's requests."""

    seq: int
    step: int
    kind: str
    data: dict[str, Any]


class Finding(msgspec.Struct, frozen=True):
    kind: str
    severity: Severity
    request_ids: list[str]
    steps: tuple[int, int]  # first and last engine step the finding covers
    message: str  # one line
    excerpt: list[ExcerptEvent] = []
    bug_class: str | None = None  # a key of BUG_CLASSES
    seq: int | None = None  # the tape position where it shows


class Summary(msgspec.Struct):
    tape: str
    num_events: int  # events analysed (the readable prefix)
    num_steps: int
    num_requests: int
    discard_policy: str
    model_id: str
    reference: str | None  # "oracle", a reference tape's path, or None
    errors: int
    warnings: int
    counts: dict[str, int]  # findings per kind
    tokens: dict[str, int]  # token conservation: produced, applied, dropped_stale, ...
    # The run's tape is whole: read and folded to its end, and that end is the run's (no
    # tape_truncated finding). A summary never says "complete" beside a truncated tape.
    complete: bool
    read_to_end: bool = True  # the pass read and folded every event (a damaged tape: False)
    # A segmented tape's directory: the segment files read, and how the run ended as its
    # manifest says ("closed", an engine error, how the core died; None: not recorded).
    segments: list[str] = []
    ended: str | None = None


class Report(msgspec.Struct):
    findings: list[Finding]
    summary: Summary

    @property
    def ok(self) -> bool:
        return self.summary.errors == 0


def excerpt_of(
    items: list[tuple[int, ev.Event]], request_ids: set[str] | frozenset[str]
) -> list[ExcerptEvent]:
    """The events, in tape order and without repeats, each cut down to the given requests."""
    seen: set[int] = set()
    out = []
    for seq, event in sorted(items, key=lambda item: item[0]):
        if seq in seen:
            continue
        seen.add(seq)
        out.append(ExcerptEvent(seq, event.step, ev.kind_of(event), _cut(event, request_ids)))
    return out


def _cut(event: ev.Event, request_ids: set[str] | frozenset[str]) -> dict[str, Any]:
    data: dict[str, Any] = to_builtin(event)
    del data["step"]  # the excerpt line shows it
    if isinstance(event, ev.RequestFinished) and event.num_output_tokens is None:
        del data["num_output_tokens"]  # a tape before format 6: shown as it was recorded
    entries = data.get("entries")
    if entries is not None:
        kept = [x for x in entries if x["req_id"] in request_ids]
        data["entries"] = kept
        if len(kept) < len(entries):
            data["other_entries"] = len(entries) - len(kept)
    return data
