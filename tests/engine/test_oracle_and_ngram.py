from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokentape.engine.ngram import propose_ngram_drafts
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.events.schema import SamplingParams


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    assert propose_ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert propose_ngram_drafts([5, 6, 7], 3) == []
    assert propose_ngram_drafts([4, 4, 4], 0) == []
    assert propose_ngram_drafts([1, 2, 1], 3, max_n=3, min_n=1) == [2, 1]


def test_oracle_is_a_pure_function_of_prompt_position_and_seed() -> None:
    a, b = OracleRunner(seed=0), OracleRunner(seed=0)
    p = SamplingParams(max_tokens=20)
    assert a.expected_stream([5, 6, 7], p) == b.expected_stream([5, 6, 7], p)
    assert a.expected_stream([5, 6, 7], p) != a.expected_stream([5, 6, 8], p)
    assert a.expected_stream([5, 6, 7], p) != a.expected_stream(
        [5, 6, 7], SamplingParams(max_tokens=20, seed=3)
    )
    assert OracleRunner(seed=1).expected_stream([5, 6, 7], p) != a.expected_stream([5, 6, 7], p)


@settings(max_examples=50, deadline=None)
@given(
    st.booleans(),
    st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**40)), min_size=1),
)
def test_a_steps_batched_tokens_are_token_at_each(
    cyclic: bool, pairs: list[tuple[int, int]]
) -> None:
    """The runner's decodes of a step are drawn together in uint64 arithmetic: the same
    tokens as token_at's Python integers, at any key and position."""
    r = OracleRunner(cyclic=cyclic)
    keys, positions = [k for k, _ in pairs], [p for _, p in pairs]
    assert r.tokens_at(keys, positions) == [r.token_at(k, p) for k, p in pairs]


def test_oracle_stream_honours_stop_tokens_and_max_tokens() -> None:
    r = OracleRunner()
    full = r.expected_stream([9, 9, 9], SamplingParams(max_tokens=50))
    assert len(full) == 50
    stop = full[10]
    cut = r.expected_stream([9, 9, 9], SamplingParams(max_tokens=50, stop_token_ids=[stop]))
    assert cut == full[: full.index(stop) + 1]


def test_cyclic_oracle_accepts_some_drafts_and_rejects_others() -> None:
    from tokentape import LLM

    llm = LLM(model="oracle", tape=None, num_speculative_tokens=3, pipeline_depth=1)
    outs = llm.generate([list(range(3, 40))] * 1 + [[7, 8, 9, 10]], SamplingParams(max_tokens=80))
    frames = [
        e
        for _, e in llm.llm_engine.engine_core.tape.iter_events()
        if type(e).__name__ == "FrameProduced"
    ]
    accepted = [f.num_accepted for ev in frames for f in ev.entries if f.draft_token_ids]
    assert any(a > 0 for a in accepted) and any(a < 3 for a in accepted)
    for out in outs:  # spec decoding changes the steps, never the tokens
        assert out.outputs[0].token_ids == llm.llm_engine.engine_core.runner.expected_stream(
            out.prompt_token_ids, SamplingParams(max_tokens=80)
        )
