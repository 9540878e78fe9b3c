"""A checkpoint folder's tokenizer. Without tokenizer.json its token ids mean nothing to the
byte tokenizer, so text prompts are refused naming the missing file (nothing recorded), while
token-id prompts run and give token ids with empty text, as vLLM's skip_tokenizer_init. A
folder written from a built-in model carries the byte tokenizer as its tokenizer.json."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from checkpoint_files import small_config, write_checkpoint
from dense_reference import dense_greedy

from tokentape import LLM, AsyncLLM, SamplingParams
from tokentape.engine.frontend_inputs import frontend_tokenizer
from tokentape.engine.model.model_config import CheckpointError
from tokentape.engine.tokenizer import HFTokenizer, MissingTokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_checkpoint(tmp_path / "ckpt", small_config("llama"))
    (tmp_path / "ckpt" / "tokenizer.json").unlink()
    return tmp_path / "ckpt"


def test_text_prompts_are_refused_and_nothing_is_recorded(folder: Path) -> None:
    llm = LLM(model=str(folder), tape=None, block_size=4, num_kv_blocks=64)
    assert isinstance(llm.tokenizer, MissingTokenizer)
    missing = re.escape(str(folder / "tokenizer.json"))
    with pytest.raises(
        CheckpointError,
        match=rf"^{missing}: missing, so text cannot be encoded "
        "for this checkpoint; pass prompts as token ids",
    ):
        llm.generate([[5, 6, 7], "w3 w4"], GREEDY)
    assert (
        not llm.llm_engine.engine_core.state.requests and len(llm.llm_engine.engine_core.tape) == 0
    )  # the header alone


def test_token_id_prompts_run_with_empty_text(folder: Path) -> None:
    from tokentape.engine.model.loader import load_checkpoint

    _, model = load_checkpoint(folder)
    llm = LLM(model=str(folder), tape=None, block_size=4, num_kv_blocks=64)
    out = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0]
    assert out.token_ids == dense_greedy(model, [5, 6, 7], 6)
    assert out.text == ""  # not the byte tokenizer's garbage
    # stop strings would be looked for in that empty text: refused instead
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop=["w1"]))
    with pytest.raises(ValueError, match="bad_words given as strings need a tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, bad_words=["w1"]))


def test_async_llm_refuses_text_too(folder: Path) -> None:
    assert isinstance(frontend_tokenizer(str(folder)), MissingTokenizer)
    engine = AsyncLLM(str(folder), multiprocess_mode=False, block_size=4, num_kv_blocks=64)

    async def first_output(prompt: object) -> object:
        async for out in engine.generate(prompt, GREEDY, "r" + str(len(str(prompt)))):
            return out
        return None

    try:
        with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing"):
            asyncio.run(first_output("w3 w4"))
        assert asyncio.run(first_output([5, 6, 7])) is not None
    finally:
        engine.shutdown()


def test_a_folder_with_its_tokenizer_uses_it(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", small_config("qwen2"))
    assert isinstance(frontend_tokenizer(str(tmp_path / "ckpt")), HFTokenizer)
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a tokenizer"):
        frontend_tokenizer(str(tmp_path / "ckpt"))


def test_a_saved_builtin_model_keeps_its_byte_tokenizer(tmp_path: Path) -> None:
    """save_checkpoint writes the built-in models' byte tokenizer as tokenizer.json: the
    folder reads text as the built-in model does, token for token and byte for byte."""
    from tokentape.engine.model.loader import builtin_model, save_checkpoint
    from tokentape.engine.tokenizer import ByteTokenizer

    folder = save_checkpoint(builtin_model("tiny", seed=0)[1], tmp_path / "tiny")
    tokenizer = frontend_tokenizer(folder)
    assert isinstance(tokenizer, HFTokenizer)
    byte = ByteTokenizer()
    texts = ["Hello, world!", " héllo 世界 🎉\n\t", "", "<eos> stays text"]
    assert [tokenizer.encode(t) for t in texts] == [byte.encode(t) for t in texts]
    ids = [0, 1, 2, *byte.encode("é🎉")[:-1], 72, 258]  # specials, a cut character, 0xff
    assert tokenizer.decode(ids) == byte.decode(ids)
    # Token by token, as the engine decodes stop-string text and the output processor streams:
    # the pieces join into the same text (each holds back a cut character its own way).
    from tokentape.engine.detokenizer import detokenizer

    folder_detok, byte_detok = detokenizer(tokenizer), detokenizer(byte)
    folder_text = "".join(folder_detok.add([t], False) for t in ids) + folder_detok.add([], True)
    byte_text = "".join(byte_detok.add([t], False) for t in ids) + byte_detok.add([], True)
    assert folder_text == byte_text == byte.decode(ids)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = "The capital of France is"
    [from_folder] = LLM(model=folder, tape=None).generate([prompt], params)
    [builtin] = LLM(model="tiny", tape=None).generate([prompt], params)
    assert from_folder.outputs[0].token_ids == builtin.outputs[0].token_ids
    assert from_folder.outputs[0].text == builtin.outputs[0].text
    # byte_tokenizer=False: no tokenizer.json (for a model with one of its own to copy)
    no_tokenizer = save_checkpoint(
        LLM("tiny", tape=None).engine.engine_core.runner.model, tmp_path / "x", byte_tokenizer=False
    )
    assert isinstance(frontend_tokenizer(no_tokenizer), MissingTokenizer)
