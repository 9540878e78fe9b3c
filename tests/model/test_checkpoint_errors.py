"""Bad checkpoint folders: every one a CheckpointError naming the file and the problem (never
a raw AttributeError, UnicodeDecodeError, ZeroDivisionError, RuntimeError or
IsADirectoryError), one error line and exit status 2 from `tokentape generate`; weights with a
NaN or an infinity refused at load and by update_weights."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoint_files import small_config, write_checkpoint
from safetensors.torch import load_file, save_file

from tokentape import LLM
from tokentape.cli import main as cli_main
from tokentape.engine.model.loader import builtin_model, load_checkpoint, prepare_update
from tokentape.engine.model.model_config import CheckpointError

RAW = small_config("qwen3").to_hf_dict()
SHARD1 = "model-00001-of-00002.safetensors"


def config_json(text: str | bytes) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        file = folder / "config.json"
        file.write_bytes(text) if isinstance(text, bytes) else file.write_text(text)

    return write


def config_with(**fields: object) -> Callable[[Path], None]:
    return config_json(json.dumps({**RAW, **fields}))


def directory(name: str) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        if (folder / name).exists():
            (folder / name).unlink()
        (folder / name).mkdir()

    return make


def remove(*names: str) -> Callable[[Path], None]:
    def delete(folder: Path) -> None:
        for name in names:
            for file in folder.glob(name):
                file.unlink()

    return delete


def write_file(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(data)


def poison(value: float) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        tensors = load_file(str(folder / SHARD1))
        tensors["model.embed_tokens.weight"][3, 5] = value
        save_file(tensors, str(folder / SHARD1))

    return write


# (what is wrong, the file named, the problem as the message says it)
BAD_FOLDERS = [
    (config_json("[1, 2]"), "config.json", "holds a JSON list, not an object"),
    (config_json(b"\x89PNG\r\n\x1a\n\x00\xff"), "config.json", r"not a text file \(byte 0"),
    (config_json('{"model_type": '), "config.json", "not valid JSON"),
    (
        config_with(num_attention_heads=0),
        "config.json",
        "num_attention_heads must be a positive integer, got 0",
    ),
    (
        config_with(num_key_value_heads=0),
        "config.json",
        "num_key_value_heads must be a positive integer, got 0",
    ),
    (config_with(hidden_size=-64), "config.json", "hidden_size must be a positive integer"),
    (
        config_with(num_attention_heads=4.0),
        "config.json",
        "num_attention_heads must be a positive integer, got 4.0",
    ),
    (
        config_with(num_key_value_heads=3),
        "config.json",
        r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
    ),
    (
        config_with(vocab_size=10**13),
        SHARD1,  # no 10**13-row tensor allocated to say so
        r"tensor '\S+' has shape \(64, 64\), config.json implies \(10000000000000, 64\)",
    ),
    (
        config_with(num_hidden_layers=10**9),
        "*.safetensors",
        r"missing tensor 'model.layers.2.\*' \(config.json says num_hidden_layers = 1000000000",
    ),
    (config_with(tie_word_embeddings="yes"), "config.json", "tie_word_embeddings must be true"),
    (config_with(rms_norm_eps=0), "config.json", "rms_norm_eps must be a number > 0"),
    (directory("config.json"), "config.json", "is a directory, not a JSON file"),
    (remove("config.json"), "config.json", r"missing \(a checkpoint folder needs config.json\)"),
    (
        write_file("generation_config.json", b"\xff\xfe{"),
        "generation_config.json",
        "not a text file",
    ),
    (write_file("generation_config.json", b"[]"), "generation_config.json", "holds a JSON list"),
    (directory("generation_config.json"), "generation_config.json", "is a directory"),
    (
        write_file("tokenizer.json", b'{"version": "1.0", "model": 5}'),
        "tokenizer.json",
        "not a tokenizer the tokenizers library can read",
    ),
    (
        write_file("tokenizer.json", b"\x00\x01"),
        "tokenizer.json",
        "not a tokenizer the tokenizers library can read",
    ),
    (directory("tokenizer.json"), "tokenizer.json", "is a directory"),
    (
        remove("*.safetensors", "*.index.json"),
        "*.safetensors",
        r"missing \(no weight files in the checkpoint folder\)",
    ),
    (
        remove("model-00002-of-00002.safetensors"),
        "model-00002-of-00002.safetensors",
        r"missing \(named by .*model.safetensors.index.json\)",
    ),
    (
        write_file(SHARD1, b"\x08\x00\x00\x00\x00\x00\x00\x00{}"),
        SHARD1,
        "cannot read the safetensors file",
    ),
    (poison(float("nan")), SHARD1, "tensor 'model.embed_tokens.weight' holds 1 NaN value"),
    (poison(float("-inf")), SHARD1, "tensor 'model.embed_tokens.weight' holds 1 infinite value"),
]


@pytest.mark.parametrize(
    "damage,file,problem",
    BAD_FOLDERS,
    ids=[f"{f}-{re.sub(r'[^a-z]+', '_', p[:24])}" for _, f, p in BAD_FOLDERS],
)
def test_a_bad_folder_names_the_file_and_the_problem(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], None],
    file: str,
    problem: str,
) -> None:
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, small_config("qwen3"))
    damage(folder)
    message = rf"^{re.escape(str(folder / file))}: {problem}"
    with pytest.raises(CheckpointError, match=message):
        LLM(model=str(folder), tape=None, block_size=4, num_kv_blocks=16)
    # the command line: one line, exit status 2, and no tape left behind
    os.chdir(tmp_path)
    assert cli_main(["generate", "--model", str(folder), "hi"]) == 2
    err = capsys.readouterr().err
    assert re.match(f"error: {message[1:]}", err) and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize(
    "model,message",
    [
        (
            "/nonexistent",
            r"/nonexistent: no such folder \(tokentape loads local checkpoint folders",
        ),
        ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B: no such folder"),
        ("./ckpt-typo", r"\./ckpt-typo: no such folder"),
        ("tiny2", r"unknown model 'tiny2': use 'tiny', 'qwen3-0.6b', 'oracle'"),
    ],
)
def test_a_model_that_is_not_there_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, message: str
) -> None:
    os.chdir(tmp_path)
    assert cli_main(["generate", "--model", model, "hi"]) == 2
    err = capsys.readouterr().err
    assert re.match(f"error: {message}", err) and err.count("\n") == 1, err
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="file: not a folder"):
        LLM(model=str(tmp_path / "file"), tape=None)


def test_generate_refuses_before_removing_the_old_tape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--force removes an existing tape, but only once the model is known to load."""
    tape = tmp_path / "run.tape"
    assert cli_main(["generate", "--model", "oracle", "--tape", str(tape), "hi"]) == 0
    before = tape.read_bytes()
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, small_config("llama"))
    (folder / "config.json").write_text("[]")
    assert cli_main(["generate", "--model", str(folder), "--tape", str(tape), "--force", "hi"]) == 2
    assert "config.json: holds a JSON list" in capsys.readouterr().err
    assert tape.read_bytes() == before


@pytest.mark.parametrize("value,kind", [(float("nan"), "NaN"), (float("inf"), "infinite")])
def test_update_weights_refuses_non_finite_values_and_changes_nothing(
    value: float, kind: str
) -> None:
    llm = LLM(model="tiny", tape=None, num_kv_blocks=64)
    engine = llm.llm_engine
    engine.pause_generation(mode="keep")
    before = engine.engine_core.runner.weights_id
    new = builtin_model("tiny", seed=1)[1].state_dict()
    name = "model.layers.2.mlp.up_proj.weight"
    new[name][7, 11] = value
    with pytest.raises(
        ValueError,
        match=rf"update_weights: tensor '{name}' holds 1 {kind} "
        r"value\(s\) out of \d+; nothing was changed",
    ):
        engine.update_weights(new)
    assert engine.engine_core.runner.weights_id == before
    new[name][7, 11] = 0.0
    assert engine.update_weights(new) != before  # the engine still takes a good update


def test_update_weights_checks_the_values_as_the_model_holds_them() -> None:
    """1e6 is finite in float32, infinite once cast to a float16 model's dtype."""
    model = builtin_model("tiny", seed=0)[1].half()
    new = {"model.norm.weight": torch.full((256,), 1e6)}
    with pytest.raises(
        ValueError,
        match=r"update_weights: tensor 'model.norm.weight' holds 256 "
        r"infinite value\(s\) out of 256 once cast to torch.float16; nothing "
        "was changed",
    ):
        prepare_update(model, new)


def test_update_weights_from_a_folder_names_its_file(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, small_config("qwen3"))
    llm = LLM(model=str(folder), tape=None, block_size=4, num_kv_blocks=16)
    poison(float("nan"))(folder)
    llm.llm_engine.pause_generation(mode="keep")
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(folder / SHARD1))}: update_weights: "
        "tensor 'model.embed_tokens.weight' holds 1 NaN value.*nothing was changed",
    ):
        llm.llm_engine.update_weights(str(folder))


def test_a_big_finite_checkpoint_loads(tmp_path: Path) -> None:
    """The check sums each tensor: a sum that overflows is rechecked, not refused."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, small_config("qwen3"))
    poison(3e38)(folder)
    tensors = load_file(str(folder / SHARD1))
    tensors["model.embed_tokens.weight"][4, 5] = 3e38
    save_file(tensors, str(folder / SHARD1))
    _, model = load_checkpoint(folder)
    assert model.model.embed_tokens.weight[4, 5] == 3e38
