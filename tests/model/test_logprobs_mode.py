"""vLLM's logprobs_mode (EngineConfig.logprobs_mode) on tiny: the same tokens in every mode,
and logprobs that are what each mode names: the raw log-softmax (the default), the raw logits
(the same ranking, shifted by a row's log-partition), or the sampler's own distribution (the
logits over the temperature with top-k applied: the top k hold all of its mass); a greedy
row's processed values are the raw ones. The mode is on the tape and refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tokentape import LLM, SamplingParams
from tokentape.replay import load_tape
from tokentape.replay.verify import verify

PROMPTS = [[84, 107, 104, 35], [119, 100, 115, 104, 35, 50]]
K = 5
SAMPLED = SamplingParams(
    max_tokens=6, temperature=0.7, top_k=K, seed=3, logprobs=K, ignore_eos=True
)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=K, ignore_eos=True)
# The tokens of each sampling setting, as the first mode run gave them: every mode's must match.
run_tokens: dict[tuple[float, int | None], list[list[int]]] = {}


def run(
    mode: str, params: SamplingParams, tape: Path | None = None
) -> list[list[dict[int, float]]]:
    llm = LLM(model="tiny", tape=str(tape) if tape else None, logprobs_mode=mode)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        runs = [
            (o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].top_logprobs) for o in outs
        ]
    finally:
        llm.close()
    tokens = [r[0] for r in runs]
    assert tokens == run_tokens.setdefault((params.temperature, params.seed), tokens)
    for token_ids, lps, tops in runs:
        assert lps is not None and tops is not None and len(lps) == len(token_ids) == len(tops)
        for t, lp, top in zip(token_ids, lps, tops):
            assert top[t] == lp  # the sampled token's value is its row's
    return [r[2] for r in runs]  # type: ignore[misc]


def test_each_mode_gives_what_it_names() -> None:
    raw = run("raw_logprobs", SAMPLED)
    logits = run("raw_logits", SAMPLED)
    processed = run("processed_logprobs", SAMPLED)
    processed_logits = run("processed_logits", SAMPLED)
    for rows in zip(raw, logits, processed, processed_logits):
        for lp, lg, plp, plg in zip(*rows):
            ids = list(lp)
            assert list(lg) == ids  # the same ranking, best first
            shift = {round(lg[t] - lp[t], 4) for t in ids}
            assert len(shift) == 1  # logit - logprob is the row's log-partition
            assert all(v <= 0 for v in lp.values()) and any(v > 0 for v in lg.values())
            # top-k = K: the sampler's distribution lives on these K tokens
            assert math.isclose(sum(math.exp(v) for v in plp.values()), 1.0, rel_tol=1e-4)
            for t in ids:  # processed logits: the raw ones over the temperature
                assert math.isclose(plg[t], lg[t] / 0.7, rel_tol=1e-4, abs_tol=1e-4)


def test_a_greedy_row_processes_nothing() -> None:
    raw = run("raw_logprobs", GREEDY)
    processed = run("processed_logprobs", GREEDY)
    for a, b in zip(raw, processed):
        for x, y in zip(a, b):
            assert list(x) == list(y)
            assert all(math.isclose(x[t], y[t], rel_tol=1e-6, abs_tol=1e-6) for t in x)


def test_the_mode_is_on_the_tape_and_a_bad_one_refused(tmp_path: Path) -> None:
    tape = tmp_path / "run.tape"
    run("processed_logits", SAMPLED, tape)
    assert load_tape(tape).config.logprobs_mode == "processed_logits"
    assert verify(tape).ok
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs, "):
        LLM(model="tiny", tape=str(tmp_path / "no.tape"), logprobs_mode="logits")
    assert not (tmp_path / "no.tape").exists()
