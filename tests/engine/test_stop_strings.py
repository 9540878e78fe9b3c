"""The engine's stop-string checker, which decodes each token once (incrementally), gives the
answer of a full decode of the output after every frame, and releases the text a client may
see: random token streams with multi-byte UTF-8 characters split across frames, invalid
bytes and special tokens, for the byte tokenizer and HF tokenizers."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

from tokentape.engine.stop_strings import StopStringChecker
from tokentape.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tokentape.events.schema import SamplingParams
from tokentape.events.state import RequestState

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
    """Pieces of the text, with no replacement character: one that stands for a character
    cut between frames is not text yet (the detokenizer holds those bytes back, as vLLM's)."""
    stops = []
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(max(1, len(text) - 1))
        stops.append(text[i : i + rng.randint(1, 6)].replace("\ufffd", "") or "x")
    return stops


# -- the reference: a full decode of the output after every frame ---------------------------


def _stable_len(before: str, after: str) -> int:
    """How much of the text before the frame the frame left as it was (a replacement
    character the frame completed into a character is not)."""
    return len(os.path.commonprefix([before, after]))


def _first_match(text: str, start: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    best, best_end = None, sys.maxsize
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and i + len(stop) < best_end:
            best, best_end = (stop, i), i + len(stop)
    return best


def _reference(tok: Tokenizer, params: SamplingParams, output: list[int], before: int, now: int):
    """The stop string the tokens before..now complete in the full decode, with the text
    cut at it (None, None without a match)."""
    if now <= params.min_tokens:
        return None, None
    checked = max(before, params.min_tokens)
    text = tok.decode(output[:now])
    found = _first_match(text, _stable_len(tok.decode(output[:checked]), text), params.stop)
    if found is None:
        return None, None
    stop, i = found
    return stop, text[: i + len(stop)] if params.include_stop_str_in_output else text[:i]


def _request(params: SamplingParams) -> RequestState:
    return RequestState("r", [1], params, 0)


def _check_frames(tok: Tokenizer, output: list[int], rng: random.Random) -> int:
    """Feed `output` frame by frame: the checker must find what the full decode finds, and
    release a prefix of the final text, cut as the full decode cuts it. Returns 1 when a
    stop string was found.

    It finds it in the same frame, unless the frame's text ends in a character cut between
    tokens: a tokenizer.json's incremental text then waits for the next tokens (vLLM's
    detokenizer does), so the match comes with a later frame. The byte tokenizer's decoder
    holds back only the cut character: always the same frame."""
    params = SamplingParams(
        stop=tuple(_stops(rng, tok.decode(output))),
        min_tokens=rng.choice([0, 0, 3, 17]),
        include_stop_str_in_output=rng.random() < 0.3,
        max_tokens=len(output) + 1,
    )
    checker, req = StopStringChecker(tok), _request(params)
    released = []
    expected: tuple[str, str] | None = None  # what the full decode found, not yet the checker
    before = 0
    while before < len(output):
        now = min(len(output), before + rng.randint(1, 4))
        req.output_token_ids = output[:now]
        found = checker.find(req, now)
        released.append(checker.take_text("r"))
        if expected is None:
            want, cut = _reference(tok, params, output, before, now)
            if want is not None:
                expected = want, cut
        if found is not None:
            assert expected is not None and found == expected[0], (params, output[:now], before)
            assert "".join(released) == expected[1]
            assert not checker.has_streams()  # the stream went with its final text
            return 1
        assert expected is None or not isinstance(tok, ByteTokenizer), (params, output[:now])
        before = now
    checker.finish(req)
    released.append(checker.take_text("r"))
    if expected is None:
        assert "".join(released) == tok.decode(output)
    else:  # the match waited for tokens that never came: the text is all there is
        assert expected[1].startswith("".join(released)[: len(expected[1])])
    return 0


@pytest.mark.parametrize("seed", range(40))
def test_byte_tokenizer_matches_the_full_decode(seed: int) -> None:
    rng = random.Random(seed)
    tok = ByteTokenizer()
    out = _byte_stream(rng, rng.choice([20, 200, 600]))
    _check_frames(tok, out, rng)


def test_byte_tokenizer_finds_matches() -> None:
    """The streams do hold matches, split characters among them (the test can fail)."""
    rng = random.Random(0)
    tok = ByteTokenizer()
    total = sum(_check_frames(tok, _byte_stream(rng, 300), rng) for _ in range(30))
    assert total > 10
    euro = tok.encode("\u20ac")
    out = tok.encode("abc") + euro[:1] + [0] + euro[1:]  # a special token inside the character
    params = SamplingParams(stop=("c\u20ac",), max_tokens=10)
    for frame in range(1, len(out) + 1):  # frames of `frame` tokens: found at the last
        checker, req = StopStringChecker(tok), _request(params)
        found = None
        for end in range(frame, len(out) + frame, frame):
            req.output_token_ids = out[: min(end, len(out))]
            found = checker.find(req, len(req.output_token_ids)) or found
        assert found == "c\u20ac"
        assert checker.take_text("r") == "ab"


def test_a_character_completed_by_the_frame_can_complete_a_stop_string() -> None:
    """'abc' and the first byte of the euro sign, then a frame with its other bytes: the text
    before the frame held the cut character back, and the frame's text completes "c\u20ac"."""
    tok = ByteTokenizer()
    euro = tok.encode("\u20ac")
    out = tok.encode("abc") + euro
    params = SamplingParams(stop=("c\u20ac",), max_tokens=10)
    checker, req = StopStringChecker(tok), _request(params)
    req.output_token_ids = out[:4]
    assert checker.find(req, 4) is None
    assert checker.take_text("r") == "ab"  # "c" held back: "c\u20ac" may begin there
    req.output_token_ids = out
    assert checker.find(req, len(out)) == "c\u20ac"
    assert checker.take_text("r") == ""  # cut before the match: nothing more


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
def test_hf_byte_level_matches_the_full_decode(byte_level_bpe: HFTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    tok = byte_level_bpe
    out = [
        rng.randrange(tok.vocab_size + 1) for _ in range(rng.choice([20, 200]))
    ]  # every id, added ones too
    _check_frames(tok, out, rng)


def test_hf_decoder_joining_tokens_with_spaces(tmp_path: Path) -> None:
    """A tokenizer without a decoder joins tokens with spaces: the incremental text decodes
    each token after the one before it, so a stop string across that space is found."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path / "tokenizer.json"))
    out = [0, 1, 0, 0, 1, 1, 0]
    params = SamplingParams(stop=("b a",), max_tokens=10)
    checker, req = StopStringChecker(hf), _request(params)
    req.output_token_ids = out[:2]
    assert checker.find(req, 2) is None  # "a b"
    assert checker.take_text("r") == "a"  # two characters held back
    req.output_token_ids = out
    assert checker.find(req, 7) == "b a"  # "a b a a b b a": the first "b a" ends in " a"
    assert checker.take_text("r") == " "


def test_the_text_is_cut_at_the_match_after_min_tokens() -> None:
    tok = ByteTokenizer()
    out = tok.encode("hello STOP world")
    for include in (False, True):
        params = SamplingParams(stop=("STOP",), include_stop_str_in_output=include, max_tokens=20)
        checker, req = StopStringChecker(tok), _request(params)
        req.output_token_ids = out
        assert checker.find(req, len(out)) == "STOP"
        assert checker.take_text("r") == ("hello STOP" if include else "hello ")
    out = tok.encode("a STOP b STOP c")
    params = SamplingParams(stop=("STOP",), min_tokens=7, max_tokens=20)  # a match ends later
    checker, req = StopStringChecker(tok), _request(params)
    req.output_token_ids = out
    assert checker.find(req, len(out)) == "STOP"
    assert checker.take_text("r") == "a STOP b "


def test_a_finish_releases_the_held_back_text() -> None:
    """Without a match, the holdback goes out when the request finishes (length, a stop
    token, an abort), the end of a character cut between tokens as the full decode has it."""
    tok = ByteTokenizer()
    out = tok.encode("abcdef") + tok.encode("\u20ac")[:2]
    params = SamplingParams(stop=("xyz",), max_tokens=20)
    checker, req = StopStringChecker(tok), _request(params)
    req.output_token_ids = out
    assert checker.find(req, len(out)) is None
    assert checker.take_text("r") == "abcd"  # "ef" held back, the cut character not decoded
    checker.finish(req)
    assert checker.take_text("r") == "ef\ufffd" == tok.decode(out)[4:]
    assert not checker.has_streams() and checker.take_text("r") is None
