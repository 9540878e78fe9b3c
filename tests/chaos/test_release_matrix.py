"""The release matrix (tokentape/chaos/release_matrix.py), from campaign summaries: releases
in version order, each class's first release and the first after it without the class."""

from __future__ import annotations

from collections import Counter

from tokentape.chaos.release_matrix import ReleaseMatrix, version_key
from tokentape.chaos.vllm_storms import VLLMCampaignSummary


def _summary(release: str, classes: dict[str, tuple[int, int]]) -> VLLMCampaignSummary:
    """A campaign of seeds 0-59 on `release` that showed each class on (seeds, first seed)."""
    s = VLLMCampaignSummary(release, 0, shrink=False, num_seeds=60)
    s.finding_classes = Counter({c: n for c, (n, _) in classes.items()})
    s.first_seed_of = {c: first for c, (_, first) in classes.items()}
    return s


def test_versions_sort_by_their_numbers() -> None:
    releases = ["0.32.0+cpu", "0.9.1", "0.20.0", "0.100.0", "0.26.0rc1"]
    assert sorted(releases, key=version_key) == [
        "0.9.1",
        "0.20.0",
        "0.26.0rc1",
        "0.32.0+cpu",
        "0.100.0",
    ]


def test_each_class_starts_where_first_seen_and_stops_at_the_first_release_without_it() -> None:
    matrix = ReleaseMatrix.of(
        [
            _summary("0.32.0+cpu", {}),
            _summary("0.24.0", {"vllm#46066": (4, 17), "vllm#42117-spec-units": (20, 2)}),
            _summary("0.20.0", {"vllm#42043": (9, 5), "vllm#46066": (4, 8)}),
            _summary("0.26.0", {"vllm#42117-spec-units": (21, 2)}),
            _summary("0.33.0", {"hang": (1, 40)}),
        ]
    )
    assert matrix.releases == ["0.20.0", "0.24.0", "0.26.0", "0.32.0+cpu", "0.33.0"]
    assert matrix.seeds == range(0, 60)
    rows = {r.finding_class: (r.first_with, r.first_without) for r in matrix.rows}
    assert rows == {
        "vllm#42043": ("0.20.0", "0.24.0"),
        "vllm#46066": ("0.20.0", "0.26.0"),
        "vllm#42117-spec-units": ("0.24.0", "0.32.0+cpu"),
        "hang": ("0.33.0", None),  # still there in the newest release run
    }
    assert [r.finding_class for r in matrix.rows][:2] == ["vllm#42043", "vllm#46066"]
    assert matrix.rows[1].first_seed == {"0.20.0": 8, "0.24.0": 17}
    table = matrix.table()
    assert table[0].split() == ["class", *matrix.releases, "first", "with", "first", "without"]
    assert table[1].split() == ["vllm#42043", "9", ".", ".", ".", ".", "0.20.0", "0.24.0"]
    assert table[-1].endswith("0.33.0  (still there)")
    record = matrix.to_json()
    assert record["seeds"] == [0, 59] and record["classes"][0]["seeds"]["0.20.0"] == 9


def test_no_finding_anywhere_is_an_empty_matrix() -> None:
    matrix = ReleaseMatrix.of([_summary("0.33.0", {}), _summary("0.32.0", {})])
    assert matrix.rows == [] and matrix.table() == [matrix.table()[0]]
