"""Recorded runs shared by the replay tests: the historical discard bugs as tapes.

Each function drives a real engine (oracle-random model, small KV cache) and returns its
tape: in memory, or an SQLite file when `path` is given.
"""

from __future__ import annotations

from pathlib import Path

from tokentape import LLM, SamplingParams

PROMPT = list(range(10, 30))


def _llm(policy: str, depth: int, path: Path | None, k: int = 0) -> LLM:
    return LLM(
        model="oracle-random",
        tape=path,
        pipeline_depth=depth,
        num_speculative_tokens=k,
        discard_policy=policy,
        block_size=4,
        num_kv_blocks=64,
    )


def _drive(llm: LLM, delivered: dict[str, list[int]]) -> None:
    for out in llm.llm_engine.step():
        delivered[out.request_id] = out.outputs[0].token_ids  # cumulative: every token so far


def _run_until_idle(llm: LLM, delivered: dict[str, list[int]]) -> None:
    for _ in range(1000):
        if not llm.llm_engine.has_unfinished_requests():
            return
        _drive(llm, delivered)
    raise AssertionError("the engine did not finish")


def _finish(llm: LLM, path: Path | None):  # type: ignore[no-untyped-def]
    tape = llm.llm_engine.engine_core.tape
    llm.close()
    return path if path is not None else tape


def pause_resume(policy: str, path: Path | None = None, depth: int = 2, second: bool = True):  # type: ignore[no-untyped-def]
    """vLLM #42043: async generation, pause(keep, clear_cache=True) mid-way, resume.
    Under `flag` the first token after resume is lost and later tokens shift by one."""
    llm = _llm(policy, depth, path)
    llm.llm_engine.add_request("r", PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    if second:
        llm.llm_engine.add_request("s", PROMPT[:7], SamplingParams(max_tokens=20, ignore_eos=True))
    delivered: dict[str, list[int]] = {}
    while len(delivered.get("r", [])) < 8:
        _drive(llm, delivered)
    llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
    _drive(llm, delivered)
    llm.llm_engine.resume_generation()
    _run_until_idle(llm, delivered)
    return _finish(llm, path)


def double_reset(policy: str, path: Path | None = None):  # type: ignore[no-untyped-def]
    """Two prefix-cache resets at pipeline depth 3; under `counter` the second overwrites a
    counter that still had a stale frame to drop, so a stale token is applied."""
    llm = _llm(policy, 3, path)
    llm.llm_engine.add_request("r", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    delivered: dict[str, list[int]] = {}
    while len(delivered.get("r", [])) < 6:
        _drive(llm, delivered)
    assert llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    _drive(llm, delivered)
    assert llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    _run_until_idle(llm, delivered)
    return _finish(llm, path)


def busy(path: Path | None = None, seed: int = 0):  # type: ignore[no-untyped-def]
    """Chunked prefill, KV-pressure preemptions, speculative decoding, an abort."""
    llm = LLM(
        model="oracle",
        tape=path,
        max_num_seqs=4,
        num_kv_blocks=16,
        block_size=4,
        max_num_batched_tokens=32,
        num_speculative_tokens=2,
        seed=seed,
    )
    for i in range(8):
        llm.llm_engine.add_request(
            f"q{i}",
            list(range(3, 3 + 5 + 4 * (i % 3))),
            SamplingParams(max_tokens=20, ignore_eos=True),
        )
    delivered: dict[str, list[int]] = {}
    for _ in range(6):
        _drive(llm, delivered)
    llm.llm_engine.abort_request("q7")
    _run_until_idle(llm, delivered)
    return _finish(llm, path)
