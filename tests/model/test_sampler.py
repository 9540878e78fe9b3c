"""Sampling: greedy, temperature, top-k, top-p; draws keyed by (seed, position)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentape.engine.model.sampler import SamplingRows, greedy_tokens, position_key, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5])


def draw(
    logits: torch.Tensor,
    n: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> torch.Tensor:
    rows = SamplingRows(
        [temperature] * n, [top_k] * n, [top_p] * n, [position_key(seed, p) for p in range(n)]
    )
    return sample(logits.expand(n, -1), rows)


def test_temperature_sampling_follows_the_softmax() -> None:
    n = 20000
    for temperature in (1.0, 0.5):
        got = torch.bincount(draw(LOGITS, n, temperature), minlength=8).float() / n
        expected = torch.softmax(LOGITS / temperature, -1)
        assert torch.allclose(got, expected, atol=0.012), (got, expected)


def test_top_k_and_top_p_restrict_the_support() -> None:
    n = 4000
    top3 = set(LOGITS.topk(3).indices.tolist())
    assert set(draw(LOGITS, n, top_k=3).tolist()) == top3
    probs = torch.softmax(LOGITS, -1)
    order = probs.argsort(descending=True).tolist()
    # p = 0.6 keeps the smallest prefix of the ranking whose mass reaches 0.6
    mass, nucleus = 0.0, set()
    for i in order:
        nucleus.add(i)
        mass += float(probs[i])
        if mass >= 0.6:
            break
    assert set(draw(LOGITS, n, top_p=0.6).tolist()) == nucleus
    got = torch.bincount(draw(LOGITS, n, top_p=0.6), minlength=8).float() / n
    renorm = torch.zeros(8)
    renorm[list(nucleus)] = probs[list(nucleus)] / probs[list(nucleus)].sum()
    assert torch.allclose(got, renorm, atol=0.03)


def test_draws_are_keyed_by_seed_and_position_only() -> None:
    a = draw(LOGITS, 64, seed=5)
    b = draw(LOGITS, 64, seed=5)
    assert torch.equal(a, b)
    assert not torch.equal(a, draw(LOGITS, 64, seed=6))
    # a row's draw does not depend on the other rows of the batch
    rows = SamplingRows(
        [1.0, 0.0, 1.0],
        [0, 0, 5],
        [1.0, 1.0, 0.9],
        [position_key(5, 7), (0, 0), position_key(5, 9)],
    )
    out = sample(torch.stack([LOGITS, LOGITS, LOGITS]), rows)
    assert int(out[0]) == int(a[7]) and int(out[1]) == int(LOGITS.argmax())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=40), st.integers(0, 2**31))
def test_greedy_and_degenerate_filters_take_the_argmax(values: list[float], seed: int) -> None:
    logits = torch.tensor(values)
    best = int(logits.argmax())
    assert int(draw(logits, 1, temperature=0.0, seed=seed)[0]) == best
    assert int(draw(logits, 1, top_k=1, seed=seed)[0]) == best
    assert int(draw(logits, 1, top_p=1e-6, seed=seed)[0]) == best


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(
            st.sampled_from([0.0, -0.0, 1.0, 2.0, float("inf"), float("-inf"), float("nan")])
            | st.floats(-3, 3),
            min_size=3,
            max_size=3,
        ),
        min_size=1,
        max_size=5,
    )
)
def test_greedy_tokens_are_argmax_with_its_ties_and_nans(rows: list[list[float]]) -> None:
    # A few distinct values, so ties are common; every row as wide as a real vocabulary too
    # (the reduction takes another path at that width).
    narrow = torch.tensor(rows)
    wide = narrow.repeat_interleave(50_000, dim=1)
    wide[:, 1::3] -= 1.0
    for x in (narrow, wide):
        assert torch.equal(greedy_tokens(x), x.argmax(dim=-1)), x
