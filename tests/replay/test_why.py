"""`tokentape why`: one request folded alone from its own events (found by seeks on an SQLite
tape) derives what a full fold derives, and the chain names the discard decisions."""

from __future__ import annotations

import json
import random

import pytest

from tokentape.chaos import StormSpec, run_storm
from tokentape.cli import main
from tokentape.replay import load_tape
from tokentape.replay.diff import client_streams
from tokentape.replay.why import WhyError, trace_request, why
from tokentape.replay.why_source import WhySource

FIELDS = (
    "output_token_ids",
    "num_frames_dropped",
    "epoch",
    "finish_reason",
    "num_preemptions",
    "num_output_placeholders",
    "num_computed_tokens",
    "stop_reason",
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "policy,depth,k", [("epoch", 2, 0), ("flag", 3, 0), ("counter", 2, 2), ("deliver", 3, 1)]
)
def test_projected_request_equals_full_fold(tmp_path, policy, depth, k):
    path = str(tmp_path / "storm.tape")
    spec = StormSpec(
        seed=11,
        pipeline_depth=depth,
        num_speculative_tokens=k,
        discard_policy=policy,
        num_commands=400,
    )
    run_storm(spec, tape=path)
    tape = load_tape(path)
    full = tape.fold()
    source = WhySource(tape)
    try:
        for req_id, want in full.requests.items():
            got = trace_request(tape, req_id, source).req
            for name in FIELDS:
                assert getattr(got, name) == getattr(want, name), (req_id, name)
    finally:
        source.close()
    assert sum(r.num_preemptions for r in full.requests.values()) > 0  # discards were exercised
    # Sampled answers against the full fold and what the client received.
    streams = client_streams(tape)
    rng = random.Random(policy)
    for req_id in rng.sample(sorted(full.requests), 25):
        req = full.requests[req_id]
        for p in {0, rng.randrange(req.max_output_tokens), len(req.output_token_ids) - 1} - {-1}:
            res = why(path, req_id, p)
            assert res.token == (req.output_token_ids[p] if p < len(req.output_token_ids) else None)
            assert res.delivered == (p < len(streams[req_id].token_ids))
            if res.delivered:
                assert streams[req_id].token_ids[p] == res.token
                assert streams[req_id].token_seqs[p] == res.delivered_seq
                delivered = [x for x in res.chain if x.role == "delivered"]
                assert [x.seq for x in delivered] == [res.delivered_seq] and res.step is not None
                produced = next(x for x in res.chain if x.seq == res.frame_seq)
                assert produced.role == "produced" and produced.seq < res.delivered_seq


def _flag_tapes(tmp_path):
    from tokentape import LLM, SamplingParams

    tapes = {}
    for policy in ("flag", "epoch"):
        path = str(tmp_path / f"{policy}.tape")
        with LLM("oracle", tape=path, discard_policy=policy, pipeline_depth=2) as llm:
            engine = llm.llm_engine
            engine.add_request(
                "0", list(range(3, 20)), SamplingParams(max_tokens=12, ignore_eos=True)
            )
            for _ in range(4):
                engine.step()
            engine.pause_generation("keep", clear_cache=True)
            engine.resume_generation()
            while engine.has_unfinished_requests():
                engine.step()
        tapes[policy] = path
    return tapes


def test_flag_shift_is_explained(tmp_path, capsys):
    tapes = _flag_tapes(tmp_path)
    flag = why(tapes["flag"], "0", 6)
    roles = [x.role for x in flag.chain]
    assert "dropped" in roles and "preempted" in roles and roles[-1] == "delivered"
    assert flag.delivered and flag.scheduled_for == 7  # computed for 7, delivered at 6
    assert "although fresh" in next(x.detail for x in flag.chain if x.role == "dropped")
    epoch = why(tapes["epoch"], "0", 6)
    assert epoch.scheduled_for == 6 and "dropped" not in [x.role for x in epoch.chain]
    # Both tapes: the token at 6 is the token each produced; flag's is epoch's token 7.
    assert flag.token == load_tape(tapes["epoch"]).fold().requests["0"].output_token_ids[7]
    assert main(["why", tapes["flag"], "0", "6"]) == 0  # text, plain when piped
    text = capsys.readouterr().out
    assert text.startswith("request '0', output position 6: token") and "#42043" in text
    assert " dropped " in text and " delivered " in text
    # The seek path (SQLite) and the scan of an in-memory copy give one answer.
    assert why(_in_memory(tapes["flag"]), "0", 6).chain == flag.chain


def _in_memory(path):
    from tokentape.events.store import MemoryTape

    tape = load_tape(path)
    copy = MemoryTape(tape.header)
    for _, event in tape.events():
        copy.append(event)
    return copy


def test_missing_token_and_errors(tmp_path, capsys):
    from tokentape import LLM, SamplingParams

    path = str(tmp_path / "abort.tape")
    with LLM("oracle", tape=path) as llm:
        llm.llm_engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
        for _ in range(5):
            llm.llm_engine.step()
        llm.llm_engine.abort_request("a")
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
    n = len(load_tape(path).fold().requests["a"].output_token_ids)
    res = why(path, "a", n + 1)
    assert not res.delivered and res.token is None and "finished (abort)" in res.verdict
    with pytest.raises(WhyError, match="no request 'b'"):
        why(path, "b", 0)
    with pytest.raises(WhyError, match="cannot exist"):
        why(path, "a", 20)
    assert main(["why", path, "a", "0", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["delivered"] and record["chain"][-1]["role"] == "delivered"
    for argv in (
        ["why", path, "b", "0"],
        ["why", path, "a", "99"],
        ["why", str(tmp_path / "x"), "a", "0"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1


def test_request_index_is_cached_and_keyed_by_the_file(tmp_path):
    tapes = _flag_tapes(tmp_path)
    tape = load_tape(tapes["flag"])
    first = WhySource(tape)
    assert first.added_seq("0") == 0 and first.index_built
    first.close()
    again = WhySource(tape)
    assert again.added_seq("0") == 0 and not again.index_built  # read from the cache
    again.close()
