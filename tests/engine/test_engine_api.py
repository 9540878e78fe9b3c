"""The public API: LLM.generate, the engine's commands, and bad input."""

from __future__ import annotations

import pytest

from tokentape import LLM, RequestOutput, RequestOutputKind, SamplingParams
from tokentape.replay import fold, verify


def small_llm(**kw: object) -> LLM:
    args: dict[str, object] = dict(model="oracle", tape=None, block_size=4, num_kv_blocks=64)
    args.update(kw)
    return LLM(**args)  # type: ignore[arg-type]


def expected(llm: LLM, out: RequestOutput, params: SamplingParams) -> list[int]:
    return llm.llm_engine.engine_core.runner.expected_stream(out.prompt_token_ids, params)


def test_generate_accepts_strings_and_token_lists_and_keeps_order() -> None:
    llm = small_llm()
    params = SamplingParams(max_tokens=5)
    outs = llm.generate(["Hello", [5, 6, 7], "world"], params)
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("Hello")
    assert outs[1].prompt_token_ids == [5, 6, 7]
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == expected(llm, o, params)
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)
    assert outs[0].prompt == "Hello" and outs[1].prompt is None


def test_llm_engine_is_vllms_front_end_over_an_engine_core() -> None:
    from tokentape.engine import LLMEngine
    from tokentape.engine.core import EngineCore

    llm = small_llm()
    assert isinstance(llm.llm_engine, LLMEngine) and llm.engine is llm.llm_engine
    core = llm.llm_engine.engine_core
    assert isinstance(core, EngineCore)
    # The front end takes a text prompt (tokenized there) as vLLM's LLMEngine.add_request does;
    # the core takes token ids and hands back deltas, not RequestOutputs.
    params = SamplingParams(max_tokens=3)
    llm.llm_engine.add_request("text", "Hello", params)
    llm.llm_engine.add_request("ids", llm.tokenizer.encode("Hello"), params)
    finals: dict[str, RequestOutput] = {}
    while llm.llm_engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in llm.llm_engine.step() if o.finished)
    assert finals["text"].prompt == "Hello" and finals["ids"].prompt is None
    assert finals["text"].outputs[0].token_ids == finals["ids"].outputs[0].token_ids
    core.add_request("core", [5, 6, 7], params)
    deltas = []
    while core.has_unfinished_requests():
        deltas += core.step()
    assert {d.request_id for d in deltas} == {"core"}
    assert not any(isinstance(d, RequestOutput) for d in deltas)
    assert [t for d in deltas for t in d.new_token_ids] == core.runner.expected_stream(
        [5, 6, 7], params
    )


def test_generate_takes_one_params_per_prompt() -> None:
    llm = small_llm()
    outs = llm.generate(
        [[5, 6], [7, 8]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=7)]
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 7]
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[5, 6]], [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [0, 2])
def test_every_schedule_gives_the_oracle_stream(depth: int, k: int) -> None:
    llm = small_llm(
        pipeline_depth=depth,
        num_speculative_tokens=k,
        num_kv_blocks=24,
        max_num_batched_tokens=24,
        max_num_seqs=3,
    )
    params = SamplingParams(max_tokens=30)
    outs = llm.generate([list(range(3, 3 + n)) for n in (3, 11, 20, 33, 7)], params)
    for o in outs:
        assert o.outputs[0].token_ids == expected(llm, o, params)
    assert verify(llm.llm_engine.engine_core.tape).ok
    assert fold(llm.llm_engine.engine_core.tape) == llm.llm_engine.engine_core.state
    assert llm.llm_engine.engine_core.kv.num_free_blocks == llm.llm_engine.engine_core.kv.num_blocks


def test_async_false_means_one_step_in_flight() -> None:
    llm = small_llm(async_scheduling=False, pipeline_depth=3)
    llm.llm_engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3))
    outs = llm.llm_engine.step()
    assert [o.outputs[0].token_ids for o in outs] == [[expected(llm, outs[0], SamplingParams())[0]]]


def test_async_step_returns_tokens_one_step_late() -> None:
    llm = small_llm(pipeline_depth=2)
    llm.llm_engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3))
    assert llm.llm_engine.step() == []  # step 0 in flight
    assert (
        len(llm.llm_engine.step()[0].outputs[0].token_ids) == 1
    )  # step 1 scheduled, step 0 applied


def test_stop_token_ids_finish_with_stop() -> None:
    llm = small_llm()
    full = llm.llm_engine.engine_core.runner.expected_stream(
        [9, 9, 9], SamplingParams(max_tokens=40)
    )
    stop = full[6]
    params = SamplingParams(max_tokens=40, stop_token_ids=[stop])
    out = llm.generate([[9, 9, 9]], params)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == full[: full.index(stop) + 1]


def test_abort_request_finishes_with_abort_and_frees_blocks() -> None:
    llm = small_llm(pipeline_depth=2)
    e = llm.llm_engine
    e.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50))
    e.add_request("b", [8, 9], SamplingParams(max_tokens=5))
    for _ in range(3):
        e.step()
    e.abort_request("a")
    outs = e.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    while e.has_unfinished_requests():
        e.step()
    assert e.engine_core.state.requests["b"].finish_reason == "length"
    assert e.engine_core.kv.num_free_blocks == e.engine_core.kv.num_blocks
    assert verify(e.engine_core.tape).ok


def test_pause_abort_aborts_everything() -> None:
    llm = small_llm(pipeline_depth=2)
    e = llm.llm_engine
    for i in range(3):
        e.add_request(str(i), [5, 6, 7 + i], SamplingParams(max_tokens=50))
    e.step(), e.step()
    e.pause_generation(mode="abort")
    assert e.is_paused()
    outs = e.step()
    assert {o.request_id for o in outs if o.finished} == {"0", "1", "2"}
    assert not e.has_unfinished_requests()
    e.resume_generation()
    assert not e.is_paused()
    assert verify(e.engine_core.tape).ok


def test_pause_wait_finishes_running_and_admits_nothing_new() -> None:
    llm = small_llm(pipeline_depth=2, max_num_seqs=1)
    e = llm.llm_engine
    e.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6))
    e.add_request("b", [5, 6, 8], SamplingParams(max_tokens=6))
    e.step()
    e.pause_generation(mode="wait", clear_cache=False)
    assert e.engine_core.state.requests["a"].finish_reason == "length"
    assert e.engine_core.state.requests["b"].status.value == "waiting"
    assert e.step() and e.step() == []  # the drained outputs, then nothing while paused
    e.resume_generation()
    while e.has_unfinished_requests():
        e.step()
    assert e.engine_core.state.requests["b"].finish_reason == "length"
    assert verify(e.engine_core.tape).ok


def test_pause_keep_holds_requests_and_resume_continues_them() -> None:
    llm = small_llm(pipeline_depth=3)
    e = llm.llm_engine
    params = SamplingParams(max_tokens=20)
    e.add_request("a", [5, 6, 7], params)
    got: list[int] = []
    for _ in range(6):
        got = next((o.outputs[0].token_ids for o in e.step()), got)  # cumulative
    e.pause_generation(mode="keep", clear_cache=True)
    req = e.engine_core.state.requests["a"]
    assert (
        not req.num_in_flight and req.num_computed_tokens == 0 and req.status.value == "preempted"
    )
    assert e.engine_core.kv.num_free_blocks == e.engine_core.kv.num_blocks
    for _ in range(3):
        got = next((o.outputs[0].token_ids for o in e.step()), got)
    assert req.num_computed_tokens == 0  # nothing runs while paused
    e.resume_generation()
    while e.has_unfinished_requests():
        got = next((o.outputs[0].token_ids for o in e.step()), got)
    assert got == e.engine_core.runner.expected_stream([5, 6, 7], params)


def test_reset_prefix_cache_fails_while_running_unless_reset() -> None:
    llm = small_llm(pipeline_depth=1)
    e = llm.llm_engine
    e.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=5))
    e.step()
    assert e.reset_prefix_cache() is False
    assert e.engine_core.state.requests["a"].status.value == "running"
    assert e.reset_prefix_cache(reset_running_requests=True) is True
    assert e.engine_core.state.requests["a"].status.value == "preempted"
    while e.has_unfinished_requests():
        e.step()
    assert e.reset_prefix_cache() is True


def test_prefix_cache_hits_skip_computed_tokens() -> None:
    llm = small_llm(pipeline_depth=1)
    prompt = list(range(3, 23))  # 20 tokens: four full blocks of 4 can be shared
    llm.generate([prompt], SamplingParams(max_tokens=2))
    llm.llm_engine.add_request("again", prompt + [99], SamplingParams(max_tokens=2))
    llm.llm_engine.step()
    scheduled = [
        e
        for _, e in llm.llm_engine.engine_core.tape.iter_events()
        if type(e).__name__ == "StepScheduled"
    ]
    entry = scheduled[-1].entries[0]
    assert entry.req_id == "again" and entry.num_computed_before == 20


def test_llm_reset_prefix_cache_makes_the_next_round_compute_from_scratch() -> None:
    """vLLM's LLM.reset_prefix_cache, as a benchmark calls it between two rounds."""
    llm = small_llm(pipeline_depth=1)
    prompt = list(range(3, 23))
    llm.generate([prompt], SamplingParams(max_tokens=2))
    assert llm.reset_prefix_cache() is True
    llm.generate([prompt], SamplingParams(max_tokens=2))
    events = [e for _, e in llm.llm_engine.engine_core.tape.iter_events()]
    names = [type(e).__name__ for e in events]
    reset = events[names.index("PrefixCacheReset")]
    assert (reset.reset_running_requests, reset.ok) == (False, True)
    after = events[names.index("StepScheduled", names.index("PrefixCacheReset"))]
    assert after.entries[0].num_computed_before == 0  # the second round: no prefix hit


def test_chunked_prefill_respects_the_token_budget() -> None:
    llm = small_llm(pipeline_depth=1, max_num_batched_tokens=8)
    llm.llm_engine.add_request("a", list(range(3, 23)), SamplingParams(max_tokens=2))
    llm.llm_engine.step()
    state = llm.llm_engine.engine_core.state.requests["a"]
    assert state.num_computed_tokens == 8 and state.output_token_ids == []


def test_kv_pressure_preempts_the_latest_running_request() -> None:
    llm = small_llm(pipeline_depth=1, num_kv_blocks=6)
    e = llm.llm_engine
    e.add_request("a", list(range(3, 10)), SamplingParams(max_tokens=12, ignore_eos=True))
    e.add_request("b", list(range(3, 10)) + [40], SamplingParams(max_tokens=12, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    assert e.engine_core.state.requests["b"].num_preemptions >= 1
    assert e.engine_core.state.requests["a"].num_preemptions == 0
    preempts = [
        ev for _, ev in e.engine_core.tape.iter_events() if type(ev).__name__ == "RequestPreempted"
    ]
    assert preempts and all(p.reason == "kv_pressure" for p in preempts)


# -- bad input: a clear error, and the engine keeps serving -------------------------------------


def test_bad_input_gets_clear_errors_and_the_engine_keeps_serving() -> None:
    llm = small_llm(num_kv_blocks=8)
    e = llm.llm_engine
    e.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        e.abort_request("nope")
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("ok", [5], SamplingParams())
    with pytest.raises(ValueError, match="maximum context length is 32 tokens"):
        e.add_request("long", list(range(3, 40)), SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="seed must be a 64-bit signed integer"):
        SamplingParams(seed=2**70)  # would not fit on the tape, killing the engine mid-step
    with pytest.raises(
        ValueError, match=r"prompt_token_ids\[1\] must be a token id in the vocabulary"
    ):
        e.add_request("oov", [5, 100000], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        e.add_request("empty", [], SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        e.add_request("dict", [5], {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        e.pause_generation(mode="sleep")
    while e.has_unfinished_requests():
        e.step()
    assert e.engine_core.state.requests["ok"].finish_reason == "length"
    assert set(e.engine_core.state.requests) == {
        "ok"
    }  # nothing of the refused requests reached the tape
    assert verify(e.engine_core.tape).ok


def test_bad_engine_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="pipeline_depth"):
        LLM(model="oracle", tape=None, pipeline_depth=5)
    with pytest.raises(ValueError, match="discard_policy"):
        LLM(model="oracle", tape=None, discard_policy="never")
    with pytest.raises(ValueError, match="unknown model"):
        LLM(model="gpt-9", tape=None)
    with pytest.raises(TypeError):
        LLM(model="oracle", tape=None, no_such_option=1)


def test_generate_refuses_while_paused() -> None:
    llm = small_llm()
    llm.llm_engine.pause_generation(mode="keep")
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate(["hi"])


def test_readmitted_prefill_ending_one_token_short_sends_that_token() -> None:
    # After a reset the request is recomputed in chunks of 2 (prompt 2 + 1 output = 3
    # tokens): the last chunk holds one confirmed token the runner never saw in this epoch.
    llm = small_llm(pipeline_depth=1, max_num_batched_tokens=2)
    e = llm.llm_engine
    params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)
    e.add_request("r", [3, 3], params)
    got = [t for o in e.step() for t in o.outputs[0].token_ids]
    assert e.reset_prefix_cache(reset_running_requests=True)
    while e.has_unfinished_requests():
        got += [t for o in e.step() for t in o.outputs[0].token_ids]
    assert got == e.engine_core.runner.expected_stream([3, 3], params)


def test_a_request_finished_by_the_scheduler_is_reported_to_the_client() -> None:
    # Under `counter` with speculative decoding, dropped fresh frames leave positions
    # computed until the scheduler caps the request at max_model_len. That finish happens
    # while scheduling, with nothing in flight: the client must still be told.
    llm = small_llm(
        pipeline_depth=2,
        num_speculative_tokens=1,
        discard_policy="counter",
        num_kv_blocks=8,
        enable_prefix_caching=False,
    )
    e = llm.llm_engine
    e.add_request("first", [3], SamplingParams(max_tokens=9))
    for i in range(3):
        e.add_request(f"short{i}", [3], SamplingParams(max_tokens=1))
    e.add_request("long", [7, 8, 9, 10, 11, 12, 13, 14] + [3] * 7, SamplingParams(max_tokens=17))
    finished = {}
    for _ in range(500):
        if not e.has_unfinished_requests():
            break
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert set(finished) == {"first", "short0", "short1", "short2", "long"}
    assert all(r.finish_reason == finished[r.req_id] for r in e.engine_core.state.requests.values())


def test_step_returns_outputs_by_output_kind_cumulative_by_default() -> None:
    # vLLM's LLMEngine.step(): every token so far unless the request asked otherwise.
    llm = small_llm(pipeline_depth=1)
    e = llm.llm_engine
    kinds = {
        "cum": RequestOutputKind.CUMULATIVE,
        "delta": RequestOutputKind.DELTA,
        "final": RequestOutputKind.FINAL_ONLY,
    }
    for req_id, kind in kinds.items():
        e.add_request(req_id, [5, 6, 7], SamplingParams(max_tokens=4, output_kind=kind))
    seen: dict[str, list[list[int]]] = {k: [] for k in kinds}
    while e.has_unfinished_requests():
        for out in e.step():
            seen[out.request_id].append(out.outputs[0].token_ids)
    want = e.engine_core.runner.expected_stream([5, 6, 7], SamplingParams(max_tokens=4))
    assert seen["cum"] == [want[:n] for n in range(1, 5)]
    assert seen["delta"] == [[t] for t in want]
    assert seen["final"] == [want]
    # The tape records the same new tokens whatever the kind.
    emitted = [
        x
        for _, ev in e.engine_core.tape.iter_events()
        if type(ev).__name__ == "OutputsEmitted"
        for x in ev.entries
    ]
    for req_id in kinds:
        assert [t for x in emitted if x.req_id == req_id for t in x.token_ids] == want
    assert verify(e.engine_core.tape).ok
    assert [
        o.outputs[0].token_ids
        for o in llm.generate(
            [[5, 6, 7]] * 3, [SamplingParams(max_tokens=4, output_kind=k) for k in kinds.values()]
        )
    ] == [want] * 3


def test_the_steps_in_flight_are_the_reducers_and_match_the_runner() -> None:
    """The engine keeps no list of its own: what the reducer holds in flight is exactly what
    the runner was handed and has not returned, at every step boundary, through a pause."""
    from tokentape.engine.runners.oracle import OracleRunner

    class Recording(OracleRunner):
        def __init__(self) -> None:
            super().__init__(cyclic=True, seed=0)
            self.outstanding: list[int] = []

        def submit(self, batch):  # type: ignore[no-untyped-def]
            self.outstanding.append(batch.step)
            super().submit(batch)

        def collect(self, step):  # type: ignore[no-untyped-def]
            assert self.outstanding.pop(0) == step
            return super().collect(step)

    for depth in (1, 2, 4):
        llm = LLM(model="oracle", tape=None, pipeline_depth=depth)
        runner = Recording()
        llm.llm_engine.engine_core.runner = runner
        llm.llm_engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=12))
        llm.llm_engine.add_request("b", [6, 7], SamplingParams(max_tokens=9))
        seen = set()
        for i in range(200):
            if i == 5:
                llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
                assert (
                    not llm.llm_engine.engine_core.state.in_flight_steps and not runner.outstanding
                )
                llm.llm_engine.resume_generation()
            if not llm.llm_engine.has_unfinished_requests():
                break
            llm.llm_engine.step()
            in_flight = [s.step for s in llm.llm_engine.engine_core.state.in_flight_steps]
            assert in_flight == runner.outstanding
            assert len(in_flight) <= depth
            seen.add(len(in_flight))
        assert not llm.llm_engine.has_unfinished_requests()
        assert max(seen) == depth - 1  # the pipeline filled: one frame applied per step


@pytest.mark.parametrize("depth", [2, 4])
def test_generate_stopped_by_a_token_ends_with_a_complete_tape(tmp_path, depth: int) -> None:
    """A request that stops on a stop token has steps scheduled after it in flight; generate
    collects their frames before it returns, so the tape ends complete, not mid-run."""
    from tokentape.postmortem import postmortem

    probe = small_llm()
    stream = probe.llm_engine.engine_core.runner.expected_stream(
        [5, 6, 7], SamplingParams(max_tokens=30)
    )
    stop_at = next(i for i in range(3, 30) if stream[i] not in stream[:i])
    params = SamplingParams(max_tokens=30, stop_token_ids=(stream[stop_at],))
    llm = small_llm(pipeline_depth=depth, tape=str(tmp_path / "run.tape"))
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == stream[: stop_at + 1]
    assert not llm.llm_engine.engine_core.state.in_flight_steps
    llm.close()
    report = postmortem(tmp_path / "run.tape")
    assert [f.kind for f in report.findings] == []
    assert verify(str(tmp_path / "run.tape")).ok
