"""Prefix cache safety: a hit is trusted on the block hash alone, so the hash must be
collision resistant (SHA-256, as vLLM's after CVE-2025-25183), and computed once per block."""

from __future__ import annotations

import hashlib
import struct

import pytest

from tokentape.engine.config import EngineConfig
from tokentape.engine.core.kv_cache_manager import ROOT_BLOCK_HASH, KVCacheManager
from tokentape.engine.factory import build_engine_core
from tokentape.engine.llm_engine import LLMEngine
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.events import schema as ev
from tokentape.events.schema import SamplingParams
from tokentape.events.state import RequestState
from tokentape.replay import fold, verify


def old_block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The scheme this replaced: Python's 64-bit hash() over (parent, block tokens)."""
    hashes, parent = [], 0
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = hash((parent, tuple(tokens[i : i + block_size])))
        hashes.append(parent)
    return hashes


# Two blocks of 32-bit token ids whose old hashes are equal. CPython's tuple hash is invertible
# step by step, so after the first two items the accumulators of (x, 0, ...) and (y, d, ...)
# agree when d = B(x) - B(y) mod 2**64, B(t) being the first item's accumulator times the
# inverse of its multiplier; sorting B over 2**17 random x and taking neighbours less than
# 2**32 apart finds such pairs in under a second (a real vocabulary only takes longer).
COLLIDING = ([569924290, 0, 7, 8], [2701679609, 4017967549, 7, 8])
TAIL = [9, 10, 11, 12, 13]  # a second full block and a token to compute


def test_the_constructed_blocks_collide_under_the_old_scheme() -> None:
    a, b = (block + TAIL for block in COLLIDING)
    assert a != b
    assert old_block_hashes(a, 4) == old_block_hashes(b, 4)  # both blocks of the chain


def req(req_id: str, tokens: list[int]) -> RequestState:
    return RequestState(req_id, tokens, SamplingParams(), 0)


def cache(kv: KVCacheManager, r: RequestState) -> list[int]:
    """Run a request's prefill to completion and free it: its full blocks stay cached."""
    blocks = kv.allocate(0, r.num_tokens, kv.get_computed_blocks(r))
    assert blocks is not None
    kv.cache_full_blocks(r, [], blocks, r.num_tokens)
    kv.free(r.req_id, blocks)
    return blocks


@pytest.mark.parametrize(
    "pair",
    [
        COLLIDING,
        (
            [0, 1, 2, 3],
            [2**61 - 1, 1, 2, 3],
        ),  # hash(2**61 - 1) == hash(0): ints hash modulo 2**61 - 1
    ],
)
def test_blocks_that_collide_under_the_old_scheme_are_not_shared(
    pair: tuple[list[int], list[int]],
) -> None:
    a, b = (block + TAIL for block in pair)
    assert old_block_hashes(a, 4) == old_block_hashes(b, 4)
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a_blocks = cache(kv, req("a", a))
    assert kv.get_computed_blocks(req("b", b)) == []  # the old scheme gave a's two blocks
    assert kv.get_computed_blocks(req("a2", list(a))) == a_blocks[:2]  # a real hit still hits
    b_blocks = cache(kv, req("b", b))
    assert not set(b_blocks) & set(a_blocks[:2])
    assert kv.get_computed_blocks(req("b2", list(b))) == b_blocks[:2]


def test_the_block_hash_is_sha256_over_the_parent_and_the_tokens() -> None:
    tokens = [3, 2**40, 5, 6, 7, 8, 9, 10, 11]
    kv = KVCacheManager(num_blocks=8, block_size=4)
    cache(kv, req("a", tokens))
    first = hashlib.sha256(ROOT_BLOCK_HASH + struct.pack("<4q", *tokens[:4])).digest()
    second = hashlib.sha256(first + struct.pack("<4q", *tokens[4:8])).digest()
    assert set(kv.cached) == {first, second}
    # The same block after another parent is another block: hits only on a whole prefix.
    assert kv.get_computed_blocks(req("b", [4, *tokens[1:]])) == []


def test_each_full_block_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefill, decodes and preemptions under KV pressure: every full block of every
    request is hashed exactly once, however often it is scheduled or recomputed."""
    calls: list[bytes] = []
    real = hashlib.sha256

    def counting(data: bytes = b"") -> object:
        calls.append(data)
        return real(data)

    monkeypatch.setattr(hashlib, "sha256", counting)
    config = EngineConfig(
        model="oracle", pipeline_depth=2, block_size=4, num_kv_blocks=12, max_num_batched_tokens=6
    )
    engine = new_engine(config, OracleRunner())
    params = SamplingParams(max_tokens=21, ignore_eos=True)
    prompts = {"a": list(range(3, 17)), "b": list(range(20, 33))}  # 14 and 13 tokens: chunked
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert any(isinstance(e, ev.RequestPreempted) for _, e in engine.engine_core.tape.iter_events())
    assert len(calls) == len(set(calls))
    # Each request's blocks are hashed up to the last one whose tokens were all computed.
    assert len(calls) == sum((len(p) + 21 - 1) // 4 for p in prompts.values())


def new_engine(config: EngineConfig, runner: OracleRunner) -> LLMEngine:
    return LLMEngine(build_engine_core(config, None, runner=runner))


def scheduled_entries(engine: LLMEngine, req_id: str) -> list[ev.ScheduledEntry]:
    return [
        e
        for _, event in engine.engine_core.tape.iter_events()
        if isinstance(event, ev.StepScheduled)
        for e in event.entries
        if e.req_id == req_id
    ]


def test_the_engine_does_not_share_kv_between_colliding_prompts() -> None:
    # A vocabulary of 2**32 token ids, so the colliding blocks are valid prompts.
    runner = OracleRunner(vocab_size=2**32)
    config = EngineConfig(model="oracle", pipeline_depth=2, block_size=4, num_kv_blocks=64)
    engine = new_engine(config, runner)
    a, b = (block + TAIL for block in COLLIDING)
    params = SamplingParams(max_tokens=6)
    outputs: dict[str, list[int]] = {}

    def run(req_id: str, prompt: list[int]) -> None:
        engine.add_request(req_id, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids  # cumulative

    run("a", a)
    run("b", b)
    run("a-again", list(a))
    assert scheduled_entries(engine, "b")[0].num_computed_before == 0  # no hit on a's blocks
    assert scheduled_entries(engine, "a-again")[0].num_computed_before == 8  # a true hit
    for req_id, prompt in (("a", a), ("b", b), ("a-again", a)):
        assert outputs[req_id] == runner.expected_stream(prompt, params)
    assert verify(engine.engine_core.tape).ok
    assert fold(engine.engine_core.tape) == engine.engine_core.state
