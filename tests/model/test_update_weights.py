"""Weight updates for RL: only while paused and drained, validated before anything changes,
recorded with a content hash that replay accepts without the weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch

from tokentape import LLM, SamplingParams
from tokentape.engine.model.loader import builtin_model
from tokentape.engine.runners.model_runner import TorchModelRunner
from tokentape.events import schema as ev
from tokentape.replay import fold, verify

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_update_weights_only_while_paused_and_drained() -> None:
    llm = LLM(device="cpu", model="tiny", tape=None, pipeline_depth=2)
    new = builtin_model("tiny", seed=1)[1].state_dict()
    with pytest.raises(RuntimeError, match="pause generation first"):
        llm.llm_engine.update_weights(new)
    llm.llm_engine.add_request("r", [5, 6, 7], GREEDY)
    llm.llm_engine.step()
    llm.llm_engine.step()
    assert llm.llm_engine.engine_core.state.in_flight_steps  # a step is in flight while running
    with pytest.raises(RuntimeError, match="pause generation first"):
        llm.llm_engine.update_weights(new)
    llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
    weights_id = llm.llm_engine.update_weights(new)
    assert (
        weights_id.startswith("sha256:")
        and llm.llm_engine.engine_core.state.weights_id == weights_id
    )


def test_new_weights_change_the_tokens_and_match_a_fresh_model(tmp_path: Path) -> None:
    old = (
        LLM(device="cpu", model="tiny", tape=None)
        .generate(["Hello"], GREEDY)[0]
        .outputs[0]
        .token_ids
    )
    fresh = (
        LLM(device="cpu", model="tiny", tape=None, seed=1)
        .generate(["Hello"], GREEDY)[0]
        .outputs[0]
        .token_ids
    )
    llm = LLM(device="cpu", model="tiny", tape=str(tmp_path / "rl.tape"))
    assert llm.generate(["Hello"], GREEDY)[0].outputs[0].token_ids == old
    llm.llm_engine.pause_generation(mode="keep")
    llm.llm_engine.update_weights(builtin_model("tiny", seed=1)[1].state_dict())
    llm.llm_engine.resume_generation()
    assert llm.generate(["Hello"], GREEDY)[0].outputs[0].token_ids == fresh != old
    llm.close()
    result = verify(tmp_path / "rl.tape")  # no weights needed: the recorded hash stands for them
    assert result.ok, result.first_divergence
    assert fold(tmp_path / "rl.tape").weights_id == llm.llm_engine.engine_core.runner.weights_id


def test_a_bad_update_changes_nothing_and_the_engine_serves_on() -> None:
    llm = LLM(device="cpu", model="tiny", tape=None)
    before = llm.generate(["Hello"], GREEDY)[0].outputs[0].token_ids
    weights_id = llm.llm_engine.engine_core.runner.weights_id
    llm.llm_engine.pause_generation(mode="keep")
    good = builtin_model("tiny", seed=1)[1].state_dict()
    wrong_shape = dict(good)
    wrong_shape["model.layers.3.mlp.down_proj.weight"] = torch.zeros(
        256, 100
    )  # the last one checked
    with pytest.raises(
        ValueError, match=r"'model\.layers\.3\.mlp\.down_proj\.weight' has shape \(256, 100\)"
    ):
        llm.llm_engine.update_weights(wrong_shape)
    with pytest.raises(ValueError, match="unknown tensor 'model.layers.9.mlp.up_proj.weight'"):
        llm.llm_engine.update_weights({**good, "model.layers.9.mlp.up_proj.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="not a floating-point tensor"):
        llm.llm_engine.update_weights({"model.norm.weight": torch.ones(256, dtype=torch.int64)})
    assert llm.llm_engine.engine_core.runner.weights_id == weights_id
    assert (
        llm.llm_engine.engine_core.state.weights_id is None
    )  # nothing recorded for the refused updates
    llm.llm_engine.resume_generation()
    assert llm.generate(["Hello"], GREEDY)[0].outputs[0].token_ids == before


def test_partial_update_from_a_checkpoint_folder(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    new = builtin_model("tiny", seed=1)[1].state_dict()
    save_file({k: v.contiguous() for k, v in new.items()}, str(tmp_path / "model.safetensors"))
    import json

    from tokentape.engine.model.model_config import TINY

    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    a = LLM(device="cpu", model="tiny", tape=None)
    a.llm_engine.pause_generation(mode="keep")
    a.llm_engine.update_weights(str(tmp_path))
    b = LLM(device="cpu", model="tiny", tape=None, seed=1)
    assert a.llm_engine.engine_core.runner.weights_id == b.llm_engine.engine_core.runner.weights_id


@pytest.mark.parametrize("policy,rc", [("epoch", 0), ("flag", 1)])
def test_rl_example_check_holds_and_flag_breaks_it(policy: str, rc: int, tmp_path: Path) -> None:
    args = [
        sys.executable,
        str(ROOT / "examples" / "rl_pause_resume.py"),
        "--discard-policy",
        policy,
    ]
    if policy == "flag":
        args += [
            "--pipeline-depth",
            "1",
            "--pipeline-depth",
            "2",
            "--tape",
            str(tmp_path / "rl.tape"),
        ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert "pipeline_depth=1 discard_policy=" in proc.stdout
    if policy == "flag":
        assert "pipeline_depth=1 discard_policy=flag: check held" in proc.stdout
        assert "pipeline_depth=2 discard_policy=flag: CHECK FAILED" in proc.stdout
        # Each round is on its own tape; the postmortem names the failed one's bug.
        from tokentape.cli import main
        from tokentape.postmortem.analysis import postmortem

        depth1, depth2 = tmp_path / "rl-depth1.tape", tmp_path / "rl-depth2.tape"
        assert f"(tape: {depth2})" in proc.stdout
        assert postmortem(depth1).ok
        kinds = {(f.kind, f.bug_class) for f in postmortem(depth2).findings}
        assert ("post_resume_token_dropped", "vllm#42043") in kinds
        assert main(["replay", "verify", str(depth2)]) == 0
        again = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
        assert again.returncode == 2 and "the file exists; pass --force" in again.stderr


def test_weights_updated_is_on_the_tape() -> None:
    llm = LLM(device="cpu", model="tiny", tape=None)
    llm.llm_engine.pause_generation(mode="keep")
    wid = llm.llm_engine.update_weights(builtin_model("tiny", seed=2)[1].state_dict())
    events = [
        e
        for _, e in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(e, ev.WeightsUpdated)
    ]
    assert events == [ev.WeightsUpdated(0, wid, "1")]  # numbered: no weight_version given


def test_a_chunked_transfer_of_the_model_equals_a_whole_update(tmp_path: Path) -> None:
    """vLLM's native transfer (RFC #31848) on the real model: the state dict in chunks of a
    few tensors, a bad chunk refused by name in between, the same SHA-256 and tokens as the
    whole update, and a tape that verifies without the weights."""
    new = builtin_model("tiny", seed=1)[1].state_dict()
    fresh = LLM(device="cpu", model="tiny", tape=None, seed=1)
    expected = fresh.generate(["Hello"], GREEDY)[0].outputs[0].token_ids
    llm = LLM(device="cpu", model="tiny", tape=str(tmp_path / "chunks.tape"))
    llm.llm_engine.pause_generation(mode="keep")
    llm.llm_engine.start_weight_update()
    names = list(new)
    for i in range(0, len(names), 5):
        llm.llm_engine.update_weights({n: new[n] for n in names[i : i + 5]})
        if i == 0:
            with pytest.raises(ValueError, match="'model.norm.weight' has shape \\(3,\\)"):
                llm.llm_engine.update_weights({"model.norm.weight": torch.ones(3)})
    assert (
        llm.llm_engine.finish_weight_update("v1") == fresh.llm_engine.engine_core.runner.weights_id
    )
    llm.llm_engine.resume_generation()
    out = llm.generate(["Hello"], GREEDY)[0].outputs[0]
    assert out.token_ids == expected and out.weight_versions == ["v1"] * len(expected)
    llm.close()
    assert verify(tmp_path / "chunks.tape").ok


def test_a_transfer_copies_its_chunks_into_the_memory_of_the_one_before(monkeypatch) -> None:
    """The stage's memory is kept from one transfer to the next (memory written before is
    copied into several times faster), never the weights' own; a tensor sent again, or a
    chunk that fails once copied, leaves the hash the finish gives equal to one computed
    afresh over the weights; a sleep frees the kept memory."""
    import tokentape.engine.model.loader as loader

    llm = LLM(device="cpu", model="tiny", tape=None)
    engine = llm.llm_engine
    runner = cast(TorchModelRunner, engine.engine_core.runner)
    params = dict(runner.model.named_parameters())
    names = sorted(params)
    half = len(names) // 2
    engine.pause_generation(mode="keep")
    engine.start_weight_update()
    engine.update_weights(builtin_model("tiny", seed=1)[1].state_dict())
    engine.finish_weight_update()
    kept = {n: t.data_ptr() for n, t in runner._stage_memory.items()}
    assert sorted(kept) == names
    assert not {p.data_ptr() for p in params.values()} & set(kept.values())

    def fresh(seed: int) -> tuple[LLM, str]:
        built = LLM(device="cpu", model="tiny", tape=None, seed=seed)
        return built, cast(TorchModelRunner, built.llm_engine.engine_core.runner).weights_id

    # The first tensors (in the hash's order) sent twice: the second ones count.
    new = builtin_model("tiny", seed=2)[1].state_dict()
    engine.start_weight_update()
    engine.update_weights({n: torch.zeros_like(new[n]) for n in names[:3]})
    engine.update_weights(new)
    staged = {n: t.data_ptr() for n, t in runner._staged.items() if n not in names[:3]}
    assert staged == {n: kept[n] for n in names[3:]}
    assert engine.finish_weight_update() == fresh(2)[1]

    # A chunk that fails once copied (in its hashing) counts for nothing: the finish loads
    # half the new weights over the old, and hashes what the weights then hold.
    new = builtin_model("tiny", seed=3)[1].state_dict()
    engine.start_weight_update()
    engine.update_weights({n: new[n] for n in names[:half]})
    with monkeypatch.context() as m:
        m.setattr(loader, "chunk_record", lambda tensors: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            engine.update_weights({n: torch.ones_like(new[n]) for n in names[half:]})
    weights_id = engine.finish_weight_update()
    runner._forget_weights_id()
    assert runner.weights_id == weights_id  # hashed again from the weights themselves

    engine.start_weight_update()
    engine.update_weights({n: new[n] for n in names[half:]})
    expected, expected_id = fresh(3)
    assert engine.finish_weight_update() == expected_id
    engine.resume_generation()
    assert (
        llm.generate(["Hello"], GREEDY)[0].outputs[0].token_ids
        == expected.generate(["Hello"], GREEDY)[0].outputs[0].token_ids
    )
    llm.sleep(level=1)
    assert runner._stage_memory == {}
    llm.wake_up()
    llm.close()


def test_the_weights_hash_taken_on_piece_by_piece_is_the_whole_hash() -> None:
    """WeightsHashStream: the tensors in any order, some sent twice, hash as weights_hash."""
    from tokentape.engine.model.loader import WeightsHashStream, weights_hash

    model = builtin_model("tiny", seed=4)[1]
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = list(params)[::-1]  # the hash's order is the names' sorted order: the last first
    stream = WeightsHashStream(params)
    held: dict[str, torch.Tensor] = {}
    for i in range(0, len(names), 3):
        held.update({n: params[n] if i else torch.zeros_like(params[n]) for n in names[i : i + 3]})
        stream.take(held)
    stream.forget(names[:3])  # the first chunk, sent again
    held.update({n: params[n] for n in names[:3]})
    with pytest.raises(KeyError, match="no tensor"):
        WeightsHashStream(params).hexdigest({})
    assert stream.hexdigest(held) == weights_hash(model)
