"""The output processor alone, on hand-made core deltas (byte tokenizer: token = byte + 3):
the text of a request with stop strings as the engine core sends it (held back, cut at the
match), a multi-byte character held until complete, n > 1 fan-in, stream_interval and its
flush."""

from __future__ import annotations

from tokentape.engine.output_processor import OutputProcessor
from tokentape.engine.outputs import EngineCoreOutput as Out
from tokentape.engine.stop_strings import StopStringChecker
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.events.schema import RequestOutputKind as Kind
from tokentape.events.schema import SamplingParams
from tokentape.events.state import RequestState

TOK = ByteTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def core_deltas(
    params: SamplingParams, frames: list[list[int]], logprobs: list[list[float]] | None = None
) -> list[Out]:
    """The deltas of a request with stop strings as the engine core makes them: its
    stop-string checker looks for a match after each frame and sends the text; the last
    frame finishes the request ("stop" at a match, else "length")."""
    checker, req = StopStringChecker(TOK), RequestState("r", [5], params, 0)
    outs = []
    for i, frame in enumerate(frames):
        req.output_token_ids = req.output_token_ids + frame
        found = checker.find(req, len(req.output_token_ids))
        last = i == len(frames) - 1
        if last and found is None:
            checker.finish(req)
        reason = "stop" if found is not None else "length" if last else None
        lps = logprobs[i] if logprobs is not None else None
        outs.append(Out("r", frame, lps, reason, None, found, new_text=checker.take_text("r")))
    return outs


def test_holdback_and_cut_at_a_stop_string_by_kind() -> None:
    frames = [ids("ab"), ids("cS"), ids("TO"), ids("Pz")]
    for kind in (Kind.DELTA, Kind.CUMULATIVE):
        proc = OutputProcessor(TOK)
        params = SamplingParams(output_kind=kind, stop=("STOP",), max_tokens=20)
        proc.add_request("r", [5], None, params, ["r"])
        texts = []
        for out in core_deltas(params, frames):
            (o,) = proc.process_outputs([out])
            texts.append(o.outputs[0].text)
        # Three characters (len("STOP") - 1) held back while it runs; cut before the match.
        if kind == Kind.DELTA:
            assert texts == ["", "a", "bc", ""]
        else:
            assert texts == ["", "a", "abc", "abc"]
        assert o.finished and o.outputs[0].stop_reason == "STOP"
        assert not proc.has_request("r")


def test_include_stop_str_holds_nothing_back() -> None:
    proc = OutputProcessor(TOK)
    params = SamplingParams(stop=("STOP",), include_stop_str_in_output=True, output_kind=Kind.DELTA)
    proc.add_request("r", [5], None, params, ["r"])
    first, last = core_deltas(params, [ids("abS"), ids("TOPx")])
    assert last.finish_reason == "stop" and last.stop_reason == "STOP"
    (a,) = proc.process_outputs([first])
    (b,) = proc.process_outputs([last])
    assert (a.outputs[0].text, b.outputs[0].text) == ("abS", "TOP")


def test_a_multibyte_character_waits_for_its_last_byte() -> None:
    proc = OutputProcessor(TOK)
    proc.add_request("r", [5], None, SamplingParams(output_kind=Kind.DELTA), ["r"])
    euro = ids("\u20ac")  # three bytes, three tokens
    texts = [
        proc.process_outputs([Out("r", euro[:1])])[0].outputs[0].text,
        proc.process_outputs([Out("r", euro[1:])])[0].outputs[0].text,
        proc.process_outputs([Out("r", ids("!"), None, "length")])[0].outputs[0].text,
    ]
    assert texts == ["", "\u20ac", "!"]


def test_n_children_are_gathered_into_their_parent() -> None:
    children = ["0_p", "1_p"]
    final = OutputProcessor(TOK)
    final.add_request("p", [5], "hi", SamplingParams(n=2, output_kind=Kind.FINAL_ONLY), children)
    assert final.process_outputs([Out("0_p", ids("a"), None, "length")]) == []
    (out,) = final.process_outputs([Out("1_p", ids("b")), Out("1_p", ids("c"), None, "length")])
    assert out.finished and out.prompt == "hi"
    assert [(c.index, c.text) for c in out.outputs] == [(0, "a"), (1, "bc")]
    delta = OutputProcessor(TOK)
    delta.add_request("p", [5], None, SamplingParams(n=2, output_kind=Kind.DELTA), children)
    (both,) = delta.process_outputs([Out("1_p", ids("x")), Out("0_p", ids("y"))])
    assert [(c.index, c.text) for c in both.outputs] == [(0, "y"), (1, "x")]
    assert not both.finished


def test_stream_interval_gathers_tokens_and_flush_releases_them() -> None:
    proc = OutputProcessor(TOK, stream_interval=3)
    proc.add_request("r", [5], None, SamplingParams(output_kind=Kind.DELTA), ["r"])
    got = [proc.process_outputs([Out("r", ids(ch))]) for ch in "abcd"]
    # The first token at once, then held until three have gathered.
    assert [[o.outputs[0].text for o in g] for g in got] == [["a"], [], [], ["bcd"]]
    assert proc.process_outputs([Out("r", ids("e"))]) == []
    (flushed,) = proc.flush()
    assert flushed.outputs[0].token_ids == ids("e") and proc.flush() == []


def test_outputs_pickle_as_their_values_and_the_collector_does_not_track_them() -> None:
    """An RL loop ships outputs between processes (Ray pickles them): a CUMULATIVE output
    whose tokens and text are still a span of the processor's lists, and a FINAL_ONLY one
    whose text comes from a function, pickle as what they say. Neither is tracked: the step's
    outputs, kept by the caller until the next, would otherwise set off full collections."""
    import gc
    import pickle

    for kind in (Kind.CUMULATIVE, Kind.FINAL_ONLY, Kind.DELTA):
        proc = OutputProcessor(TOK)
        params = SamplingParams(output_kind=kind, stop=("Z",), logprobs=0)
        proc.add_request("r", [5], None, params, ["r"])
        first, last = core_deltas(params, [ids("ab"), ids("cZ")], [[-0.5, -0.25], [-1.0, -2.0]])
        proc.process_outputs([first])
        (o,) = proc.process_outputs([last])
        (c,) = o.outputs
        assert not gc.is_tracked(o) and not gc.is_tracked(c)
        back = pickle.loads(pickle.dumps(o))
        assert back == o and back.outputs[0] == c
        assert (back.outputs[0].text, back.outputs[0].token_ids) == (c.text, c.token_ids)
        assert back.outputs[0].logprobs == c.logprobs and c.text.endswith("c")
