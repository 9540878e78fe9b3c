"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) through the real model: the values
of a dense forward pass, the same whether the prompt is prefilled in one step or in chunks,
no prefix-cache hits for such a request, on the tape with the chunk that finished the prompt,
in the first output only, replayed by verify, refused before anything is recorded."""

from __future__ import annotations

import msgspec
import pytest
from dense_reference import dense_logits

from tokentape import LLM, RequestOutputKind, SamplingParams
from tokentape.engine.model.loader import builtin_model
from tokentape.events import schema as ev
from tokentape.replay import verify
from tokentape.replay.tape import load_tape

PROMPT = "The quick brown fox jumps over the lazy dog"  # 43 tokens: 6 chunks of 8
PLP = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3)


def tiny_llm(**kw: object) -> LLM:
    args: dict[str, object] = {"model": "tiny", "device": "cpu", "tape": None, "seed": 0}
    args.update(kw)
    return LLM(**args)  # type: ignore[arg-type]


def frames(llm: LLM) -> list[tuple[int, ev.FrameEntry]]:
    return [
        (event.step, e)
        for _, event in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(event, ev.FrameProduced)
        for e in event.entries
    ]


def scheduled(llm: LLM) -> list[tuple[int, ev.ScheduledEntry]]:
    return [
        (event.step, e)
        for _, event in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(event, ev.StepScheduled)
        for e in event.entries
    ]


def test_prompt_logprobs_are_the_dense_models_log_softmax() -> None:
    _, model = builtin_model("tiny", 0)
    llm = tiny_llm()
    out = llm.generate([PROMPT, "a"], PLP, use_tqdm=False)
    for o in out:
        ids, plp = o.prompt_token_ids, o.prompt_logprobs
        assert plp is not None and len(plp) == len(ids) and plp[0] is None
        ref = dense_logits(model, ids).log_softmax(-1)
        for pos in range(1, len(ids)):
            row = plp[pos]
            assert row is not None
            # vLLM's dict: the prompt token first, then the 3 most likely (it may be one).
            assert next(iter(row)) == ids[pos] and len(row) in (3, 4)
            for tok, lp in row.items():
                assert lp == pytest.approx(float(ref[pos - 1, tok]), abs=1e-4)
            best = sorted(ref[pos - 1].tolist(), reverse=True)[:3]
            tops = list(row.values())[1:] if len(row) == 4 else sorted(row.values())[::-1]
            assert tops == pytest.approx(best, abs=1e-4)
    assert out[1].prompt_logprobs == [None]  # a one-token prompt: only its first position
    # Only a request that asks gets them; prompt_logprobs=0: the prompt token's alone.
    bare = llm.generate([PROMPT], msgspec.structs.replace(PLP, prompt_logprobs=None))[0]
    assert bare.prompt_logprobs is None
    zero = llm.generate([PROMPT], msgspec.structs.replace(PLP, prompt_logprobs=0))[0]
    assert zero.prompt_logprobs is not None
    assert [list(r) for r in zero.prompt_logprobs[1:]] == [[t] for t in zero.prompt_token_ids[1:]]
    first = out[0].prompt_logprobs
    assert first is not None
    assert [r[t] for r, t in zip(zero.prompt_logprobs[1:], zero.prompt_token_ids[1:])] == [
        r[t] for r, t in zip(first[1:], out[0].prompt_token_ids[1:])
    ]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_chunked_prefill_gives_the_unchunked_prompt_logprobs(depth: int) -> None:
    whole = tiny_llm(pipeline_depth=depth)
    chunked = tiny_llm(pipeline_depth=depth, max_num_batched_tokens=8)
    a = whole.generate([PROMPT], PLP)[0]
    b = chunked.generate([PROMPT], PLP)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert x is not None and y is not None and list(x) == list(y)
        assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)
    # On the tape: the prefill took six steps, and the frame of the last carries them all.
    steps = [step for step, e in scheduled(chunked) if e.num_computed_before < len(PROMPT)]
    assert len(steps) == 6
    carried = [(step, f) for step, f in frames(chunked) if f.prompt_logprobs is not None]
    assert [step for step, _ in carried] == [steps[-1]]
    plp = carried[0][1].prompt_logprobs
    assert plp is not None and len(plp.token_logprobs) == len(PROMPT) - 1
    assert len(plp.top_token_ids) == len(plp.top_logprobs) == len(PROMPT) - 1


def test_a_request_asking_for_prompt_logprobs_takes_no_prefix_cache_hit() -> None:
    llm = tiny_llm(block_size=4)
    plain = msgspec.structs.replace(PLP, prompt_logprobs=None)
    llm.generate([PROMPT], plain)  # its full blocks are now in the prefix cache
    llm.generate([PROMPT], plain)  # the same prompt again: a hit (the check can fail)
    llm.generate([PROMPT], PLP)
    admitted = [
        e.num_computed_before for _, e in scheduled(llm) if e.new_block_ids and e.num_new_tokens > 1
    ]
    assert admitted[0] == 0 and admitted[1] == 40 and admitted[2] == 0


def test_prompt_logprobs_come_in_the_first_output_only() -> None:
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        llm = tiny_llm(max_num_batched_tokens=8)
        params = msgspec.structs.replace(PLP, max_tokens=4, output_kind=kind)
        llm.llm_engine.add_request("r", PROMPT, params)
        outs = []
        while llm.llm_engine.has_unfinished_requests():
            outs += llm.llm_engine.step()
        assert len(outs) == 4 and outs[-1].finished
        first = outs[0].prompt_logprobs
        assert first is not None and len(first) == len(PROMPT)
        assert all(o.prompt_logprobs == [] for o in outs[1:])  # vLLM's: popped with the first


def test_a_prefill_preempted_midway_scores_the_prompt_again() -> None:
    """A pause that clears the cache preempts a chunked prefill halfway: the runner forgets
    the rows it had, and the recompute gives the whole prompt's, as an undisturbed run."""
    expected = tiny_llm(max_num_batched_tokens=8).generate([PROMPT], PLP)[0]
    llm = tiny_llm(max_num_batched_tokens=8, pipeline_depth=2)
    engine = llm.llm_engine
    engine.add_request("r", llm.tokenizer.encode(PROMPT), PLP)
    outs = engine.step() + engine.step() + engine.step()
    engine.pause_generation(mode="keep", clear_cache=True)
    assert engine.engine_core.num_preemptions == 1
    engine.resume_generation()
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[0].prompt_logprobs == expected.prompt_logprobs
    assert [t for o in outs for t in o.outputs[0].token_ids][-3:] == expected.outputs[0].token_ids
    # Preempted once its prompt is on the tape, it is not scored a second time.
    params = msgspec.structs.replace(PLP, max_tokens=6)
    expected = tiny_llm().generate([PROMPT], params)[0]
    llm = tiny_llm(pipeline_depth=2)
    llm.llm_engine.add_request("r", llm.tokenizer.encode(PROMPT), params)
    outs = llm.llm_engine.step() + llm.llm_engine.step() + llm.llm_engine.step()
    assert outs and outs[0].prompt_logprobs == expected.prompt_logprobs
    llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
    assert llm.llm_engine.engine_core.num_preemptions == 1
    llm.llm_engine.resume_generation()
    while llm.llm_engine.has_unfinished_requests():
        outs += llm.llm_engine.step()
    assert sum(f.prompt_logprobs is not None for _, f in frames(llm)) == 1
    assert outs[-1].outputs[0].token_ids == expected.outputs[0].token_ids


def test_a_tape_with_prompt_logprobs_round_trips_and_verifies(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "plp.tape"
    llm = tiny_llm(tape=str(path), max_num_batched_tokens=8, pipeline_depth=2)
    outs = llm.generate([PROMPT, "tokentape " * 3], [PLP, msgspec.structs.replace(PLP, n=2)])
    llm.close()
    tape = load_tape(path)
    assert tape.header.format_version == ev.FORMAT_VERSION >= 4  # format 4 added them
    state = tape.fold()
    kept = state.requests["0"].prompt_logprobs
    assert kept is not None and len(kept.token_logprobs) == len(PROMPT) - 1
    first = outs[0].prompt_logprobs
    assert first is not None
    assert [r[t] for r, t in zip(first[1:], outs[0].prompt_token_ids[1:])] == kept.token_logprobs  # type: ignore[index]
    assert outs[1].prompt_logprobs is not None and len(outs[1].outputs) == 2
    result = verify(path)
    assert result.ok, result.first_divergence and result.first_divergence.format()


def test_a_bad_prompt_logprobs_is_refused_before_anything_is_recorded() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)  # type: ignore[arg-type]
    llm = tiny_llm(max_logprobs=5)
    before = llm.llm_engine.engine_core.state.num_events
    with pytest.raises(ValueError, match="prompt_logprobs must be at most 5"):
        llm.llm_engine.add_request("r", [5, 6, 7], msgspec.structs.replace(PLP, prompt_logprobs=6))
    assert llm.llm_engine.engine_core.state.num_events == before
    assert llm.generate(["ok"], msgspec.structs.replace(PLP, prompt_logprobs=5))[0].prompt_logprobs
    oracle = LLM(model="oracle", tape=None)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        oracle.llm_engine.add_request("r", [5, 6, 7], SamplingParams(prompt_logprobs=0))
    assert oracle.llm_engine.engine_core.state.num_events == 0


def test_the_reducer_refuses_prompt_logprobs_that_do_not_fit_the_prompt() -> None:
    from tokentape.events.fold_errors import ReducerError
    from tokentape.events.reducer import evolve, initial_state

    def run(plp: ev.PromptLogprobs, k: int | None = 0) -> None:
        state = initial_state()
        params = SamplingParams(max_tokens=2, prompt_logprobs=k)
        evolve(state, ev.RequestAdded(0, "r", [5, 6, 7], params))
        evolve(state, ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 3, 0, [0])]))
        evolve(state, ev.FrameProduced(0, [ev.FrameEntry("r", [9], prompt_logprobs=plp)]))
        assert state.requests["r"].prompt_logprobs == plp

    run(ev.PromptLogprobs([-1.0, -2.0]))
    for bad, k in (
        (ev.PromptLogprobs([-1.0]), 0),  # one position short
        (ev.PromptLogprobs([-1.0, -2.0]), None),  # never asked for
        (ev.PromptLogprobs([-1.0, -2.0]), 1),  # no top ids with k = 1
    ):
        with pytest.raises(ReducerError, match="prompt logprobs"):
            run(bad, k)
