"""A tape of every format version so far (tests/tapes/formats, each recorded by the last
commit of its format: record.py there) reads, verifies and gets a clean postmortem with this
release, as docs/tape-format.md promises. A format bump without its tape fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokentape.events import schema as ev
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape
from tokentape.replay.verify import verify

FORMATS = Path(__file__).resolve().parents[1] / "tapes" / "formats"
VERSIONS = sorted(
    int(p.stem.removeprefix("format"))
    for p in FORMATS.glob("format*.tape")
    if p.stem.removeprefix("format").isdigit()
)
# From format 7 on, a segment of a segmented tape of the same run (record.py --segment).
SEGMENT_VERSIONS = sorted(
    int(p.stem.removeprefix("format").removesuffix("-segment"))
    for p in FORMATS.glob("format*-segment.tape")
)


def test_every_format_version_has_its_tape() -> None:
    assert VERSIONS == list(range(1, ev.FORMAT_VERSION + 1))
    assert SEGMENT_VERSIONS == list(range(7, ev.FORMAT_VERSION + 1))


@pytest.mark.parametrize("version", SEGMENT_VERSIONS)
def test_a_segment_of_each_format_verifies_and_gets_a_clean_postmortem_alone(
    version: int,
) -> None:
    """The segment opens with a snapshot of requests in flight; nothing before it is there."""
    path = FORMATS / f"format{version}-segment.tape"
    tape = load_tape(path)
    first = next(tape.events())[1]
    assert isinstance(first, ev.EngineSnapshot) and first.requests and first.segment > 0
    assert tape.fold().requests.keys() >= {r.req_id for r in first.requests}
    result = verify(path)
    assert result.ok, result.first_divergence
    report = postmortem(path)
    assert report.findings == [] and report.ok


@pytest.mark.parametrize("version", VERSIONS)
def test_a_tape_of_each_format_reads_verifies_and_gets_a_clean_postmortem(version: int) -> None:
    path = FORMATS / f"format{version}.tape"
    tape = load_tape(path)
    assert tape.header.format_version == version
    state = tape.fold()
    assert state.requests and all(r.is_finished for r in state.requests.values())
    # The stop token 76 ends request "d" after 3 tokens, in every format: before format 6 the
    # reducer cut the frame there, since then the finish records the length.
    d = state.requests["d"]
    assert (d.finish_reason, d.output_token_ids[-1], len(d.output_token_ids)) == ("stop", 76, 3)
    if version >= 2:  # stop strings, on the tape since format 2
        assert {state.requests[c].stop_reason for c in ("0_c", "1_c")} == {"r ", "R,"}
    result = verify(path)
    assert result.ok, result.first_divergence
    report = postmortem(path)
    assert report.findings == [] and report.ok
