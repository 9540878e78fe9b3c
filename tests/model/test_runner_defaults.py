"""Defaults that depend on the runner (config.resolve_config): the scheduling mode, said by
pipeline_depth alone once resolved (async_scheduling, vLLM's flag, agrees with it)."""

from __future__ import annotations

from tokentape import LLM, EngineConfig, SamplingParams


def _mode(llm: LLM) -> tuple[bool | None, int | None, int]:
    c = llm.config
    header = llm.llm_engine.engine_core.tape.header.config
    assert (header["async_scheduling"], header["pipeline_depth"]) == (
        c.async_scheduling,
        c.pipeline_depth,
    )
    return c.async_scheduling, c.pipeline_depth, llm.llm_engine.engine_core.depth


def test_a_model_on_the_cpu_is_synchronous_by_default() -> None:
    with LLM(model="tiny", tape=None, num_kv_blocks=64) as llm:
        assert _mode(llm) == (False, 1, 1)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_a_pipeline_depth_alone_asks_for_async() -> None:
    with LLM(model="tiny", tape=None, num_kv_blocks=64, pipeline_depth=3) as llm:
        assert _mode(llm) == (True, 3, 3)
    with LLM(model="tiny", tape=None, num_kv_blocks=64, pipeline_depth=1) as llm:
        assert _mode(llm) == (False, 1, 1)
    with LLM(model="tiny", tape=None, num_kv_blocks=64, async_scheduling=True) as llm:
        assert _mode(llm) == (True, 2, 2)


def test_the_oracle_stays_async_by_default() -> None:
    with LLM(model="oracle", tape=None) as llm:
        assert _mode(llm) == (True, 2, 2)
    assert EngineConfig().effective_pipeline_depth == 2  # unresolved reads as the oracle's
    assert EngineConfig(async_scheduling=False).effective_pipeline_depth == 1
