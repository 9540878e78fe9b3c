"""examples/rl_resume_from_tokens.py: pause(mode="abort"), the new weights by vLLM's chunked
transfer, each aborted rollout re-submitted as prompt + its tokens so far. The tokens after the
re-submit must equal what a fresh engine with the new weights (the tiny model drawn from
another seed) gives from that prefix, greedily; keeping the prefix cache breaks it, and the
tape's postmortem says why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokentape.postmortem import postmortem
from tokentape.replay import load_tape, verify

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "rl_resume_from_tokens", ROOT / "examples" / "rl_resume_from_tokens.py"
)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def test_resumed_rollouts_continue_as_a_fresh_engine_with_the_new_weights(
    tmp_path: Path, capsys
) -> None:
    tape = tmp_path / "resume.tape"
    assert example.main(["--tape", str(tape)]) == 0
    out = capsys.readouterr().out
    assert "clear_cache=True pipeline_depth=2: check held" in out
    assert "from step-1" in out
    assert verify(tape).ok and postmortem(tape).findings == []
    state = load_tape(tape).fold()
    aborted = [r for r in state.requests.values() if r.finish_reason == "abort"]
    resumed = [r for r in state.requests.values() if r.req_id.endswith("-resumed")]
    assert len(aborted) == len(resumed) == len(example.PROMPTS)
    for r in resumed:  # token in: the prompt plus the aborted rollout's tokens
        before = state.requests[r.req_id.removesuffix("-resumed")]
        assert r.prompt_token_ids == before.prompt_token_ids + before.output_token_ids
        assert len(before.output_token_ids) + len(r.output_token_ids) == example.MAX_TOKENS
    assert state.weight_version == example.NEW_VERSION


def test_keeping_the_prefix_cache_breaks_the_check_and_the_postmortem_says_why(
    tmp_path: Path, capsys
) -> None:
    tape = tmp_path / "kept.tape"
    assert example.main(["--keep-prefix-cache", "--tape", str(tape)]) == 1
    assert "CHECK FAILED" in capsys.readouterr().out
    report = postmortem(tape)
    found = [f for f in report.findings if f.kind == "stale_prefix_hit_after_weight_update"]
    assert found and all(f.severity == "warning" for f in found)  # chosen: clear_cache=False
    assert {r for f in found for r in f.request_ids} == {
        f"r{i}-resumed" for i in range(len(example.PROMPTS))
    }
