"""AsyncLLM serves vLLM's sampling options as LLM does: n > 1 fans out into children gathered
into one stream (each output kind), the stop string and the top-k logprobs cross the engine
core boundary, and cancelling or aborting a request of n > 1 aborts every child on the tape."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokentape import LLM, SamplingParams
from tokentape.engine.async_llm import AsyncLLM
from tokentape.events import schema as ev
from tokentape.events.schema import RequestOutputKind as Kind

PROMPT = [5, 6, 7]
ARGS: dict[str, Any] = {"model": "tiny", "device": "cpu", "tape": None}


def completions(outs: list[Any], kind: Kind) -> list[tuple[Any, ...]]:
    """The last completion of each index (CUMULATIVE, FINAL_ONLY), or the deltas joined (DELTA:
    tokens only, a delta's text may cut a UTF-8 character)."""
    last: dict[int, Any] = {}
    tokens: dict[int, list[int]] = {}
    for o in outs:
        for c in o.outputs:
            last[c.index] = c
            tokens.setdefault(c.index, []).extend(c.token_ids)
    if kind == Kind.DELTA:
        return [(i, tokens[i], last[i].finish_reason, last[i].stop_reason) for i in sorted(last)]
    return [
        (i, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.logprobs, c.top_logprobs)
        for i, c in sorted(last.items())
    ]


@pytest.mark.parametrize("multiprocess", [False, True])
@pytest.mark.parametrize("kind", list(Kind))
def test_n_above_one_stop_strings_and_top_logprobs_equal_llm(
    kind: Kind, multiprocess: bool
) -> None:
    params = SamplingParams(
        max_tokens=12,
        temperature=1.0,
        seed=3,
        n=3,
        logprobs=2,
        min_tokens=2,
        stop=["\x08", "?"],
        include_stop_str_in_output=multiprocess,
        output_kind=kind,
    )
    llm = LLM(**ARGS)
    ref = llm.generate([PROMPT], params, use_tqdm=False)[0]
    expected = [
        (
            c.index,
            c.text,
            list(c.token_ids),
            c.finish_reason,
            c.stop_reason,
            c.logprobs,
            c.top_logprobs,
        )
        for c in ref.outputs
    ]
    llm.close()
    assert {c.stop_reason for c in ref.outputs} == {
        "\x08",
        "?",
        None,
    }  # the seeds were picked for this

    async def main() -> list[Any]:
        with AsyncLLM(multiprocess_mode=multiprocess, **ARGS) as engine:
            return [o async for o in engine.generate(PROMPT, params, "r")]

    outs = asyncio.run(main())
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert all(o.request_id == "r" for o in outs)
    if kind == Kind.FINAL_ONLY:
        assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1, 2]
    if kind == Kind.DELTA:
        expected = [(i, toks, reason, stop) for i, _, toks, reason, stop, _, _ in expected]
    assert completions(outs, kind) == expected


@pytest.mark.parametrize("how", ["cancel", "abort"])
def test_cancel_or_abort_of_n_above_one_aborts_every_child(how: str) -> None:
    params = SamplingParams(max_tokens=400, n=3, seed=1, ignore_eos=True)

    async def main() -> tuple[list[Any], Any]:
        engine = AsyncLLM(model="oracle", tape=None, multiprocess_mode=False)
        gen = engine.generate(PROMPT, params, "r")
        got = [await gen.__anext__()]
        if how == "cancel":
            await gen.aclose()
        else:
            await engine.abort("r")
            got += [o async for o in gen]
        assert engine.num_unfinished_requests == 0
        core = engine.engine_core.core  # type: ignore[attr-defined]
        for _ in range(200):  # the core loop takes the abort at its next turn
            if not core.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        events = [e for _, e in core.engine.tape.iter_events()]
        engine.shutdown()
        return got, events

    got, events = asyncio.run(main())
    aborted = sorted(e.req_id for e in events if isinstance(e, ev.RequestAborted))
    assert aborted == ["0_r", "1_r", "2_r"]
    if how == "abort":
        assert got[-1].finished
        reasons = {c.index: c.finish_reason for o in got for c in o.outputs}
        assert reasons == {0: "abort", 1: "abort", 2: "abort"}


def test_a_refused_n_above_one_records_nothing() -> None:
    async def main() -> None:
        with AsyncLLM(model="oracle", tape=None, multiprocess_mode=False) as engine:
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=2), "1_r"):
                pass
            core = engine.engine_core.core  # type: ignore[attr-defined]
            before = len(core.engine.tape)
            with pytest.raises(ValueError, match="child id '1_r'"):
                async for _ in engine.generate(PROMPT, SamplingParams(n=2), "r"):
                    pass
            assert len(core.engine.tape) == before
            with pytest.raises(ValueError, match="cannot honour min_tokens"):
                async for _ in engine.generate(PROMPT, SamplingParams(n=2, min_tokens=1), "s"):
                    pass
            assert len(core.engine.tape) == before and engine.num_unfinished_requests == 0

    asyncio.run(main())
