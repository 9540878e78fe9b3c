"""Faults that reproduce upstream bugs on purpose: the names, and the upstream bug each one
reproduces. An engine built with `faults=(...)` (EngineConfig) installs them; the default
path (`faults=()`) never looks at them. They are recorded in the tape header's config, so a
replay or a fold of the tape runs with the same faults.

The installers live in `tokentape.engine.fault_hooks`; the reducer faults are applied by the
reducer itself (`REDUCER_FAULTS`; resume_on_partial_wake is an engine fault too). Each
comment below says what is modelled: where the upstream issue does not state the exact
mechanism, the mechanism its title describes.
"""

from __future__ import annotations

FAULTS: dict[str, str] = {
    # vLLM #40768: the -1 draft placeholders of a request preempted with speculative slots in
    # flight are not cleared, and go into the input ids of the step that admits it again.
    "spec_placeholder_input": "vllm#40768",
    # vLLM #49860: a drain (pause_generation without a reset) delivers the in-flight output
    # without returning its placeholders, so vLLM's max_tokens look-ahead schedules one
    # extra decode per drained step: the stop comes late.
    "late_stop_after_drain": "vllm#49860",
    # vLLM #57562: with chunked prefill and other requests in the step, the final chunk of a
    # prefill is counted without its output placeholder; its token takes one back (-1).
    "chunk_placeholder_underflow": "vllm#57562",
    # vLLM #33377: a request aborted with a step in flight has its KV blocks freed at the
    # abort and again when that step's output comes back, by then held by another request.
    "double_free_on_abort": "vllm#33377",
    # vLLM #52969: output that comes back for a request aborted while its step was in flight
    # is looked up among the live requests, and the engine crashes.
    "crash_on_aborted_output": "vllm#52969",
    # NeMo-RL #4018 (lmdeploy #4917, SGLang #26792): the prefix cache is never reset across
    # weight updates. Here: pause_generation(clear_cache=True) drains but resets nothing, so
    # the KV of the old weights stays cached (and running requests keep theirs).
    "prefix_cache_kept_across_weight_update": "nemo-rl#4018",
    # vLLM #53130: requests the admission loop skips (vLLM: waiting on remote KV, a grammar or
    # streaming input; here: on KV blocks) keep counting against max_num_seqs, so admission
    # stops for good once running plus skipped reach it, while the engine stays healthy.
    "skipped_waiting_holds_seats": "vllm#53130",
    # tenstorrent/vllm #395: the overlap path submits step N+1 before applying step N's tokens
    # to the input batch, so N's position is sampled again and the client gets it twice
    # (here: in a step where a request joins the batch).
    "stale_overlap_input": "tenstorrent-vllm#395",
    # vLLM #42492: a request aborted with a step in flight and added again under the same id;
    # the step's output is looked up by id when it comes back and lands on the new request
    # (placeholders below zero). A reducer fault: tokentape's reducer keeps the scheduled
    # request itself, and its engine refuses an id used before.
    "output_on_reused_id": "vllm#42492",
    # vLLM #45357/#47728: blocks a request gives back while its step that writes them is in
    # flight are handed out at once; the next request admitted takes them as holding its
    # prefix (vLLM: KV a connector loads, unordered with that step), and the write lands there.
    "free_blocks_in_flight": "vllm#45357",
    # vLLM #45268 (the client hang its thread traced, PR #45326): a request that reaches the
    # engine core while it sleeps is parked in the waiting queue, which a sleeping engine
    # never schedules. Here it stays parked after the wake-up too (parked for good): the
    # scheduler passes over it while it serves the others.
    "park_requests_while_asleep": "vllm#45268",
    # vLLM #45520: /sleep with decodes in flight has no drain: the memory is released under
    # a running step, the engine dies on it, and /sleep has already answered 200. Here the
    # pause before the sleep does not wait for the steps in flight, and EngineSlept records
    # them; collecting one of them while the memory is released fails the engine.
    "sleep_without_drain": "vllm#45520",
    # vLLM #44395 (fixed by #44483): a partial wake-up, wake_up(tags=["weights"]) as RL
    # frameworks call it before a weight update, resumes scheduling with the KV cache still
    # released, and the next forward pass writes it (an illegal memory access). Here the
    # engine records GenerationResumed after such an EngineWokeUp, the scheduler schedules
    # steps while "kv_cache" sleeps, and the first one fails the engine when it goes to the
    # runner. Also a reducer fault: the reducer accepts that resume and those steps.
    "resume_on_partial_wake": "vllm#44395",
}

REDUCER_FAULTS = frozenset(
    {"chunk_placeholder_underflow", "output_on_reused_id", "resume_on_partial_wake"}
)
