"""Shrinking a failing storm spec (tokentape/chaos/shrink.py), and the storms a seed draws
against vLLM (tokentape/chaos/vllm_storms.py's storm_spec), without vLLM: the failures here
are conditions on the spec itself, so what the shrink must reach is known exactly."""

from __future__ import annotations

import time
from typing import Any

from tokentape.chaos.shrink import _ddmin, shrink_spec
from tokentape.chaos.vllm_storms import BLOCK_SIZE, expected_streams, storm_spec


def _spec(n: int = 10) -> dict[str, Any]:
    return {
        "async": True,
        "num_speculative_tokens": 3,
        "max_model_len": 256,
        "requests": [
            {"id": f"r{i}", "prompt": list(range(3, 3 + 20 + i)), "max_tokens": 30, "add_at": 7}
            for i in range(n)
        ],
        "reset_at": [[12, True], [30, False]],
        "pause_at": [[9, "keep", True], [40, "wait", False]],
        "abort_at": [[5, "r1"], [8, "r6"]],
    }


def test_ddmin_keeps_exactly_the_items_the_failure_needs() -> None:
    calls = []

    def fails(items: list[int]) -> bool:
        calls.append(items)
        return {3, 8} <= set(items)

    assert _ddmin(list(range(20)), fails, keep_one=True) == [3, 8]
    assert _ddmin(list(range(20)), lambda items: True, keep_one=False) == []
    assert _ddmin(list(range(20)), lambda items: bool(items), keep_one=True) == [19]
    assert len(calls) < 60  # logarithmic steps, not every subset


def test_a_spec_shrinks_to_the_requests_commands_and_numbers_its_failure_needs() -> None:
    runs = 0

    def fails(spec: dict[str, Any]) -> bool:
        """Fails while r6 asks for 5 tokens or more with a prompt of 4 or more, is aborted
        (the abort names it), and a pause with clear_cache lands at step 3 or later."""
        nonlocal runs
        runs += 1
        r6 = next((r for r in spec["requests"] if r["id"] == "r6"), None)
        return (
            r6 is not None
            and r6["max_tokens"] >= 5
            and len(r6["prompt"]) >= 4
            and any(a[1] == "r6" for a in spec["abort_at"])
            and any(s >= 3 and clear for s, _, clear in spec["pause_at"])
        )

    minimal = shrink_spec(_spec(), fails)
    assert [r["id"] for r in minimal["requests"]] == ["r6"]
    assert minimal["requests"][0] == {
        "id": "r6",
        "prompt": [3, 4, 5, 6],
        "max_tokens": 5,
        "add_at": 0,
    }
    assert minimal["abort_at"] == [[0, "r6"]] and minimal["reset_at"] == []
    assert minimal["pause_at"] == [[3, "keep", True]]  # clear_cache kept: without it, no failure
    assert minimal["num_speculative_tokens"] == 0
    assert fails(minimal) and runs < 200


def test_removing_a_request_removes_the_aborts_that_name_it() -> None:
    minimal = shrink_spec(_spec(), lambda s: any(r["id"] == "r2" for r in s["requests"]))
    assert [r["id"] for r in minimal["requests"]] == ["r2"]
    assert minimal["abort_at"] == [] and minimal["pause_at"] == [] and minimal["reset_at"] == []


def test_past_its_deadline_a_shrink_tries_nothing_more() -> None:
    spec = _spec()
    runs = []
    minimal = shrink_spec(spec, lambda s: runs.append(s) or True, deadline=time.perf_counter())
    assert runs == [] and minimal == spec


def test_a_seed_draws_the_same_storm_and_every_ingredient_appears() -> None:
    assert storm_spec(11) == storm_spec(11) and storm_spec(11) != storm_spec(12)
    specs = [storm_spec(seed) for seed in range(60)]
    modes = set()
    for spec in specs:
        k = spec["num_speculative_tokens"]
        assert spec["max_num_batched_tokens"] >= spec["max_num_seqs"] * (1 + k)
        # Any request fits the cache alone: a storm never asks for what cannot be scheduled.
        assert spec["max_model_len"] <= (spec["num_blocks"] - 1) * BLOCK_SIZE
        for r in spec["requests"]:
            assert len(r["prompt"]) + r["max_tokens"] <= spec["max_model_len"]
        ids = {r["id"] for r in spec["requests"]}
        assert all(rid in ids for _, rid in spec["abort_at"])
        modes |= {(m, c) for _, m, c in spec["pause_at"]}
        assert all(
            len(s) == r["max_tokens"]
            for r, s in zip(spec["requests"], expected_streams(spec).values())
        )
    assert modes == {(m, c) for m in ("keep", "wait", "abort") for c in (False, True)}
    assert {s["async"] for s in specs} == {False, True}
    assert {s["num_speculative_tokens"] for s in specs} == {0, 1, 2, 3}
    assert {running for s in specs for _, running in s["reset_at"]} == {False, True}
    assert any(len(s["requests"]) >= 12 and s["max_num_batched_tokens"] <= 32 for s in specs)
    assert any(s["abort_at"] for s in specs)
