"""Bounded work per request, checked before anything is recorded (request_checks.py), with
vLLM's limits where vLLM has them; bad words resolved in linear time; temperatures below
1e-5 greedy; devices and CPU threads checked against the machine."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

from tokentape import LLM, SamplingParams
from tokentape.engine import request_checks as limits
from tokentape.engine.bad_words import resolve_bad_words
from tokentape.engine.config import EngineConfig
from tokentape.engine.runners.devices import clamped_cpu_threads, device_problem
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.replay.whatif import on_this_machine


@pytest.fixture(scope="module")
def tiny() -> Any:
    llm = LLM("tiny", tape=None, device="cpu", num_kv_blocks=64)
    yield llm
    llm.close()


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"logprobs": 21}, "logprobs", "at most 20"),
        (
            {"stop": [f"s{i}" for i in range(limits.MAX_STOP_STRINGS + 1)]},
            "stop",
            "at most 64 strings",
        ),
        ({"stop": ["x" * 2500, "y" * 2500]}, "stop", "4096 characters"),
        (
            {"bad_words": [f"b{i}" for i in range(limits.MAX_BAD_WORDS + 1)]},
            "bad_words",
            "at most 1024 words",
        ),
        ({"bad_words": ["z" * 9000, "q" * 9000]}, "bad_words", "16384 characters"),
        (
            {"stop_token_ids": list(range(3, 3 + limits.MAX_STOP_TOKEN_IDS + 1))},
            "stop_token_ids",
            "at most 1024",
        ),
        ({"stop_token_ids": [5, 10**6]}, "stop_token_ids[1]", "vocabulary"),
    ],
)
def test_work_past_a_limit_is_refused_naming_the_field(
    tiny: Any, kwargs: dict[str, Any], field: str, limit: str
) -> None:
    engine = tiny.engine
    before = len(engine.engine_core.tape)
    with pytest.raises(ValueError, match=f"request 'r': {re.escape(field)} must .*{limit}"):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=4, **kwargs))
    assert len(engine.engine_core.tape) == before  # nothing recorded


def test_limits_at_their_bound_are_served(tiny: Any) -> None:
    params = SamplingParams(
        max_tokens=3,
        logprobs=20,
        stop=["x" * 64] * 64,
        bad_words=[f"b{i}" for i in range(limits.MAX_BAD_WORDS)],
    )
    out = tiny.generate([[5, 6, 7]], params)[0].outputs[0]
    # The 20 most likely, and the sampled one when it is not among them (as vLLM's).
    assert len(out.token_ids) == 3 and all(len(top) in (20, 21) for top in out.top_logprobs)


def test_max_logprobs_is_an_engine_argument() -> None:
    with (
        LLM("oracle", tape=None, max_logprobs=2) as llm,
        pytest.raises(ValueError, match="logprobs must be at most 2"),
    ):
        llm.llm_engine.add_request("r", [5], SamplingParams(logprobs=3))
    with LLM("tiny", tape=None, device="cpu", num_kv_blocks=64, max_logprobs=-1) as llm:
        out = llm.generate([[5, 6]], SamplingParams(max_tokens=2, logprobs=100))[0].outputs[0]
        assert len(out.top_logprobs[0]) >= 100
        with pytest.raises(ValueError, match="vocabulary size"):
            llm.llm_engine.add_request("r", [5], SamplingParams(logprobs=10**6))
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM("oracle", tape=None, max_logprobs=-2)


def test_bad_words_resolve_in_linear_time() -> None:
    """40,000 words stalled the engine core for 8 s (a list scan per word, twice per request):
    the resolution itself, of 40,000 distinct words and their repeats, is linear."""
    encode = ByteTokenizer().encode
    many = [f"word{i}" for i in range(40_000)]
    start = time.perf_counter()
    params = resolve_bad_words(SamplingParams(bad_words=many + many[:1000]), encode)
    elapsed = time.perf_counter() - start
    assert len(params.bad_words) == 40_000  # the repeats dropped
    assert params.bad_words[0] == tuple(encode("word0")) and elapsed < 2.0, elapsed
    # Order and first occurrence are kept (vLLM drops repeats).
    got = resolve_bad_words(SamplingParams(bad_words=["ab", (4, 5), "ab", (4, 5), "cd"]), encode)
    assert got.bad_words == (tuple(encode("ab")), (4, 5), tuple(encode("cd")))


def test_a_temperature_below_1e_5_is_greedy(tiny: Any) -> None:
    greedy = (
        tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0))[0]
        .outputs[0]
        .token_ids
    )
    for t in (1e-39, 1e-6, 9.9e-6):
        got = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=t, seed=3))
        assert got[0].outputs[0].token_ids == greedy, t
    hot = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=5.0, seed=3))
    assert hot[0].outputs[0].token_ids != greedy


def test_an_unavailable_device_is_a_value_error_naming_it() -> None:
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available"):
            LLM("tiny", tape=None, device="cuda")
    with pytest.raises(ValueError, match="device 'cuda:99' is not available"):
        LLM("tiny", tape=None, device="cuda:99")
    with pytest.raises(ValueError, match="device 'bogus' is not a device torch knows"):
        LLM("tiny", tape=None, device="bogus")
    with pytest.raises(ValueError, match="device 'meta' is not supported"):
        LLM("tiny", tape=None, device="meta")
    assert device_problem("cpu") is None and device_problem("auto") is None


def test_a_header_s_cpu_threads_are_clamped_to_the_machine() -> None:
    """A tape header is read, not asked for: a what-if runs it on the CPUs here (an engine
    built by its user keeps what it asked for; tests share steps over more lanes than CPUs)."""
    available = len(os.sched_getaffinity(0))
    assert clamped_cpu_threads(5000) == available and clamped_cpu_threads(1) == 1
    assert clamped_cpu_threads(None) is None and clamped_cpu_threads(0) == 0
    fitted, note = on_this_machine(EngineConfig(model="tiny", cpu_threads=5000), "model")
    assert fitted.cpu_threads == available and note is None
    oracle, _ = on_this_machine(EngineConfig(model="oracle", cpu_threads=5000), "oracle")
    assert oracle.cpu_threads == 5000  # the oracle runs no threads
