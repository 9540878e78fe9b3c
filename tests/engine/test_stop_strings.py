"""find_stop_string over a window of the output (the tokenizer's safe_split) gives the full
decode's answer after every frame: random token streams with multi-byte UTF-8 characters split
across frames, invalid bytes and special tokens, for the byte tokenizer and HF tokenizers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tokentape.engine.stop_strings import find_stop_string, stop_text
from tokentape.engine.tokenizer import ByteTokenizer, HFTokenizer
from tokentape.events.schema import SamplingParams

TEXT = "ab c\u00e9\u00fc \u20ac\u4e2d\u6587 \U0001f600x.y, the end \u00df\u2028"


def _byte_stream(rng: random.Random, n: int) -> list[int]:
    tok = ByteTokenizer()
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.05:
            out.append(rng.randrange(3))  # a special token (no bytes), even inside a character
        elif r < 0.1:
            out.append(3 + rng.randrange(256))  # any byte: invalid sequences too
        else:
            out += tok.encode(rng.choice(TEXT))
    return out[:n]


def _stops(rng: random.Random, text: str) -> list[str]:
    stops = []
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(max(1, len(text) - 1))
        stops.append(text[i : i + rng.randint(1, 6)] or "x")
    return stops


def _check_frames(tok: ByteTokenizer | HFTokenizer, output: list[int], rng: random.Random) -> int:
    """Feed `output` frame by frame; both ways must agree after every frame. Returns the
    number of frames where a stop string was found."""
    params = SamplingParams(
        stop=tuple(_stops(rng, tok.decode(output))),
        min_tokens=rng.choice([0, 0, 3, 17]),
        max_tokens=len(output) + 1,
    )
    found = 0
    before = 0
    while before < len(output):
        now = min(len(output), before + rng.randint(1, 4))
        full = find_stop_string(tok.decode, params, output[:now], before)
        windowed = find_stop_string(tok.decode, params, output[:now], before, split=tok.safe_split)
        assert windowed == full, (params, output[:now], before)
        found += full is not None
        before = now
    return found


@pytest.mark.parametrize("seed", range(40))
def test_byte_tokenizer_windowed_equals_full(seed: int) -> None:
    rng = random.Random(seed)
    tok = ByteTokenizer()
    out = _byte_stream(rng, rng.choice([20, 200, 600]))
    _check_frames(tok, out, rng)


def test_byte_tokenizer_finds_matches() -> None:
    """The streams do hold matches, split characters among them (the test can fail)."""
    rng = random.Random(0)
    tok = ByteTokenizer()
    total = sum(_check_frames(tok, _byte_stream(rng, 300), rng) for _ in range(30))
    assert total > 30
    euro = tok.encode("\u20ac")
    out = tok.encode("abc") + euro[:1] + [0] + euro[1:]  # a special token inside the character
    params = SamplingParams(stop=("c\u20ac",), max_tokens=10)
    got = [
        find_stop_string(tok.decode, params, out, before, split=tok.safe_split)
        for before in range(len(out))
    ]
    assert got == [find_stop_string(tok.decode, params, out, before) for before in range(len(out))]
    assert got[:4] == ["c\u20ac"] * 4


def test_a_character_completed_by_the_frame_can_complete_a_stop_string() -> None:
    """'abc' and the first byte of the euro sign, then a frame with its other bytes: the text
    before the frame ended in a replacement character, which the frame turned into the
    euro sign, so "c\u20ac" ends in the frame's new text."""
    tok = ByteTokenizer()
    euro = tok.encode("\u20ac")
    out = tok.encode("abc") + euro
    params = SamplingParams(stop=("c\u20ac",), max_tokens=10)
    assert find_stop_string(tok.decode, params, out, 4) == "c\u20ac"
    assert find_stop_string(tok.decode, params, out, 4, split=tok.safe_split) == "c\u20ac"
    assert stop_text(tok.decode, params, out, "c\u20ac") == "ab"


def _safe_split_is_additive(tok: ByteTokenizer | HFTokenizer, out: list[int]) -> None:
    for pos in range(len(out) + 1):
        k = tok.safe_split(out, pos)
        assert 0 <= k <= pos
        for j in range(k, len(out) + 1):
            assert tok.decode(out[:j]) == tok.decode(out[:k]) + tok.decode(out[k:j])


def test_byte_safe_split_is_additive() -> None:
    rng = random.Random(1)
    for _ in range(20):
        _safe_split_is_additive(ByteTokenizer(), _byte_stream(rng, 40))


@pytest.fixture(scope="module")
def byte_level_bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
    )
    tok.train_from_iterator([TEXT * 3, "the end of the text, the end."] * 20, trainer)
    tok.add_tokens([AddedToken("<tool>", special=False)])
    path = Path(tmp_path_factory.mktemp("bpe")) / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(str(path))


@pytest.mark.parametrize("seed", range(20))
def test_hf_byte_level_windowed_equals_full(byte_level_bpe: HFTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    tok = byte_level_bpe
    out = [
        rng.randrange(tok.vocab_size + 1) for _ in range(rng.choice([20, 200]))
    ]  # every id, added ones too
    _check_frames(tok, out, rng)
    _safe_split_is_additive(tok, out[:30])
    assert any(tok.safe_split(out, p) > 0 for p in range(len(out)))  # the window is used


def test_hf_other_decoder_decodes_everything(tmp_path: Path) -> None:
    """A decoder not known to be additive (here none: tokens joined by spaces) gets split 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path / "tokenizer.json"))
    out = [0, 1, 0, 0, 1, 1, 0]
    assert all(hf.safe_split(out, p) == 0 for p in range(len(out) + 1))
    params = SamplingParams(stop=("b a",), max_tokens=10)
    assert (
        find_stop_string(hf.decode, params, out, 5, split=hf.safe_split)
        == find_stop_string(hf.decode, params, out, 5)
        == "b a"
    )


def test_stop_text_cuts_at_the_match_after_min_tokens() -> None:
    tok = ByteTokenizer()
    out = tok.encode("hello STOP world")
    for include in (False, True):
        params = SamplingParams(stop=("STOP",), include_stop_str_in_output=include, max_tokens=20)
        assert stop_text(tok.decode, params, out, "STOP") == ("hello STOP" if include else "hello ")
    out = tok.encode("a STOP b STOP c")
    params = SamplingParams(stop=("STOP",), min_tokens=7, max_tokens=20)  # a match ends later
    assert stop_text(tok.decode, params, out, "STOP") == "a STOP b "
