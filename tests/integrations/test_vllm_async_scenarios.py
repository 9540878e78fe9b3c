"""vLLM's own async-scheduler scenarios, on tokentape's engine.

The facts come from vLLM's tests/v1/core/test_async_scheduler.py and
tests/v1/e2e/general/test_async_scheduling.py; the tests are written anew. The oracle model
knows every request's stream, so each scenario is checked against it; the consistency
matrix runs the tiny model (greedy, with logprobs), small shapes."""

from __future__ import annotations

from typing import Any

import pytest

from tokentape import LLM, SamplingParams
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.events import schema as ev
from tokentape.events.discard import discard_count
from tokentape.events.reducer import evolve
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape

PROMPT = list(range(10, 26))  # 16 tokens: 4 blocks of 4


def _llm(model: str = "oracle-random", **kw: Any) -> LLM:
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 64}
    args.update(kw)
    return LLM(model=model, tape=None, **args)


def _run(llm: LLM, limit: int = 3000) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _ in range(limit):
        if not llm.llm_engine.has_unfinished_requests():
            return got
        for out in llm.llm_engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
    raise AssertionError("the engine did not finish")


def _expected(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    runner = llm.llm_engine.engine_core.runner
    assert isinstance(runner, OracleRunner)
    return runner.expected_stream(prompt, params)


def _events(llm: LLM) -> list[ev.Event]:
    return [e for _, e in load_tape(llm.llm_engine.engine_core.tape).events()]


def _scheduled_tokens(llm: LLM) -> dict[str, int]:
    total: dict[str, int] = {}
    for e in _events(llm):
        if isinstance(e, ev.StepScheduled):
            for x in e.entries:
                total[x.req_id] = total.get(x.req_id, 0) + x.num_new_tokens
    return total


def _clean(llm: LLM) -> None:
    report = postmortem(llm.llm_engine.engine_core.tape)
    assert report.findings == [], [f.message for f in report.findings]


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_stop_by_max_tokens_schedules_prompt_plus_max_tokens_minus_one(
    depth: int, max_tokens: int
) -> None:
    llm = _llm(pipeline_depth=depth)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(3):
        llm.llm_engine.add_request(f"r{i}", PROMPT[i:], params)
    got = _run(llm)
    for i in range(3):
        assert got[f"r{i}"] == _expected(llm, PROMPT[i:], params)
    # Not one step past the stop, however deep the pipeline: the last token is never an input.
    assert _scheduled_tokens(llm) == {f"r{i}": len(PROMPT[i:]) + max_tokens - 1 for i in range(3)}
    _clean(llm)


def test_abort_order_with_two_steps_in_flight() -> None:
    order = [0, 8, 3, 1, 6, 4, 2, 5, 7, 9]
    llm = _llm(pipeline_depth=2)
    for i in range(10):
        llm.llm_engine.add_request(
            str(i), PROMPT[i % 5 :], SamplingParams(max_tokens=100, ignore_eos=True)
        )
    got: dict[str, list[int]] = {}
    for victim in order:
        for out in llm.llm_engine.step():  # schedules a step; from the second on, applies one
            got[out.request_id] = list(out.outputs[0].token_ids)
        llm.llm_engine.abort_request(str(victim))
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
    state = llm.llm_engine.engine_core.state
    for position, victim in enumerate(order):
        req = state.requests[str(victim)]
        assert req.finish_reason == "abort"
        assert len(req.output_token_ids) == position  # its position in the order
        assert got.get(str(victim), []) == req.output_token_ids
        assert req.num_output_placeholders == 0 and req.num_in_flight == 0
    _clean(llm)


def _fold_checking(llm: LLM, check: Any) -> None:
    """Fold the tape event by event, calling check(state, event) after each."""
    tape = load_tape(llm.llm_engine.engine_core.tape)
    state = tape.initial_state()
    for _, e in tape.events():
        evolve(state, e)
        check(state, e)


def test_spec_placeholders_of_unscheduled_requests_are_cleared() -> None:
    # A small budget leaves running requests out of steps, and KV pressure preempts some.
    llm = _llm(
        pipeline_depth=2,
        num_speculative_tokens=2,
        max_num_batched_tokens=10,
        num_kv_blocks=20,
        model="oracle",
    )
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for i in range(5):
        llm.llm_engine.add_request(f"s{i}", PROMPT[i : i + 9], params)
    got = _run(llm)
    assert all(got[f"s{i}"] == _expected(llm, PROMPT[i : i + 9], params) for i in range(5))
    left_out = 0

    def check(state: Any, e: ev.Event) -> None:
        nonlocal left_out
        if isinstance(e, ev.StepScheduled):
            step_ids = {x.req_id for x in e.entries}
            left_out += sum(r not in step_ids for r in state.running)
        for req in state.requests.values():  # placeholders are exactly the fresh slots in flight
            fresh = [x for _, x in state.in_flight_entries(req.req_id) if x.epoch == req.epoch]
            sampling = [
                x
                for s in state.in_flight_steps
                for x in s.entries
                if x.req_id == req.req_id and x.epoch == req.epoch and s.samples(x)
            ]
            assert len(fresh) >= len(sampling)
            if req.stop_reason is None:
                assert req.num_output_placeholders == sum(1 + x.num_spec_tokens for x in sampling)

    _fold_checking(llm, check)
    assert left_out > 0  # the scenario did leave requests out
    # An admission (fresh or after a preemption) never carries draft slots.
    admitted = set()
    for e in _events(llm):
        if isinstance(e, ev.RequestPreempted):
            admitted.discard(e.req_id)
        if isinstance(e, ev.StepScheduled):
            for x in e.entries:
                if x.req_id not in admitted:
                    assert x.num_spec_tokens == 0
                    admitted.add(x.req_id)
    _clean(llm)


def test_prefix_cache_dedup_within_a_step_and_hits_on_a_second_turn() -> None:
    llm = _llm(pipeline_depth=2)
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    llm.llm_engine.add_request("a", PROMPT, params)
    llm.llm_engine.add_request("b", PROMPT, params)
    got = _run(llm)
    first = next(e for e in _events(llm) if isinstance(e, ev.StepScheduled))
    a, b = first.entries
    # b is scheduled in the same step as a and shares a's full blocks: computed once.
    assert (
        a.num_computed_before == 0 and b.num_computed_before == 12
    )  # the last block stays b's own
    assert b.new_block_ids[:3] == a.new_block_ids[:3]
    assert got["a"] == got["b"] == _expected(llm, PROMPT, params)
    # Second turn: the conversation so far hits the cache (prompt and confirmed output).
    turn2 = PROMPT + got["a"] + [40, 41]
    llm.llm_engine.add_request("a2", turn2, params)
    n = len(_events(llm))
    got2 = _run(llm)
    entry = next(x for e in _events(llm)[n:] if isinstance(e, ev.StepScheduled) for x in e.entries)
    # Only confirmed tokens are hashed: a's blocks up to position 20. Its block 20-23 was full
    # only with placeholders when a was last scheduled (as vLLM's allocate_slots caches
    # min(computed, num_tokens)), and a finished before another schedule confirmed it.
    assert entry.req_id == "a2" and entry.num_computed_before == 20
    assert got2["a2"] == _expected(llm, turn2, params)
    _clean(llm)


@pytest.mark.parametrize("policy", ["epoch", "deliver"])
def test_no_placeholder_underflow_on_stale_spec_output(policy: str) -> None:
    llm = _llm(
        pipeline_depth=3,
        num_speculative_tokens=3,
        discard_policy=policy,
        model="oracle",
        num_kv_blocks=22,
        max_num_seqs=4,
    )
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(4):
        llm.llm_engine.add_request(f"u{i}", PROMPT[i : i + 10], params)
    for _ in range(6):
        llm.llm_engine.step()
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)  # stale spec output in flight
    got = _run(llm)
    assert all(got[f"u{i}"] == _expected(llm, PROMPT[i : i + 10], params) for i in range(4))

    def check(state: Any, e: ev.Event) -> None:
        for req in state.requests.values():
            assert req.num_output_placeholders >= 0, (e, req.req_id)

    _fold_checking(llm, check)
    events = _events(llm)
    assert any(isinstance(e, ev.RequestPreempted) and e.in_flight for e in events)
    _clean(llm)


def test_a_preemption_marks_all_in_flight_output_stale() -> None:
    llm = _llm(pipeline_depth=3, num_kv_blocks=14, max_num_seqs=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for i in range(3):
        llm.llm_engine.add_request(f"q{i}", PROMPT[i : i + 12], params)
    got = _run(llm)
    assert all(got[f"q{i}"] == _expected(llm, PROMPT[i : i + 12], params) for i in range(3))
    seen = 0

    def check(state: Any, e: ev.Event) -> None:
        nonlocal seen
        if isinstance(e, ev.RequestPreempted):
            req = state.requests[e.req_id]
            assert req.num_stale_in_flight == e.in_flight == len(state.in_flight_entries(e.req_id))
            assert (
                req.num_fresh_in_flight
                == req.num_partial_in_flight
                == req.num_output_placeholders
                == 0
            )
            seen += e.in_flight

    _fold_checking(llm, check)
    assert seen >= 2  # preempted with two steps in flight at least once
    dropped = sum(r.num_frames_dropped for r in llm.llm_engine.engine_core.state.requests.values())
    assert dropped == seen  # every stale frame, and only those, dropped (epoch)
    _clean(llm)


def test_a_reset_preemption_drops_in_flight_output_under_deliver() -> None:
    llm = _llm(pipeline_depth=3, discard_policy="deliver")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm.llm_engine.add_request("r", PROMPT, params)
    for _ in range(6):
        llm.llm_engine.step()
    req = llm.llm_engine.engine_core.state.requests["r"]
    in_flight = req.num_in_flight
    assert in_flight == 2
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    assert req.drop_stale_output and req.num_stale_in_flight == in_flight
    assert discard_count(llm.llm_engine.engine_core.state, req) == in_flight
    got = _run(llm)
    assert req.num_frames_dropped == in_flight  # dropped, not delivered
    assert got["r"] == _expected(llm, PROMPT, params)
    _clean(llm)


def test_greedy_output_unchanged_by_a_reset_at_step_10() -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT[:7], PROMPT[3:12], PROMPT[5:]]
    runs = []
    for reset in (False, True):
        llm = _llm("tiny", pipeline_depth=2, cpu_threads=1)
        for i, p in enumerate(prompts):
            llm.llm_engine.add_request(str(i), p, params)
        got: dict[str, list[int]] = {}
        while llm.llm_engine.has_unfinished_requests():
            if reset and llm.llm_engine.engine_core.state.step == 10:
                assert llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
                reset = False
            for out in llm.llm_engine.step():
                got[out.request_id] = list(out.outputs[0].token_ids)
        assert not reset
        runs.append(got)
        llm.close()
    assert runs[0] == runs[1] and all(len(v) == 24 for v in runs[0].values())


def _matrix_run(
    async_scheduling: bool, kv_blocks: int, budget: int, params: SamplingParams
) -> tuple[Any, int]:
    llm = _llm(
        "tiny",
        async_scheduling=async_scheduling,
        num_kv_blocks=kv_blocks,
        max_num_batched_tokens=budget,
        cpu_threads=1,
        max_num_seqs=4,
    )
    prompts = [PROMPT[:9], PROMPT[2:14], PROMPT[4:], PROMPT[1:6]]
    outs = llm.generate(prompts, params)
    preempted = sum(isinstance(e, ev.RequestPreempted) for e in _events(llm))
    result = [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]
    llm.close()
    return result, preempted


def _flat(logprobs: Any) -> list[float]:
    """Per position, the sampled token's logprob and its alternatives', in a fixed order."""
    out: list[float] = []
    for x in logprobs or []:
        out += (
            [x]
            if isinstance(x, float)
            else [float(getattr(v, "logprob", v)) for _, v in sorted(x.items())]
        )
    return out


SAMPLING = {
    "greedy": SamplingParams(max_tokens=14, temperature=0.0, logprobs=1, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=14, temperature=0.8, seed=7, logprobs=2, ignore_eos=True),
    "penalties": SamplingParams(
        max_tokens=14,
        temperature=0.0,
        logprobs=0,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        ignore_eos=True,
    ),
    "n2_min_tokens": SamplingParams(
        max_tokens=10, temperature=1.0, seed=3, n=2, min_tokens=4, logprobs=1
    ),
}


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
def test_consistency_matrix(sampling: str) -> None:
    """Preemption forced by a small KV cache x async on/off x chunked prefill: the same tokens
    and logprobs as a synchronous run with room for everything."""
    params = SAMPLING[sampling]
    reference, none = _matrix_run(False, 256, 8192, params)
    assert none == 0
    preemptions = 0
    for async_scheduling in (False, True):
        for budget in (8192, 6):  # whole prompts, or chunks of 6 tokens
            got, preempted = _matrix_run(async_scheduling, 13, budget, params)
            # Tokens exactly; logprobs to float rounding (as vLLM's test): a recomputed position
            # comes out of a prefill, where it first came out of a decode.
            assert [[t for t, _ in o] for o in got] == [[t for t, _ in o] for o in reference], (
                async_scheduling,
                budget,
            )
            for o, r in zip(got, reference):
                for (_, lp), (_, ref_lp) in zip(o, r):
                    assert _flat(lp) == pytest.approx(_flat(ref_lp), abs=1e-4), (
                        async_scheduling,
                        budget,
                    )
            preemptions += preempted
    assert preemptions > 0  # the small cache did force preemptions
