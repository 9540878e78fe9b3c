"""The historical async-discard bugs, reproduced under their policies and absent under epoch.

The oracle runner makes every token a pure function of (prompt, position, seed), so the
stream a correct engine must deliver is known in advance. `oracle-random` draws every token
independently, which makes a duplicated or skipped token unmistakable.
"""

from __future__ import annotations

import pytest

from tokentape import LLM, SamplingParams
from tokentape.replay import fold, verify

PROMPT = list(range(10, 30))


def make_llm(policy: str, depth: int, k: int = 0, **kw: object) -> LLM:
    return LLM(
        model="oracle-random",
        tape=None,
        pipeline_depth=depth,
        num_speculative_tokens=k,
        discard_policy=policy,
        block_size=4,
        num_kv_blocks=64,
        **kw,
    )


def drive(llm: LLM, delivered: dict[str, list[int]]) -> None:
    for out in llm.llm_engine.step():
        delivered[out.request_id] = out.outputs[0].token_ids  # cumulative: every token so far


def run_until_idle(llm: LLM, delivered: dict[str, list[int]], limit: int = 500) -> None:
    for _ in range(limit):
        if not llm.llm_engine.has_unfinished_requests():
            return
        drive(llm, delivered)
    raise AssertionError("the engine did not finish")


def expected(llm: LLM, params: SamplingParams, prompt: list[int] = PROMPT) -> list[int]:
    return llm.llm_engine.engine_core.runner.expected_stream(prompt, params)


def check_tape(llm: LLM) -> None:
    assert fold(llm.llm_engine.engine_core.tape) == llm.llm_engine.engine_core.state
    result = verify(llm.llm_engine.engine_core.tape)
    assert result.ok, result.first_divergence and result.first_divergence.format()


# -- the seed: vLLM #42043 -----------------------------------------------------------------------


def seed_scenario(policy: str) -> tuple[list[int], list[int], int]:
    """Async generation, pause(keep, clear_cache=True) mid-way, resume; returns
    (delivered, expected, number of tokens delivered before the pause)."""
    llm = make_llm(policy, depth=2)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm.llm_engine.add_request("r", PROMPT, params)
    delivered: dict[str, list[int]] = {}
    while len(delivered.get("r", [])) < 8:
        drive(llm, delivered)
    llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
    drive(llm, delivered)  # the drained tokens come back with the next step
    before = len(delivered["r"])
    req = llm.llm_engine.engine_core.state.requests["r"]
    assert req.num_preemptions == 1 and req.num_output_placeholders == 0 and not req.num_in_flight
    llm.llm_engine.resume_generation()
    run_until_idle(llm, delivered)
    check_tape(llm)
    return delivered["r"], expected(llm, params), before


@pytest.mark.parametrize("policy", ["epoch", "counter"])
def test_seed_scenario_keeps_first_token_after_resume(policy: str) -> None:
    delivered, exp, _ = seed_scenario(policy)
    assert delivered == exp


def test_seed_scenario_flag_drops_first_token_after_resume() -> None:
    delivered, exp, before = seed_scenario("flag")
    # The first token after resume is lost and every later token moves up by one, while
    # max_tokens still counts delivered tokens: vLLM #42043's signature.
    assert delivered[:before] == exp[:before]
    assert delivered[before:] == expected_shifted(exp, before)
    assert len(delivered) == len(exp)


def expected_shifted(exp: list[int], index: int) -> list[int]:
    """The stream from `index` on with the token at `index` skipped (one longer than needed)."""
    llm = make_llm("epoch", depth=1)
    longer = llm.llm_engine.engine_core.runner.expected_stream(
        PROMPT, SamplingParams(max_tokens=len(exp) + 1)
    )
    return longer[index + 1 :]


# -- the counter overwritten on a double reset ---------------------------------------------------


def double_reset(policy: str) -> tuple[list[int], list[int]]:
    llm = make_llm(policy, depth=3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    llm.llm_engine.add_request("r", PROMPT, params)
    delivered: dict[str, list[int]] = {}
    while len(delivered.get("r", [])) < 6:
        drive(llm, delivered)
    req = llm.llm_engine.engine_core.state.requests["r"]
    assert req.num_in_flight == 2  # two decode steps in flight
    assert llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    drive(llm, delivered)  # re-admits the request (prefill) and applies one stale frame
    assert req.num_stale_in_flight == 1 and req.num_in_flight == 2  # one stale, one fresh
    # The second reset, with stale and fresh output still in flight.
    assert llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    run_until_idle(llm, delivered)
    check_tape(llm)
    return delivered["r"], expected(llm, params)


def test_double_reset_epoch_drops_every_stale_frame() -> None:
    delivered, exp = double_reset("epoch")
    assert delivered == exp


def test_double_reset_counter_lets_a_stale_token_through() -> None:
    delivered, exp = double_reset("counter")
    # The second reset overwrote a counter that still had a stale frame to drop; that frame's
    # token is applied and then computed again: one token is delivered twice.
    first_bad = next(i for i, (a, b) in enumerate(zip(delivered, exp)) if a != b)
    assert delivered[first_bad] == exp[first_bad - 1]
    assert delivered[first_bad + 1 :] == exp[first_bad : len(delivered) - 1]


# -- the counter's unit mismatch with speculative decoding ----------------------------------------


def spec_reset(policy: str) -> tuple[list[int], list[int], int, int]:
    llm = make_llm(policy, depth=2, k=3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    llm.llm_engine.add_request("r", PROMPT, params)
    delivered: dict[str, list[int]] = {}
    while len(delivered.get("r", [])) < 5:
        drive(llm, delivered)
    req = llm.llm_engine.engine_core.state.requests["r"]
    assert req.num_in_flight == 1 and req.num_output_placeholders == 4  # 1 + k in flight
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
    before = len(delivered["r"])
    run_until_idle(llm, delivered)
    check_tape(llm)
    return delivered["r"], expected(llm, params), before, req.num_frames_dropped


def test_spec_decode_reset_epoch_drops_only_the_stale_frame() -> None:
    delivered, exp, _, dropped = spec_reset("epoch")
    assert delivered == exp
    assert dropped == 1


def test_spec_decode_reset_counter_drops_fresh_frames() -> None:
    delivered, exp, before, dropped = spec_reset("counter")
    # The counter was set to 1 + k = 4 tokens but is drained one frame at a time: after the
    # one stale frame, three fresh frames are thrown away and their tokens never delivered.
    assert dropped == 4
    assert delivered[:before] == exp[:before]
    assert delivered != exp
    llm = make_llm("epoch", depth=1)
    longer = llm.llm_engine.engine_core.runner.expected_stream(
        PROMPT, SamplingParams(max_tokens=60)
    )
    # What is delivered is the true stream with the dropped positions skipped, not a reorder.
    it = iter(longer)
    assert all(tok in it for tok in delivered)
