"""Hugging Face checkpoint folders: Llama, Qwen2 and Qwen3 written by the test itself, loaded
through safetensors and tokenizers; bad folders fail with the file and tensor named; the
logits match transformers on the same weights when transformers is installed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from checkpoint_files import WORDS, small_config, write_checkpoint
from dense_reference import dense_greedy, dense_logits
from safetensors.torch import save_file

from tokentape import LLM, SamplingParams
from tokentape.engine.model.decoder import CausalLM
from tokentape.engine.model.loader import init_weights, load_checkpoint
from tokentape.engine.model.model_config import CheckpointError
from tokentape.replay import verify


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_checkpoint_generates_like_its_weights(tmp_path: Path, model_type: str, tie: bool) -> None:
    config = small_config(model_type, tie)
    model = write_checkpoint(tmp_path / "ckpt", config)
    loaded_config, _ = load_checkpoint(tmp_path / "ckpt")
    assert loaded_config == config
    llm = LLM(device="cpu", model=str(tmp_path / "ckpt"), tape=None, block_size=4, num_kv_blocks=64)
    assert llm.llm_engine.engine_core.runner.eos_token_id == 1
    prompt = "w3 w17 w5 w5 w42"
    assert llm.tokenizer.encode(prompt) == [5, 19, 7, 7, 44]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == dense_greedy(model, [5, 19, 7, 7, 44], 8)
    assert out.outputs[0].text == " ".join(WORDS[t] for t in out.outputs[0].token_ids)


def test_every_eos_id_of_the_checkpoint_stops_a_request(tmp_path: Path) -> None:
    """Llama 3 lists several EOS ids in config.json and generation_config.json. As in vLLM,
    the first is the EOS and the others join each request's stop_token_ids unless
    ignore_eos; recorded so, the tape verifies without the model."""
    config = small_config("llama")
    model = write_checkpoint(tmp_path / "ckpt", config)
    prompt = [5, 19, 7, 7, 44]
    stream = dense_greedy(model, prompt, 12)
    # Two ids the greedy stream reaches, first at positions i < j (and not the EOS, 1).
    firsts = [i for i, t in enumerate(stream) if t != 1 and t not in stream[:i]]
    i, j = firsts[1], firsts[2]
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(
        json.dumps({**raw, "eos_token_id": [1, stream[j]]})
    )
    (tmp_path / "ckpt" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [stream[i], 1, stream[j]]})
    )
    loaded, _ = load_checkpoint(tmp_path / "ckpt")
    assert (loaded.eos_token_id, loaded.extra_eos_token_ids) == (1, (stream[j], stream[i]))
    tape = tmp_path / "eos.tape"
    llm = LLM(
        device="cpu", model=str(tmp_path / "ckpt"), tape=str(tape), block_size=4, num_kv_blocks=64
    )
    stopped, ignored = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(max_tokens=12, temperature=0.0),
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        ],
    )
    llm.close()
    assert stopped.outputs[0].token_ids == stream[: i + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    assert ignored.outputs[0].token_ids == stream and ignored.outputs[0].finish_reason == "length"
    result = verify(tape)
    assert result.ok, result.first_divergence and result.first_divergence.format()


def test_a_bad_eos_id_names_the_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, small_config("qwen3"))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id must be"):
        load_checkpoint(ckpt)
    (ckpt / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"generation_config\.json: not valid JSON"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers(tmp_path: Path, model_type: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = small_config(model_type, tie=model_type == "qwen3")
    model = write_checkpoint(tmp_path / "ckpt", config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ckpt"), dtype=torch.float32
    )
    tokens = [5, 19, 7, 7, 44, 2, 9, 30, 31, 12, 60]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    assert torch.allclose(dense_logits(model, tokens), expected, atol=1e-4)
    # and the engine's paged path, through its frame logprobs
    llm = LLM(device="cpu", model=str(tmp_path / "ckpt"), tape=None, block_size=4, num_kv_blocks=64)
    out = llm.generate(
        [tokens], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    )[0]
    seq = tokens + out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].log_softmax(-1)
    want = [float(ref[len(tokens) - 1 + i, t]) for i, t in enumerate(out.outputs[0].token_ids)]
    assert out.outputs[0].logprobs == pytest.approx(want, abs=1e-4)
    assert out.outputs[0].token_ids == [int(ref[len(tokens) - 1 + i].argmax()) for i in range(4)]


def test_bad_checkpoints_name_the_file_and_tensor(tmp_path: Path) -> None:
    config = small_config("qwen3")
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_checkpoint(tmp_path)
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, config)
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"config\.json: model_type 'gpt2' is not supported"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").write_text(json.dumps({**raw, "hidden_size": 32}))
    with pytest.raises(
        CheckpointError, match=r"model-0000\d-of-00002\.safetensors: tensor '\S+' has shape"
    ):
        load_checkpoint(ckpt)
    (ckpt / "config.json").write_text(
        json.dumps({k: v for k, v in raw.items() if k != "vocab_size"})
    )
    with pytest.raises(CheckpointError, match="missing required field 'vocab_size'"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    with pytest.raises(
        CheckpointError, match=r"\*\.safetensors: missing tensor 'model\.layers\.2\."
    ):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="missing tensor"):  # through the public API too
        LLM(device="cpu", model=str(ckpt), tape=None)


def test_builtin_config_round_trips_through_hf_json(tmp_path: Path) -> None:
    from tokentape.engine.model.hf_config import config_from_hf
    from tokentape.engine.model.model_config import TINY

    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    assert config_from_hf(tmp_path) == dataclasses.replace(TINY)


def test_frames_of_a_checkpoint_run_replay(tmp_path: Path) -> None:
    from tokentape.replay import verify

    write_checkpoint(tmp_path / "ckpt", small_config("llama"))
    llm = LLM(
        device="cpu",
        model=str(tmp_path / "ckpt"),
        tape=str(tmp_path / "run.tape"),
        block_size=4,
        num_kv_blocks=64,
    )
    llm.generate(["w1 w2 w3", "w9"], SamplingParams(max_tokens=5, temperature=1.0, seed=4))
    llm.close()
    result = verify(tmp_path / "run.tape")
    assert result.ok and result.num_events > 10


def test_an_integer_tensor_in_a_checkpoint_is_refused_not_cast(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, small_config("llama"))
    shard = ckpt / "model-00001-of-00002.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(str(shard))
    name = min(tensors)
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(shard))
    with pytest.raises(
        CheckpointError, match=rf"{shard.name}: tensor '{name}' is torch.int32, not floating point"
    ):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("tie", [False, True])
def test_save_checkpoint_writes_a_folder_that_loads_back_bit_for_bit(
    tmp_path: Path, tie: bool
) -> None:
    from tokentape.engine.model.loader import save_checkpoint

    config = small_config("qwen3", tie=tie)
    model = CausalLM(config)
    init_weights(model, 3)
    save_checkpoint(model, tmp_path / "ckpt")
    loaded_config, loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded_config == config
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    # The same greedy tokens through the engine, from the folder and from the seeded model.
    llm = LLM(model=str(tmp_path / "ckpt"), tape=False, num_kv_blocks=32)
    out = llm.generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    assert out[0].outputs[0].token_ids == dense_greedy(model, [5, 6, 7, 8], 6)
