"""RequestOutputKind: in SamplingParams (recorded on the tape), and how it shapes outputs."""

from __future__ import annotations

import msgspec
import pytest

from tokentape import RequestOutputKind, SamplingParams
from tokentape.engine.output_processor import OutputProcessor
from tokentape.engine.outputs import EngineCoreOutput, RequestOutput
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.events import schema as ev


def test_output_kind_is_last_defaults_to_cumulative_and_round_trips() -> None:
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    # output_kind came after the first eight fields; the sampling options of format 2 follow it.
    assert list(SamplingParams.__struct_fields__).index("output_kind") == 8
    p = SamplingParams(max_tokens=3, output_kind=1)  # an int is taken and normalised
    assert p.output_kind is RequestOutputKind.DELTA
    event = ev.RequestAdded(0, "a", [5], p)
    assert ev.decode(ev.encode(event)) == event


def test_a_tape_written_before_output_kind_still_decodes() -> None:
    old = msgspec.msgpack.encode(
        ["RequestAdded", 0, "a", [5], [16, 1.0, 1.0, 0, None, [], False, None]]
    )
    assert ev.decode(old).params == SamplingParams()


@pytest.mark.parametrize(
    ("bad", "error"), [(True, TypeError), ("delta", TypeError), (3, ValueError), (-1, ValueError)]
)
def test_a_bad_output_kind_is_refused(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="output_kind"):
        SamplingParams(output_kind=bad)  # type: ignore[arg-type]


def test_the_output_processor_shapes_outputs_by_kind() -> None:
    lps = [-0.1, -0.2, -0.3]

    def outputs(kind: RequestOutputKind) -> list[RequestOutput]:
        proc = OutputProcessor(ByteTokenizer())
        proc.add_request("r", [1], None, SamplingParams(logprobs=0, output_kind=kind), ["r"])
        first = proc.process_outputs([EngineCoreOutput("r", [7 + 3], lps[:1])])
        return first + proc.process_outputs(
            [EngineCoreOutput("r", [8 + 3, 9 + 3], lps[1:], "length")]
        )

    cum = outputs(RequestOutputKind.CUMULATIVE)
    assert [o.outputs[0].token_ids for o in cum] == [[10], [10, 11, 12]]
    assert cum[1].outputs[0].logprobs == lps and cum[1].outputs[0].text == "\x07\x08\t"
    assert [o.finished for o in cum] == [False, True]
    delta = outputs(RequestOutputKind.DELTA)
    assert [o.outputs[0].token_ids for o in delta] == [[10], [11, 12]]
    assert delta[1].outputs[0].logprobs == lps[1:] and delta[1].outputs[0].text == "\x08\t"
    (final,) = outputs(RequestOutputKind.FINAL_ONLY)
    assert final.finished and final.outputs[0].token_ids == [10, 11, 12]
    assert final.outputs[0].finish_reason == "length" and final.outputs[0].text == "\x07\x08\t"


def test_an_output_keeps_its_own_tokens_after_the_stream_grows() -> None:
    """Outputs are spans of the engine's append-only output lists, copied when read: one read
    after later steps still holds the tokens it was made with, and costs nothing until read."""
    from tokentape import LLM

    llm = LLM(model="oracle", tape=None)
    engine = llm.llm_engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    kept = []
    while engine.has_unfinished_requests():
        kept += engine.step()
    lengths = [len(out.outputs[0].token_ids) for out in kept]
    assert lengths == sorted(lengths) and lengths[-1] == 6 and len(set(lengths)) == len(lengths)
    final = kept[-1].outputs[0].token_ids
    assert all(out.outputs[0].token_ids == final[: len(out.outputs[0].token_ids)] for out in kept)
    assert (
        engine.engine_core.state.requests["a"].output_token_ids is not final
    )  # a copy, not the state
