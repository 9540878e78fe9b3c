"""`tokentape chaos`: seeded perturbations against the oracle. Under the historical policies
runs have findings, whose tapes and reports are kept and name a vLLM bug class; under `epoch`
there are none; the same seed gives the same run in one process or a pool."""

from __future__ import annotations

import json
import os

from cli_run import assert_one_line_error, run

from tokentape.chaos.campaign import ChaosOptions, chaos_spec, run_campaign
from tokentape.cli import main
from tokentape.postmortem import postmortem

SHORT = 300  # storm commands per seed: the CI size


def test_historical_policies_have_findings_and_keep_their_tapes(tmp_path, capsys):
    for policy in ("flag", "counter"):
        out = tmp_path / policy
        assert (
            main(
                [
                    "chaos",
                    "--seeds",
                    "6",
                    "--out",
                    str(out),
                    "--discard-policy",
                    policy,
                    "--num-commands",
                    str(SHORT),
                    "--json",
                ]
            )
            == 1
        )
        record = json.loads(capsys.readouterr().out)
        assert record["runs_with_findings"] > 0 and record["broken_streams"] > 0
        assert any(c.startswith("vllm#") for c in record["bug_classes"])
        for found in record["found"]:
            assert os.path.exists(found["tape"]) and os.path.exists(found["report"])
            # The kept tape is a real tape: its postmortem finds what the campaign found.
            kinds = {f.kind for f in postmortem(found["tape"]).findings}
            assert kinds == set(found["finding_kinds"])
        assert json.load(open(out / "chaos.json"))["seeds"] == 6


def test_epoch_has_no_finding(tmp_path, capsys):
    out = tmp_path / "epoch"
    assert main(["chaos", "--seeds", "6", "--out", str(out), "--num-commands", str(SHORT)]) == 0
    text = capsys.readouterr().out
    assert "0 run(s) with findings" in text and "seeds/hour" in text
    assert os.listdir(out) == ["chaos.json"]


def test_seeds_perturb_the_engine_and_replay_alike(tmp_path):
    shapes = {
        (s.pipeline_depth, s.num_speculative_tokens, s.num_kv_blocks)
        for s in (chaos_spec(seed, ChaosOptions()) for seed in range(40))
    }
    assert len(shapes) > 10  # depth, speculative k and KV pressure all vary
    options = ChaosOptions("flag", num_commands=SHORT)
    one = run_campaign(range(4), options, str(tmp_path / "one"))
    two = run_campaign(range(4), options, str(tmp_path / "two"), jobs=2)
    strip = [(o.seed, o.num_events, o.broken_streams, o.finding_kinds) for o in one.found]
    assert strip == [(o.seed, o.num_events, o.broken_streams, o.finding_kinds) for o in two.found]


def test_bad_arguments(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "file").write_text("")
    for argv in (
        ["--out", str(tmp_path / "full")],
        ["--out", str(tmp_path / "file")],
        ["--out", str(tmp_path / "new"), "--discard-policy", "nope"],
    ):
        assert main(["chaos", "--seeds", "1", *argv]) == 2
        assert "error" in capsys.readouterr().err


def test_chaos_against_vllm_without_vllm_is_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    monkeypatch.setenv("TOKENTAPE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    rc, _, err = run(capsys, "chaos", "--engine", "vllm", "--seeds", "1", "--out", out)
    assert_one_line_error(rc, err, "vLLM not found", "no-such-python")
    rc, _, err = run(capsys, "chaos", "--engine", "vllm", "--seeds", "1", "--out", out,
                     "--discard-policy", "flag")  # fmt: skip
    assert_one_line_error(rc, err, "--engine tokentape")
    rc, _, err = run(capsys, "chaos", "--vllm-release", "0.20.0", "--seeds", "1", "--out", out)
    assert_one_line_error(rc, err, "--engine vllm")
    assert not os.path.exists(out)
