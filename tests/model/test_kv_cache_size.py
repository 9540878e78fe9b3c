"""The KV cache sized from a memory budget (engine/kv_cache_size.py), as vLLM sizes it."""

from __future__ import annotations

import logging
import os
import random
import time

import pytest

from tokentape import LLM, SamplingParams
from tokentape.engine.config import ORACLE_NUM_KV_BLOCKS
from tokentape.engine.kv_cache_size import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    kv_bytes_per_token,
    physical_memory_bytes,
)
from tokentape.events import schema as ev

# tiny: 4 layers x 2 x 2 KV heads x 64 x 4 bytes (float32)
TINY_BYTES_PER_TOKEN = kv_bytes_per_token(4, 2, 64, 4)
TINY_BLOCK_BYTES = TINY_BYTES_PER_TOKEN * 16


@pytest.fixture(autouse=True)
def _no_kv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's own setting must not decide these tests."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("TOKENTAPE_CPU_KVCACHE_SPACE", raising=False)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _events(llm: LLM) -> list[ev.Event]:
    return [e for _, e in llm.llm_engine.engine_core.tape.iter_events()]  # type: ignore[attr-defined]


def test_default_tiny_runs_the_256_prompt_workload_without_preempting() -> None:
    """bench_generate's tiny workload (256 prompts of 32-256 tokens, 64-256 out; about
    82,000 token slots, 110 preemptions under the old fixed 2,048 blocks) at every default."""
    assert TINY_BYTES_PER_TOKEN == 4096
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(32, 256))] for _ in range(256)]
    params = [
        SamplingParams(max_tokens=rng.randint(64, 256), temperature=0.0, ignore_eos=True)
        for _ in prompts
    ]
    with LLM(model="tiny") as llm:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        events = _events(llm)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    preempted = [e for e in events if isinstance(e, ev.RequestPreempted)]
    assert preempted == [], f"{len(preempted)} preemptions in {elapsed:.1f} s"
    assert llm.config.num_kv_blocks * llm.config.block_size >= sum(
        len(p) + s.max_tokens for p, s in zip(prompts, params)
    )


def test_default_budget_and_the_log(caplog: pytest.LogCaptureFixture) -> None:
    budget = min(DEFAULT_CPU_KV_CACHE_BYTES, physical_memory_bytes() // 4)
    with caplog.at_level(logging.INFO, logger="tokentape.engine.config"):
        llm = LLM(model="tiny", tape=False)
    blocks = budget // TINY_BLOCK_BYTES
    assert llm.config.num_kv_blocks == blocks
    assert llm.config.max_model_len == min(32768, blocks * 16)  # tiny's context length
    tokens = blocks * 16
    concurrency = tokens / llm.config.max_model_len
    assert (
        f"KV cache size: {tokens:,} tokens, Maximum concurrency for "
        f"{llm.config.max_model_len:,} tokens per request: {concurrency:.2f}x"
    ) in caplog.text
    # the header holds the number allocated, so a replay builds the same pool
    assert llm.llm_engine.engine_core.tape.header.config["num_kv_blocks"] == blocks
    assert llm.llm_engine.engine_core.runner.kv_caches[0][0].shape[0] == blocks  # type: ignore[attr-defined]
    llm.close()


def test_kv_cache_memory_bytes_sets_the_blocks_and_caps_max_model_len(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        llm = LLM(model="tiny", tape=False, kv_cache_memory_bytes=100 * TINY_BLOCK_BYTES + 5)
    assert llm.config.num_kv_blocks == 100
    assert llm.config.max_model_len == 1600  # capped at the capacity, with a warning
    assert "the KV cache holds 1600 tokens" in caplog.text
    llm.close()


def test_vllm_env_var_in_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.0625")  # 64 MiB
    with LLM(model="tiny", tape=False) as llm:
        assert llm.config.num_kv_blocks == (64 << 20) // TINY_BLOCK_BYTES
    # the option beats the environment; num_kv_blocks beats both
    with LLM(model="tiny", tape=False, kv_cache_memory_bytes=8 * TINY_BLOCK_BYTES) as llm:
        assert llm.config.num_kv_blocks == 8
    with LLM(model="tiny", tape=False, num_kv_blocks=7, kv_cache_memory_bytes=1 << 30) as llm:
        assert llm.config.num_kv_blocks == 7
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a number of GiB"):
        LLM(model="tiny", tape=False)


def test_tokentape_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENTAPE_CPU_KVCACHE_SPACE", "0.03125")  # 32 MiB
    with LLM(model="tiny", tape=False) as llm:
        assert llm.config.num_kv_blocks == (32 << 20) // TINY_BLOCK_BYTES


def test_gpu_memory_utilization_on_the_cpu_is_a_share_of_the_machine() -> None:
    """As vLLM 0.32 reads it on the CPU: that share of the memory, less what the process holds."""
    share = _resident_bytes() + (256 << 20)  # 256 MiB more than this process holds now
    util = share / physical_memory_bytes()
    with LLM(model="tiny", tape=False, gpu_memory_utilization=util) as llm:
        blocks = llm.config.num_kv_blocks
    assert blocks is not None and 0 < blocks * TINY_BLOCK_BYTES <= 256 << 20


def test_a_budget_below_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no block of 16 tokens"):
        LLM(model="tiny", tape=False, kv_cache_memory_bytes=TINY_BLOCK_BYTES - 1)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be"):
        LLM(model="tiny", tape=False, gpu_memory_utilization=1.5)


def test_the_oracle_keeps_its_fixed_pool() -> None:
    with LLM(model="oracle", tape=False) as llm:
        assert llm.config.num_kv_blocks == ORACLE_NUM_KV_BLOCKS
        assert llm.config.max_model_len is None  # the oracle's is its KV capacity
        assert llm.config.effective_max_model_len == ORACLE_NUM_KV_BLOCKS * 16


def test_untouched_blocks_take_no_memory() -> None:
    """The pool is an anonymous mapping, committed as it is written: a 4 GiB cache on which
    one short request ran is not resident. What the engine added is measured, not the
    process's total: earlier tests in the same process (a pytest-xdist worker runs many
    files) leave their own heap behind."""
    before = _resident_bytes()
    with LLM(model="tiny", tape=False, kv_cache_memory_bytes=4 << 30) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        added = _resident_bytes() - before
    assert added < 1 << 30, f"{added / 2**30:.2f} GiB resident for a 4 GiB pool"
