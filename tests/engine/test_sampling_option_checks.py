"""The sampling options of tape format 2 are refused with a clear error before anything is
recorded, round-trip through the tape, and a version-1 event still decodes."""

from __future__ import annotations

import msgspec
import pytest

from tokentape import LLM, SamplingParams
from tokentape.events import schema as ev


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        (dict(n=0), ValueError),
        (dict(n=True), TypeError),
        (dict(presence_penalty=2.5), ValueError),
        (dict(frequency_penalty="1"), TypeError),
        (dict(repetition_penalty=0.0), ValueError),
        (dict(repetition_penalty=float("nan")), ValueError),
        (dict(min_tokens=-1), ValueError),
        (dict(min_tokens=20, max_tokens=5), ValueError),
        (dict(stop=[""]), ValueError),
        (dict(stop=[3]), TypeError),
        (dict(stop=["\ud800"]), ValueError),
        (dict(include_stop_str_in_output=1), TypeError),
        (dict(bad_words=[[]]), ValueError),
        (dict(bad_words=[[-1]]), ValueError),
        (dict(bad_words=[" "]), ValueError),
        (dict(bad_words=[3]), TypeError),
        (dict(bad_words=[[1.5]]), TypeError),
    ],
)
def test_bad_options_are_refused(kw: dict[str, object], error: type[Exception]) -> None:
    name = next(iter(k for k in kw if k != "max_tokens"))
    with pytest.raises(error, match=name):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_options_round_trip_and_version_1_events_decode() -> None:
    p = SamplingParams(n=2, presence_penalty=1, stop="x", bad_words=[[4, 5]], min_tokens=1)
    assert p.stop == ("x",) and p.bad_words == ((4, 5),) and p.presence_penalty == 1.0
    event = ev.RequestAdded(0, "a", [5], p)
    assert ev.decode(ev.encode(event)) == event
    old = msgspec.msgpack.encode(["RequestFinished", 3, "a", "stop"])
    assert ev.decode(old) == ev.RequestFinished(3, "a", "stop", None)
    old_frame = msgspec.msgpack.encode(["FrameProduced", 3, [["a", [7], [], [-0.5]]]])
    assert ev.decode(old_frame).entries[0].top_token_ids is None


def test_engine_refusals_record_nothing() -> None:
    llm = LLM("oracle", tape=None)
    before = len(llm.llm_engine.engine_core.tape)
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate([[5, 6]], SamplingParams(bad_words=[[10**6]]), use_tqdm=False)
    llm.generate([[5, 6]], SamplingParams(max_tokens=2, n=2), use_tqdm=False)  # "0" -> 0_0, 1_0
    with pytest.raises(ValueError, match="already in use"):
        llm.llm_engine.add_request("0_0", [5], SamplingParams())
    assert len(llm.llm_engine.engine_core.tape) > before
    n = len(llm.llm_engine.engine_core.tape)
    with pytest.raises(ValueError, match="child id"):
        llm.llm_engine.add_request("0", [5], SamplingParams(n=2))
    assert len(llm.llm_engine.engine_core.tape) == n


def test_string_bad_words_are_recorded_as_token_ids() -> None:
    """vLLM's encoding: the word without its leading space, and with one only where that
    gives as many tokens (never, with the byte tokenizer)."""
    from tokentape.engine.bad_words import encode_bad_word
    from tokentape.engine.tokenizer import ByteTokenizer

    enc = ByteTokenizer().encode
    assert encode_bad_word(" ab", enc) == [tuple(enc("ab"))]
    words = {
        "hi": [1, 2],
        " hi": [3, 4],
        "x": [5],
    }  # a word-level tokenizer: " hi" is a new token pair
    assert encode_bad_word("hi", lambda t: words[t]) == [(1, 2), (3, 4)]
    llm = LLM("tiny", tape=None, device="cpu")
    llm.generate(
        [[5, 6]], SamplingParams(max_tokens=2, bad_words=["ab", [7], " ab"]), use_tqdm=False
    )
    added = [
        e
        for _, e in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(e, ev.RequestAdded)
    ]
    assert added[0].params.bad_words == (tuple(enc("ab")), (7,))
    llm.close()


@pytest.mark.parametrize(
    "kw",
    [
        dict(presence_penalty=0.5),
        dict(frequency_penalty=-1.0),
        dict(repetition_penalty=1.1),
        dict(min_tokens=2),
        dict(bad_words=[[7]]),
    ],
)
def test_the_oracle_refuses_options_it_cannot_honour(kw: dict[str, object]) -> None:
    llm = LLM("oracle", tape=None)
    before = len(llm.llm_engine.engine_core.tape)
    with pytest.raises(ValueError, match=f"oracle runner .*cannot honour {next(iter(kw))}"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=4, **kw), use_tqdm=False)  # type: ignore[arg-type]
    assert len(llm.llm_engine.engine_core.tape) == before
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=4), use_tqdm=False)[
        0
    ].finished  # serves on
    llm.close()


def test_whatif_with_the_oracle_refuses_a_penalised_tape() -> None:
    from tokentape.replay.whatif import WhatIfError, whatif

    llm = LLM("tiny", tape=None, device="cpu")
    llm.generate([[5, 6]], SamplingParams(max_tokens=3, presence_penalty=1.0), use_tqdm=False)
    with pytest.raises(WhatIfError, match="cannot honour presence_penalty.*--runner model"):
        whatif(llm.llm_engine.engine_core.tape, runner="oracle")
    llm.close()
