"""max_model_len defaults, as in vLLM, to the model's context length (max_position_embeddings,
extended by a linear or YaRN scaling), capped with a warning at what the KV cache holds; the
oracle keeps the KV capacity. The resolved figure goes on the tape, so replay needs no model."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from checkpoint_files import small_config, write_checkpoint

from tokentape import LLM, AsyncLLM, SamplingParams
from tokentape.engine.model.rope import RopeScaling
from tokentape.events.sqlite_store import SQLiteTapeReader
from tokentape.replay import verify
from tokentape.replay.tape import Tape

WARNING = "tokentape.engine.config"


def test_a_checkpoint_serves_its_max_position_embeddings_not_the_kv_capacity(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_checkpoint(tmp_path / "ckpt", small_config("llama"))  # max_position_embeddings 256
    tape = tmp_path / "run.tape"
    with caplog.at_level(logging.WARNING, logger=WARNING):
        llm = LLM(model=str(tmp_path / "ckpt"), tape=str(tape), block_size=4, num_kv_blocks=128)
    assert not caplog.records  # 512 KV slots hold the 256 positions: nothing to say
    assert llm.config.max_model_len == llm.config.effective_max_model_len == 256
    prompt = [i % 60 + 2 for i in range(248)]
    out = llm.generate([prompt], SamplingParams(max_tokens=50, temperature=0.0))[0].outputs[0]
    assert len(out.token_ids) == 256 - len(prompt) and out.finish_reason == "length"
    llm.close()
    assert Tape(SQLiteTapeReader(str(tape))).config.max_model_len == 256
    result = verify(tape)  # the header holds 256: replay needs neither the model nor its config
    assert result.ok, result.first_divergence and result.first_divergence.format()


def test_a_kv_cache_smaller_than_the_context_caps_it_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_checkpoint(tmp_path / "ckpt", small_config("qwen3"))
    with caplog.at_level(logging.WARNING, logger=WARNING):
        llm = LLM(model=str(tmp_path / "ckpt"), tape=None, block_size=4, num_kv_blocks=16)
    assert llm.config.max_model_len == 64
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "max_model_len 64: the model's context length is 256 (max_position_embeddings = 256 "
        "in the model's config), but the KV cache holds 64 tokens (num_kv_blocks=16 x "
        "block_size=4); raise num_kv_blocks, or give the cache more memory "
        "(kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE), to serve the whole context"
    )


def test_an_explicit_max_model_len_stands_unless_past_the_context(tmp_path: Path) -> None:
    config = dataclasses.replace(
        small_config("qwen2"), rope_scaling=RopeScaling("yarn", 4.0, 32), max_position_embeddings=32
    )
    write_checkpoint(tmp_path / "ckpt", config)
    folder = str(tmp_path / "ckpt")
    assert (
        LLM(model=folder, tape=None, block_size=4, num_kv_blocks=64).config.max_model_len == 128
    )  # yarn: its original 32 positions x factor 4, as vLLM derives it
    assert (
        LLM(
            model=folder, tape=None, block_size=4, num_kv_blocks=64, max_model_len=100
        ).config.max_model_len
        == 100
    )
    with pytest.raises(
        ValueError,
        match=r"max_model_len \(129\) is greater than the model's "
        r"context length \(128: original_max_position_embeddings = 32 x yarn "
        r"factor 4.0 in the model's config\)",
    ):
        LLM(model=folder, tape=None, block_size=4, num_kv_blocks=64, max_model_len=129)


def test_the_builtin_models_and_the_oracle(caplog: pytest.LogCaptureFixture) -> None:
    assert LLM(model="tiny", tape=False).config.max_model_len == 32768  # = the default KV
    with caplog.at_level(logging.WARNING, logger=WARNING):
        small = LLM(model="tiny", tape=False, num_kv_blocks=64)
    assert small.config.max_model_len == 1024 and "context length is 32768" in caplog.text
    big = LLM(model="tiny", tape=False, num_kv_blocks=4096)  # 65,536 KV slots
    assert big.config.max_model_len == 32768
    oracle = LLM(model="oracle", tape=None, num_kv_blocks=4096)  # no context length of its own
    assert oracle.config.max_model_len is None
    assert oracle.config.effective_max_model_len == 65536


def test_async_llm_reports_the_resolved_length(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", small_config("llama"))
    engine = AsyncLLM(
        str(tmp_path / "ckpt"), multiprocess_mode=False, block_size=4, num_kv_blocks=128
    )
    try:
        assert engine.max_model_len == 256
    finally:
        engine.shutdown()


def test_a_prompt_past_the_context_is_refused_in_vllms_words(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", small_config("llama"))
    llm = LLM(model=str(tmp_path / "ckpt"), tape=None, block_size=4, num_kv_blocks=128)
    for length in (256, 300):  # a prompt of 256 leaves no position for the output
        with pytest.raises(
            ValueError,
            match=rf"request '\d+': This model's maximum context "
            rf"length is 256 tokens. However, your request has {length} input "
            r"tokens. Please reduce the length of the input messages.",
        ):
            llm.generate([[5] * length], SamplingParams(max_tokens=1))
    assert (
        not llm.llm_engine.engine_core.state.requests and len(llm.llm_engine.engine_core.tape) == 0
    )  # nothing recorded
    out = llm.generate([[5] * 255], SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
