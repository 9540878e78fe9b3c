"""The same chaos seeds on several vLLM releases, side by side: for every class of finding
(a vLLM bug class, else the finding's kind), how many seeds showed it on each release, the
first release that has it and the first release after that which does not (where it was
fixed, as far as these seeds see).

    summaries = [run_vllm_campaign(seeds, found, r, f"out/{r}") for r in releases]
    matrix = ReleaseMatrix.of(summaries)
    print(matrix.table())       # one row a class, one column a release
    json.dumps(matrix.to_json())
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokentape.chaos.vllm_storms import VLLMCampaignSummary


def version_key(release: str) -> tuple[int, ...]:
    """ "0.9.1" before "0.20.0": releases sort by their numbers ("0.32.0+cpu" as 0.32.0)."""
    return tuple(int(n) for n in re.findall(r"\d+", release.split("+")[0])[:3])


@dataclass(frozen=True, slots=True)
class MatrixRow:
    finding_class: str
    seeds: dict[str, int]  # release -> seeds that showed the class (0: none)
    first_seed: dict[str, int]  # release -> the first such seed
    first_with: str  # the oldest release that has it
    first_without: str | None  # the first release after first_with without it; None: still


@dataclass(frozen=True, slots=True)
class ReleaseMatrix:
    releases: list[str]  # in version order
    seeds: range
    rows: list[MatrixRow]  # in order of first_with, then of the class

    @classmethod
    def of(cls, summaries: list[VLLMCampaignSummary]) -> ReleaseMatrix:
        ordered = sorted(summaries, key=lambda s: version_key(s.release))
        releases = [s.release for s in ordered]
        classes = {c for s in ordered for c in s.finding_classes}
        rows = []
        for c in classes:
            seeds = {s.release: s.finding_classes.get(c, 0) for s in ordered}
            with_it = [r for r in releases if seeds[r]]
            after = releases[releases.index(with_it[0]) + 1 :]
            rows.append(
                MatrixRow(
                    c,
                    seeds,
                    {s.release: s.first_seed_of[c] for s in ordered if c in s.first_seed_of},
                    with_it[0],
                    next((r for r in after if not seeds[r]), None),
                )
            )
        rows.sort(key=lambda row: (version_key(row.first_with), row.finding_class))
        first = ordered[0].first_seed if ordered else 0
        return cls(releases, range(first, first + (ordered[0].num_seeds if ordered else 0)), rows)

    def to_json(self) -> dict[str, object]:
        return {
            "releases": self.releases,
            "seeds": [self.seeds.start, self.seeds.stop - 1] if self.seeds else [],
            "classes": [
                {
                    "class": row.finding_class,
                    "first_with": row.first_with,
                    "first_without": row.first_without,
                    "seeds": row.seeds,
                    "first_seed": row.first_seed,
                }
                for row in self.rows
            ],
        }

    def table(self) -> list[str]:
        """The matrix as aligned text lines: a class per row, the seeds that showed it on
        each release ('.' for none), then where it starts and where it stops."""
        head = ["class", *self.releases, "first with", "first without"]
        body = [
            [
                row.finding_class,
                *(str(row.seeds[r]) if row.seeds[r] else "." for r in self.releases),
                row.first_with,
                row.first_without or "(still there)",
            ]
            for row in self.rows
        ]
        widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
        return [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(line, widths))
            ).rstrip()
            for line in [head, *body]
        ]
