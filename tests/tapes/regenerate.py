"""Regenerate the bug zoo: one small tape per known bug class, recorded by tokentape itself
with the historical discard policies or a fault injected into the engine, each with the
findings the postmortem must report for it (`<name>.expected.json`), and clean tapes that
must yield no finding at all.

    python tests/tapes/regenerate.py            # rewrites every tape here

Run it when a format change leaves the stored tapes unreadable. Until then they stay in the
format they were recorded in (format 5 today), so the tests also hold today's reader to an
older format, while test_postmortem.py records each bug again in today's. The expected
findings below are written by hand from what each bug does, not taken from the postmortem's
output.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokentape import LLM, SamplingParams
from tokentape.engine.core.engine_core import EngineCore
from tokentape.engine.llm_engine import LLMEngine
from tokentape.events import schema as ev
from tokentape.events.sqlite_store import make_self_contained, remove_tape_files

HERE = Path(__file__).resolve().parent
PROMPT = list(range(10, 30))
Delivered = dict[str, list[int]]


def _llm(path: Path | None, policy: str = "epoch", depth: int = 2, k: int = 0, **kw: Any) -> LLM:
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 64}
    args.update(kw)
    return LLM(
        model="oracle-random",
        tape=None if path is None else str(path),
        pipeline_depth=depth,
        num_speculative_tokens=k,
        discard_policy=policy,
        **args,
    )


def _drive(llm: LLM, delivered: Delivered) -> None:
    for out in llm.llm_engine.step():
        delivered[out.request_id] = out.outputs[0].token_ids  # cumulative: every token so far


def _until(llm: LLM, delivered: Delivered, done: Callable[[], bool], limit: int = 2000) -> None:
    for _ in range(limit):
        if done():
            return
        _drive(llm, delivered)
    raise RuntimeError("the scenario did not reach its point")


def _run_until_idle(llm: LLM, delivered: Delivered) -> None:
    _until(llm, delivered, lambda: not llm.llm_engine.has_unfinished_requests())


# -- the bug classes -----------------------------------------------------------------------


def flag_42043(path: Path) -> None:
    """vLLM #42043: pause(keep, clear_cache=True) drains, the reset preempts with nothing in
    flight, yet the flag drops the first token after resume."""
    llm = _llm(path, "flag")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm.llm_engine.add_request("r", PROMPT, params)
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("r", [])) >= 8)
    llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
    _drive(llm, delivered)
    llm.llm_engine.resume_generation()
    _run_until_idle(llm, delivered)
    llm.close()


def counter_double_reset(path: Path) -> None:
    """The counter policy: a second reset overwrites a counter that still had a stale frame
    to drop, so the stale token is applied (and computed again)."""
    llm = _llm(path, "counter", depth=3)
    llm.llm_engine.add_request("r", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("r", [])) >= 6)
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    _drive(llm, delivered)
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    _run_until_idle(llm, delivered)
    llm.close()


def counter_spec_units(path: Path) -> None:
    """The counter policy with 3 speculative tokens: a reset sets the counter to 1 + k tokens
    but each frame removes one, so fresh frames after the stale one are dropped."""
    llm = _llm(path, "counter", depth=2, k=3)
    llm.llm_engine.add_request("r", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("r", [])) >= 5)
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    _run_until_idle(llm, delivered)
    llm.close()


class _AbortRacingFinalStep(EngineCore):
    """Fault injected (vLLM #26400/#29987): a request aborted while its final step is in
    flight is reported to the client as a normal finish, with the final step's token."""

    _raced: tuple[str, int] | None = None

    def abort_request(self, request_id: str) -> None:
        in_flight = [step for step, _ in self.state.in_flight_entries(request_id)]
        self._raced = (request_id, in_flight[-1]) if in_flight else None
        super().abort_request(request_id)

    def _emit(self, event: ev.Event) -> None:
        if isinstance(event, ev.OutputsEmitted) and self._raced is not None:
            req_id, step = self._raced
            final = [f.token_ids for f in self.runner._results[step] if f.req_id == req_id]  # type: ignore[attr-defined]
            event = ev.OutputsEmitted(
                event.step,
                [
                    ev.EmittedOutput(o.req_id, final[0], True, "length")
                    if o.req_id == req_id and o.finish_reason == "abort"
                    else o
                    for o in event.entries
                ],
            )
            self._raced = None
        super()._emit(event)


def abort_final_step(path: Path, clean: bool = False) -> None:
    llm = _llm(path, depth=2)
    engine = llm.llm_engine
    if not clean:  # the same runner and (still empty) tape, driven by the faulty engine core
        core = engine.engine_core
        faulty = _AbortRacingFinalStep(llm.config, core.runner, core.tape, llm.tokenizer)
        engine = llm.llm_engine = LLMEngine(faulty)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("a", PROMPT, params)
    engine.add_request("b", PROMPT[:9], SamplingParams(max_tokens=12, ignore_eos=True))
    delivered: Delivered = {}
    req = engine.engine_core.state.requests["a"]
    # The final step is in flight: the steps in flight cover every token it may still take.
    _until(
        llm,
        delivered,
        lambda: (
            req.num_fresh_in_flight >= 1
            and len(req.output_token_ids) + req.num_fresh_in_flight >= params.max_tokens
        ),
    )
    engine.abort_request("a")
    _run_until_idle(llm, delivered)
    llm.close()


def kv_pressure_in_flight(path: Path, clean: bool = False) -> None:
    """vLLM #47900's setting: KV-pressure preemptions while decode output is in flight (pipeline
    depth 3, two steps in flight); the flag drops one stale frame, the second is applied and
    output placeholders go negative."""
    llm = _llm(path, "epoch" if clean else "flag", depth=3, num_kv_blocks=14, max_num_seqs=4)
    for i in range(3):
        llm.llm_engine.add_request(
            f"q{i}", list(range(5 + i, 17 + i)), SamplingParams(max_tokens=10, ignore_eos=True)
        )
    delivered: Delivered = {}
    _run_until_idle(llm, delivered)
    llm.close()


# -- the museum: later bugs of the family, by museum policy or injected fault ----------------
# Each takes `clean=True` to run the same scenario on the default engine (epoch, no fault),
# which tests/postmortem/test_museum.py holds to no finding at all.


def _museum_llm(
    path: Path, clean: bool, policy: str = "epoch", faults: tuple[str, ...] = (), **kw: Any
) -> LLM:
    return _llm(path, "epoch" if clean else policy, faults=() if clean else faults, **kw)


def _kv_pressure(llm: LLM) -> None:
    for i in range(3):
        llm.llm_engine.add_request(
            f"q{i}", list(range(5 + i, 17 + i)), SamplingParams(max_tokens=10, ignore_eos=True)
        )
    _run_until_idle(llm, {})
    llm.close()


def flag_reset_only_38624(path: Path, clean: bool = False) -> None:
    """vLLM #38624 (museum policy flag-reset-only): the discard flag is set by a reset's
    preemptions only; KV-pressure preemptions with output in flight let it through."""
    _kv_pressure(
        _museum_llm(path, clean, "flag-reset-only", depth=2, num_kv_blocks=14, max_num_seqs=4)
    )


def counter_reset_only_47900(path: Path, clean: bool = False) -> None:
    """vLLM #47900, before #48245 (museum policy counter-reset-only): the discard counter is
    set by a reset's preemptions only; after a KV-pressure preemption the stale output is
    applied and counted, and output placeholders go below zero (vLLM asserted)."""
    _kv_pressure(
        _museum_llm(path, clean, "counter-reset-only", depth=2, num_kv_blocks=14, max_num_seqs=4)
    )


def counter_spec_budget_41190(path: Path, clean: bool = False) -> None:
    """vLLM #41190, fixed by #49620 (museum policy counter-spec-budget): a reset with a
    speculative step in flight sets a budget of 1 + k tokens per frame; the stale frame
    returns fewer (drafts rejected), and the rest of the budget drops fresh frames."""
    llm = _museum_llm(path, clean, "counter-spec-budget", depth=2, k=3)
    llm.llm_engine.add_request("r", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("r", [])) >= 5)
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    _run_until_idle(llm, delivered)
    llm.close()


def spec_placeholder_input_40768(path: Path, clean: bool = False) -> None:
    """vLLM #40768 (fault spec_placeholder_input): a reset preempts a request with
    speculative slots in flight; its -1 draft placeholders are not cleared and become input
    ids of the step that admits it again."""
    llm = _museum_llm(path, clean, faults=("spec_placeholder_input",), depth=2, k=2)
    llm.llm_engine.add_request("r", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("r", [])) >= 4)
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    _run_until_idle(llm, delivered)
    llm.close()


def late_stop_49860(path: Path, clean: bool = False) -> None:
    """vLLM #49860 (fault late_stop_after_drain): pause_generation(keep, clear_cache=False)
    drains a step in flight without returning its placeholder; at the end the request is
    scheduled one step past max_tokens."""
    llm = _museum_llm(path, clean, faults=("late_stop_after_drain",), depth=2)
    llm.llm_engine.add_request("r", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("r", [])) >= 4)
    llm.llm_engine.pause_generation(mode="keep", clear_cache=False)
    _drive(llm, delivered)
    llm.llm_engine.resume_generation()
    _run_until_idle(llm, delivered)
    llm.close()


def chunk_underflow_57562(path: Path, clean: bool = False) -> None:
    """vLLM #57562 (fault chunk_placeholder_underflow): chunked prefill with two requests
    sharing the token budget, no speculative decoding, no preemption; the final chunk's
    placeholder is not counted, so its token takes placeholders to -1."""
    llm = _museum_llm(
        path, clean, faults=("chunk_placeholder_underflow",), depth=2, max_num_batched_tokens=8
    )
    llm.llm_engine.add_request("a", PROMPT[:13], SamplingParams(max_tokens=6, ignore_eos=True))
    llm.llm_engine.add_request("b", PROMPT[3:10], SamplingParams(max_tokens=6, ignore_eos=True))
    _run_until_idle(llm, {})
    llm.close()


def double_free_33377(path: Path, clean: bool = False) -> None:
    """vLLM #33377 (fault double_free_on_abort): a request aborted with a step in flight has
    its KV blocks freed at the abort and again when the step comes back, by then taken by
    the request admitted in its place; they are handed out twice."""
    llm = _museum_llm(
        path,
        clean,
        faults=("double_free_on_abort",),
        depth=2,
        num_kv_blocks=12,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    engine.add_request("a", PROMPT[:15], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("b", PROMPT[:14], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("w", PROMPT[2:16], SamplingParams(max_tokens=12, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("a", [])) >= 2)
    engine.abort_request("a")
    try:
        _run_until_idle(llm, delivered)
    except RuntimeError:  # the pool notices a block given back once too often; on the tape
        pass
    llm.close()


def crash_aborted_52969(path: Path, clean: bool = False) -> None:
    """vLLM #52969 (fault crash_on_aborted_output): a request aborted while its step is in
    flight; when the step's output comes back the engine looks the request up and crashes."""
    llm = _museum_llm(path, clean, faults=("crash_on_aborted_output",), depth=2)
    llm.llm_engine.add_request("a", PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    llm.llm_engine.add_request("b", PROMPT[:9], SamplingParams(max_tokens=16, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("a", [])) >= 3)
    llm.llm_engine.abort_request("a")
    try:
        _run_until_idle(llm, delivered)
    except KeyError:  # the crash, recorded on the tape as an EngineError
        pass
    llm.close()


def prefix_cache_4018(path: Path, clean: bool = False) -> None:
    """NeMo-RL #4018 (fault prefix_cache_kept_across_weight_update): each weight update comes
    after pause_generation(keep, clear_cache=True), yet the prefix cache is never reset, so the
    requests after the updates reuse KV blocks the first weights computed."""
    from tokentape.engine.runners.oracle_weights import oracle_state_dict

    llm = _museum_llm(path, clean, faults=("prefix_cache_kept_across_weight_update",), depth=2)
    engine = llm.llm_engine
    delivered: Delivered = {}
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    _run_until_idle(llm, delivered)
    for i, req_id in enumerate(("b", "c"), start=1):  # a trainer's steps, the same prompt
        engine.pause_generation(mode="keep", clear_cache=True)
        engine.update_weights(oracle_state_dict(i), weight_version=f"step-{i}")
        engine.resume_generation()
        engine.add_request(req_id, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
        _run_until_idle(llm, delivered)
    llm.close()


# -- issue 25: the bug family's newest members ----------------------------------------------


def spec_reset_46066(path: Path, clean: bool = False) -> None:
    """vLLM #46066 (museum policy vllm-flag: vLLM 0.20-0.21 as released, in tokentape's own
    engine): reset_prefix_cache(reset_running_requests=True) with a speculative step in
    flight; the stale frame the flag drops still takes its rejected drafts off the computed
    tokens and the placeholders of the request already scheduled again, which go below zero
    silently; the positions taken back are computed and delivered again."""
    llm = _museum_llm(path, clean, "vllm-flag", depth=2, k=2)
    llm.llm_engine.add_request("r", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("r", [])) >= 4)
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    _run_until_idle(llm, delivered)
    llm.close()


def omni_discard_one_5183(path: Path, clean: bool = False) -> None:
    """vllm-omni #5183 (museum policy omni-discard-one): the discard count is set to 1 whatever
    is in flight. A reset with two steps in flight (pipeline depth 3) drops one stale frame
    and applies the other; a pause(keep, clear_cache=True) that drained first still drops
    one frame, the first fresh one after resume (#42043 again)."""
    llm = _museum_llm(path, clean, "omni-discard-one", depth=3)
    engine = llm.llm_engine
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("r", [])) >= 6)
    engine.reset_prefix_cache(reset_running_requests=True)  # two steps in flight
    _until(llm, delivered, lambda: len(delivered.get("r", [])) >= 12)
    engine.pause_generation(mode="keep", clear_cache=True)  # drained: nothing in flight
    _drive(llm, delivered)
    engine.resume_generation()
    _run_until_idle(llm, delivered)
    llm.close()


def admission_stalled_53130(path: Path, clean: bool = False) -> None:
    """vLLM #53130 (fault skipped_waiting_holds_seats): three big requests cannot get their
    KV blocks while two others run, are skipped and keep counting against max_num_seqs (3);
    once the big running request finishes, the one left is served alone for 20 steps with
    room for the queue's head, and admission never opens again. The client gives up and
    aborts the three (a default engine serves them)."""
    llm = _museum_llm(
        path,
        clean,
        faults=("skipped_waiting_holds_seats",),
        depth=2,
        num_kv_blocks=16,
        max_num_seqs=3,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    engine.add_request("run", list(range(40, 44)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("big", list(range(50, 78)), SamplingParams(max_tokens=6, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("big", [])) >= 1)
    for name, first in (("h1", 100), ("h2", 130), ("h3", 160)):  # 7 blocks each
        prompt = list(range(first, first + 28))
        engine.add_request(name, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    _until(llm, delivered, lambda: engine.engine_core.state.requests["run"].is_finished)
    for _ in range(10):  # the engine idles: nothing is admitted
        _drive(llm, delivered)
    for name in ("h1", "h2", "h3"):
        engine.abort_request(name)  # a no-op for a request already served
    _run_until_idle(llm, delivered)
    llm.close()


def duplicated_token_395(path: Path, clean: bool = False) -> None:
    """tenstorrent/vllm #395 (fault stale_overlap_input): request b joins the batch while a
    decodes with a step in flight; that step goes to the runner before a's previous token is
    applied to its input, so it samples a's previous position again: the client gets that
    token twice, and every later one a place late."""
    llm = _museum_llm(path, clean, faults=("stale_overlap_input",), depth=2)
    llm.llm_engine.add_request("a", PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("a", [])) >= 4)
    llm.llm_engine.add_request("b", PROMPT[:9], SamplingParams(max_tokens=8, ignore_eos=True))
    _run_until_idle(llm, delivered)
    llm.close()


def reused_id_42492(path: Path, clean: bool = False) -> None:
    """vLLM #42492 (reducer fault output_on_reused_id): request 'late' is aborted with a step
    in flight and a new request is added under the same id; the old step's output is looked
    up by id when it comes back and lands on the new request: a wrong first token, and its
    placeholders below zero (vLLM asserted). The default engine refuses an id used before,
    so its run adds the new request as 'late-2'."""
    llm = _museum_llm(path, clean, faults=("output_on_reused_id",), depth=2)
    engine = llm.llm_engine
    engine.add_request("keep", PROMPT[:9], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("late", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("late", [])) >= 3)
    engine.abort_request("late")  # its step in flight
    again = "late-2" if clean else "late"
    engine.add_request(again, PROMPT[5:], SamplingParams(max_tokens=8, ignore_eos=True))
    _run_until_idle(llm, delivered)
    llm.close()


def block_reused_45357(path: Path, clean: bool = False) -> None:
    """vLLM #45357/#47728 (fault free_blocks_in_flight): request a is aborted while its step
    that writes KV block 8 is in flight; the block goes back to the pool at once, and b,
    admitted next, takes it as holding its first four positions (vLLM: KV its connector loads,
    unordered with that step): the stale write of a's positions lands on b's KV. The oracle's
    tokens do not depend on KV, so only the blocks show it."""
    llm = _museum_llm(
        path,
        clean,
        faults=("free_blocks_in_flight",),
        depth=2,
        num_kv_blocks=9,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    engine.add_request("keep", PROMPT[:9], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("a", [])) >= 2)
    engine.abort_request("a")  # its step writing block 8 in flight
    engine.add_request("b", list(range(60, 70)), SamplingParams(max_tokens=6, ignore_eos=True))
    _run_until_idle(llm, delivered)
    llm.close()


def parked_while_asleep_45268(path: Path, clean: bool = False) -> None:
    """vLLM #45268 (fault park_requests_while_asleep): request 'late' arrives while the engine
    sleeps (level 1, mode keep) and is parked; after the wake-up the engine serves 'run'
    again for 20 steps with room for 'late', and never admits it. The client gives up and
    aborts it (a default engine queued it and served it after the wake-up)."""
    llm = _museum_llm(path, clean, faults=("park_requests_while_asleep",), depth=2)
    engine = llm.llm_engine
    engine.add_request("run", PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("run", [])) >= 4)
    engine.sleep(level=1, mode="keep")
    engine.add_request("late", PROMPT[:9], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.wake_up()
    _until(llm, delivered, lambda: engine.engine_core.state.requests["run"].is_finished)
    engine.abort_request("late")  # a no-op for a request already served
    _run_until_idle(llm, delivered)
    llm.close()


def sleep_in_flight_45520(path: Path, clean: bool = False) -> None:
    """vLLM #45520 (fault sleep_without_drain): sleep(level=1, mode="keep") while 'a' and 'b'
    decode with a step in flight; the pause does not drain it, the memory is released under
    it and sleep() returns as if all were well (vLLM's /sleep answered 200). The engine core
    steps on for the step in flight, which ran on the released memory: the engine fails
    (vLLM: a CUDA illegal memory access). A default engine drains the step first, sleeps,
    wakes up and serves both."""
    llm = _museum_llm(path, clean, faults=("sleep_without_drain",), depth=2)
    engine = llm.llm_engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    engine.add_request("b", PROMPT[:9], SamplingParams(max_tokens=16, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("a", [])) >= 3)
    engine.sleep(level=1, mode="keep")
    try:
        _drive(llm, delivered)  # the core's loop: a step in flight is collected
        engine.wake_up()
        _run_until_idle(llm, delivered)
    except RuntimeError:  # the failure, on the tape as an EngineError
        pass
    llm.close()


def partial_wake_44395(path: Path, clean: bool = False) -> None:
    """vLLM #44395 (fault resume_on_partial_wake): an RL trainer's staged wake-up. 'a' runs,
    the engine sleeps (level 1, mode keep) and wakes its weights alone to take an update, the
    KV cache still released; the wake-up resumes generation anyway, 'b' arrives, and the
    engine core schedules 'a' and 'b' onto the released KV cache: the step fails the engine
    (vLLM: a CUDA illegal memory access). A default engine schedules nothing until
    wake_up(["kv_cache"]), after the update, and serves both then."""
    from tokentape.engine.runners.oracle_weights import oracle_state_dict

    llm = _museum_llm(path, clean, faults=("resume_on_partial_wake",), depth=2)
    engine = llm.llm_engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    delivered: Delivered = {}
    _until(llm, delivered, lambda: len(delivered.get("a", [])) >= 3)
    engine.sleep(level=1, mode="keep")
    engine.wake_up(["weights"])
    engine.add_request("b", list(range(60, 69)), SamplingParams(max_tokens=6, ignore_eos=True))
    try:
        _drive(llm, delivered)  # the core's loop, between the two wake-ups
        engine.update_weights(oracle_state_dict(1), weight_version="step-1")
        engine.wake_up(["kv_cache"])
        _run_until_idle(llm, delivered)
    except RuntimeError:  # the failure, on the tape as an EngineError
        pass
    llm.close()


# -- clean tapes: no finding at all --------------------------------------------------------


def clean_epoch_storm(path: Path) -> None:
    """The epoch policy through storms of pause/resume/reset, with speculative decoding,
    chunked prefill, KV-pressure preemptions and an abort."""
    llm = _llm(
        path, "epoch", depth=3, k=2, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4
    )
    engine = llm.llm_engine
    for i in range(6):
        engine.add_request(
            f"s{i}", list(range(3 + i, 12 + 3 * i)), SamplingParams(max_tokens=14, ignore_eos=True)
        )
    delivered: Delivered = {}
    modes = ("keep", "wait", "keep")
    for round_ in range(9):
        for _ in range(2 + round_ % 3):
            _drive(llm, delivered)
        if round_ % 3 == 2:
            engine.reset_prefix_cache(reset_running_requests=True)
            engine.reset_prefix_cache(reset_running_requests=True)
        else:
            engine.pause_generation(mode=modes[round_ % 3], clear_cache=round_ % 2 == 0)
            _drive(llm, delivered)
            engine.resume_generation()
        if round_ == 1:
            engine.abort_request("s5")
    _run_until_idle(llm, delivered)
    llm.close()


def clean_epoch_pause_resume(path: Path) -> None:
    """The #42043 scenario itself under the epoch policy, repeated: nothing is lost."""
    llm = _llm(path, "epoch", depth=2)
    llm.llm_engine.add_request("r", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    llm.llm_engine.add_request("s", PROMPT[:7], SamplingParams(max_tokens=30, ignore_eos=True))
    delivered: Delivered = {}
    for target in (6, 12, 18, 24):
        _until(llm, delivered, lambda target=target: len(delivered.get("r", [])) >= target)
        llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
        _drive(llm, delivered)
        llm.llm_engine.resume_generation()
    _run_until_idle(llm, delivered)
    llm.close()


def _finding(
    kind: str, request_ids: list[str], bug_class: str | None = None, severity: str = "error"
) -> dict[str, Any]:
    return {"kind": kind, "severity": severity, "request_ids": request_ids, "bug_class": bug_class}


# name -> (scenario, the findings the postmortem must report, exactly)
ZOO: dict[str, tuple[Callable[[Path], None], list[dict[str, Any]]]] = {
    "flag_42043": (
        flag_42043,
        [
            _finding("post_resume_token_dropped", ["r"], "vllm#42043"),
            # Every later token moved up by one; the dropped frame's placeholder never came back.
            _finding("token_shifted", ["r"], "vllm#42043"),
            _finding("placeholders_left_over", ["r"], "vllm#42043", severity="warning"),
            _finding("count_nonzero_at_finish", ["r"], "vllm#42043", severity="warning"),
        ],
    ),
    "counter_double_reset": (
        counter_double_reset,
        [
            _finding("stale_frame_applied", ["r"], "vllm#42117-overwrite"),
            _finding("negative_count", ["r"], "vllm#42117-overwrite"),  # placeholders -1
            _finding("token_duplicated", ["r"], "vllm#42117-overwrite"),
            _finding(
                "count_nonzero_at_finish", ["r"], "vllm#42117-overwrite", severity="warning"
            ),  # -1
        ],
    ),
    "counter_spec_units": (
        counter_spec_units,
        [
            _finding("fresh_frame_dropped", ["r"], "vllm#42117-spec-units"),
            _finding("token_shifted", ["r"], "vllm#42117-spec-units"),
            _finding("placeholders_left_over", ["r"], "vllm#42117-spec-units", severity="warning"),
            _finding("count_nonzero_at_finish", ["r"], "vllm#42117-spec-units", severity="warning"),
        ],
    ),
    "abort_final_step": (
        abort_final_step,
        [
            _finding("output_mismatch", ["a"], "vllm#26400"),
        ],
    ),
    "kv_pressure_in_flight": (
        kv_pressure_in_flight,
        [
            _finding("stale_frame_applied", ["q2"], "vllm#47900"),
            # The applied stale token is the one after the dropped one, in its place; the
            # recompute then carries on from the right position: one wrong token.
            _finding("token_mismatch", ["q2"], "vllm#47900"),
            _finding("negative_count", ["q2"], "vllm#47900"),
            _finding("count_nonzero_at_finish", ["q2"], "vllm#47900", severity="warning"),
        ],
    ),
    # The museum (each scenario also runs clean: tests/postmortem/test_museum.py).
    "flag_reset_only_38624": (
        flag_reset_only_38624,
        [
            _finding("stale_frame_applied", ["q2"], "vllm#38624"),
            _finding("negative_count", ["q2"], "vllm#38624"),
            _finding("count_nonzero_at_finish", ["q2"], "vllm#38624", severity="warning"),
        ],
    ),
    "counter_reset_only_47900": (
        counter_reset_only_47900,
        [
            _finding("stale_frame_applied", ["q2"], "vllm#47900"),
            _finding("negative_count", ["q2"], "vllm#47900"),  # vLLM's assert placeholders >= 0
            _finding("count_nonzero_at_finish", ["q2"], "vllm#47900", severity="warning"),
        ],
    ),
    "counter_spec_budget_41190": (
        counter_spec_budget_41190,
        [
            _finding("fresh_frame_dropped", ["r"], "vllm#41190"),
            _finding("token_shifted", ["r"], "vllm#41190"),
            _finding("placeholders_left_over", ["r"], "vllm#41190", severity="warning"),
            _finding("count_nonzero_at_finish", ["r"], "vllm#41190", severity="warning"),
        ],
    ),
    "spec_placeholder_input_40768": (
        spec_placeholder_input_40768,
        [
            _finding("spec_placeholder_in_input", ["r"], "vllm#40768"),
            _finding(
                "token_shifted", ["r"], "vllm#40768"
            ),  # the oracle counts each -1 as a position
        ],
    ),
    "late_stop_49860": (
        late_stop_49860,
        [
            _finding("scheduled_past_stop", ["r"], "vllm#49860"),
        ],
    ),
    "chunk_underflow_57562": (
        chunk_underflow_57562,
        [
            _finding("negative_count", ["a"], "vllm#57562"),
            _finding("negative_count", ["b"], "vllm#57562"),
            _finding("count_nonzero_at_finish", ["a"], "vllm#57562", severity="warning"),
            _finding("count_nonzero_at_finish", ["b"], "vllm#57562", severity="warning"),
        ],
    ),
    "double_free_33377": (
        double_free_33377,
        [
            _finding("kv_block_freed_twice", ["b", "w"], "vllm#33377"),
            _finding("kv_block_freed_twice", ["w"], "vllm#33377"),
            _finding("engine_error", ["b", "w"], "vllm#33377"),  # the pool notices at last
        ],
    ),
    "crash_aborted_52969": (
        crash_aborted_52969,
        [
            _finding("engine_error", ["a"], "vllm#52969"),
        ],
    ),
    "prefix_cache_4018": (
        prefix_cache_4018,
        [
            _finding("stale_prefix_hit_after_weight_update", ["b"], "nemo-rl#4018"),
            _finding("stale_prefix_hit_after_weight_update", ["c"], "nemo-rl#4018"),
        ],
    ),
    # Issue 25's newer members (each scenario also runs clean: test_museum.py).
    "spec_reset_46066": (
        spec_reset_46066,
        [
            _finding("negative_count", ["r"], "vllm#46066"),  # silently: no assert reached
            # The rejected drafts also came off the computed tokens: those positions are
            # computed and delivered again.
            _finding("duplicated_token", ["r"], "vllm#46066"),
            _finding("token_duplicated", ["r"], "vllm#46066"),
            _finding("count_nonzero_at_finish", ["r"], "vllm#46066", severity="warning"),
        ],
    ),
    "omni_discard_one_5183": (
        omni_discard_one_5183,
        [
            # The reset: two stale frames in flight, a count of 1 drops one, applies the other.
            _finding("stale_frame_applied", ["r"], "vllm-omni#5183"),
            _finding("token_mismatch", ["r"], "vllm-omni#5183"),
            _finding("negative_count", ["r"], "vllm-omni#5183"),
            # The drained pause: nothing in flight, a count of 1 drops the first fresh frame.
            _finding("post_resume_token_dropped", ["r"], "vllm-omni#5183"),
            _finding("placeholders_left_over", ["r"], "vllm-omni#5183", severity="warning"),
            _finding("count_nonzero_at_finish", ["r"], "vllm-omni#5183", severity="warning"),
        ],
    ),
    "admission_stalled_53130": (
        admission_stalled_53130,
        [_finding("admission_stalled", ["h1", "h2", "h3"], "vllm#53130")],
    ),
    "duplicated_token_395": (
        duplicated_token_395,
        [
            _finding("duplicated_token", ["a"], "tenstorrent-vllm#395"),  # by the frame's position
            _finding("token_duplicated", ["a"], "tenstorrent-vllm#395"),  # by the oracle's stream
        ],
    ),
    "reused_id_42492": (
        reused_id_42492,
        [
            _finding("stale_frame_applied", ["late"], "vllm#42492"),  # the old output lands
            _finding("token_mismatch", ["late"], "vllm#42492"),  # on the new request's stream
            _finding("negative_count", ["late"], "vllm#42492"),  # num_output_placeholders
            _finding("negative_count", ["late"], "vllm#42492"),  # num_fresh_in_flight
        ],
    ),
    "block_reused_45357": (
        block_reused_45357,
        [_finding("block_reused_while_in_flight", ["a", "b"], "vllm#45357")],
    ),
    "parked_while_asleep_45268": (
        parked_while_asleep_45268,
        [_finding("request_parked_after_wake", ["late"], "vllm#45268")],
    ),
    "sleep_in_flight_45520": (
        sleep_in_flight_45520,
        [
            # The sleep released the memory with step 3 in flight; the engine failed on it.
            _finding("step_in_flight_across_sleep", ["a", "b"], "vllm#45520"),
            _finding("engine_error", ["a", "b"], "vllm#45520"),
        ],
    ),
    "partial_wake_44395": (
        partial_wake_44395,
        [
            # The step scheduled on the KV cache the partial wake-up left asleep; the engine
            # failed on it.
            _finding("step_on_sleeping_kv_cache", ["a", "b"], "vllm#44395"),
            _finding("engine_error", ["a", "b"], "vllm#44395"),
        ],
    ),
    "clean_epoch_storm": (clean_epoch_storm, []),
    "clean_epoch_pause_resume": (clean_epoch_pause_resume, []),
}


def regenerate(names: list[str] | None = None) -> None:
    for name, (scenario, expected) in ZOO.items():
        if names and name not in names:
            continue
        tape = HERE / f"{name}.tape"
        remove_tape_files(tape)
        scenario(tape)
        make_self_contained(tape)  # committed: one file that reads back without -wal/-shm
        doc = {"description": " ".join((scenario.__doc__ or "").split()), "findings": expected}
        (HERE / f"{name}.expected.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(f"{tape.name}: {tape.stat().st_size} bytes")


if __name__ == "__main__":
    regenerate(sys.argv[1:] or None)
