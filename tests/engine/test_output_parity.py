"""One output pipeline: the same prompt and sampling params give the same tokens, text,
logprobs, finish and stop reasons through `LLM`, `AsyncLLM` (DELTA across the process
boundary, CUMULATIVE in process) and `tokentape serve` (the completions API over HTTP,
streamed and not), all of them through the one output processor.

The params mix every option that shapes the output: n=3, logprobs=2, min_tokens, the three
penalties, and stop strings picked from a run without them: one that ends in a three-byte
character (so it spans four byte tokens, and the streamed text must hold a cut character and
the string's beginning back), one of two ASCII characters; with and without
include_stop_str_in_output. The text of each completion is also checked against its own
tokens, decoded and cut at its stop string by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import msgspec
import openai
import pytest
from serve_process import tiny_openai_client

from tokentape import LLM, AsyncLLM, SamplingParams
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.events.schema import RequestOutputKind as Kind

TOK = ByteTokenizer()
PROMPT = [5, 6, 7, 8]
BASE = SamplingParams(
    max_tokens=40,
    temperature=1.0,
    seed=0,
    n=3,
    logprobs=2,
    min_tokens=3,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.1,
)
# (index, token ids, text, logprobs, top logprobs, finish reason, stop reason)
Completion = tuple[int, list[int], str, list[float], list[dict[int, float]], str, str | None]


def pick_stops(texts: list[str]) -> tuple[str, str]:
    """A stop string ending in a multi-byte character of the first text (after min_tokens),
    and two printable ASCII characters of the second."""
    first = texts[0]
    j = next(
        j
        for j in range(5, len(first))
        if ord(first[j]) > 127 and first[j] != "\ufffd" and 32 <= ord(first[j - 1]) < 127
    )
    second = texts[1]
    k = next(
        k for k in range(5, len(second)) if all(32 <= ord(ch) < 127 for ch in second[k : k + 2])
    )
    return first[j - 1 : j + 1], second[k : k + 2]


def record(c: Any) -> Completion:
    return (
        c.index,
        list(c.token_ids),
        c.text,
        list(c.logprobs),
        list(c.top_logprobs),
        c.finish_reason,
        c.stop_reason,
    )


@pytest.fixture(scope="module")
def params() -> dict[bool, SamplingParams]:
    with LLM("tiny", tape=None, seed=0) as llm:
        out = llm.generate([PROMPT], BASE, use_tqdm=False)[0]
    stops = pick_stops([c.text for c in out.outputs])
    return {
        include: msgspec.structs.replace(BASE, stop=stops, include_stop_str_in_output=include)
        for include in (False, True)
    }


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with tiny_openai_client(str(tmp_path_factory.mktemp("serve") / "serve.tape")) as client:
        yield client


def through_llm(params: SamplingParams) -> list[Completion]:
    with LLM("tiny", tape=None, seed=0) as llm:
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    return [record(c) for c in out.outputs]


def through_async_llm(params: SamplingParams, kind: Kind, multiprocess: bool) -> list[Completion]:
    params = msgspec.structs.replace(params, output_kind=kind)

    async def main() -> list[Any]:
        with AsyncLLM("tiny", tape=None, seed=0, multiprocess_mode=multiprocess) as engine:
            return [o async for o in engine.generate(PROMPT, params, "r")]

    outs = asyncio.run(main())
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    if kind == Kind.CUMULATIVE:  # the last completion of each index holds everything
        last = {c.index: c for o in outs for c in o.outputs}
        return [record(last[i]) for i in sorted(last)]
    joined: dict[int, list[Any]] = {}
    for o in outs:
        for c in o.outputs:
            j = joined.setdefault(c.index, [c.index, [], "", [], [], None, None])
            j[1] += c.token_ids
            j[2] += c.text
            j[3] += c.logprobs
            j[4] += c.top_logprobs
            j[5], j[6] = c.finish_reason, c.stop_reason
    return [tuple(joined[i]) for i in sorted(joined)]  # type: ignore[misc]


def request_body(params: SamplingParams) -> dict[str, Any]:
    return dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        seed=params.seed,
        n=params.n,
        logprobs=params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=list(params.stop),
        extra_body={
            "repetition_penalty": params.repetition_penalty,
            "min_tokens": params.min_tokens,
            "include_stop_str_in_output": params.include_stop_str_in_output,
            "return_token_ids": True,
        },
    )


def through_serve(client: openai.OpenAI, params: SamplingParams, stream: bool) -> list[Completion]:
    """The completions API's choices; top logprobs come keyed by text, so they are compared
    as the server keys them (the reference's keyed the same way, in the test)."""
    joined: dict[int, list[Any]] = {}
    if stream:
        chunks = list(client.completions.create(stream=True, **request_body(params)))
        choices = [c for chunk in chunks for c in chunk.choices]
    else:
        choices = client.completions.create(**request_body(params)).choices
    for c in choices:
        j = joined.setdefault(c.index, [c.index, [], "", [], [], None, None])
        j[1] += c.token_ids  # type: ignore[attr-defined]
        j[2] += c.text
        j[3] += c.logprobs.token_logprobs  # type: ignore[union-attr]
        j[4] += c.logprobs.top_logprobs  # type: ignore[union-attr]
        if c.finish_reason is not None:
            j[5], j[6] = c.finish_reason, getattr(c, "stop_reason", None)
    return [tuple(joined[i]) for i in sorted(joined)]  # type: ignore[misc]


def by_text(completions: list[Completion]) -> list[Completion]:
    """Top logprobs keyed by each token's text, as the completions API gives them."""
    return [
        (*c[:4], [{TOK.decode([t]): lp for t, lp in pos.items()} for pos in c[4]], *c[5:])  # type: ignore[misc]
        for c in completions
    ]


def check_text_by_hand(params: SamplingParams, completions: list[Completion]) -> None:
    """Each text is its tokens' text, cut at its stop string (the first match ending past the
    min_tokens text; kept with include_stop_str_in_output)."""
    for _, tokens, text, lps, top, finish, stop in completions:
        assert len(lps) == len(top) == len(tokens) >= params.min_tokens
        full = TOK.decode(tokens)
        if stop is None:
            assert text == full
            continue
        assert finish == "stop" and stop in params.stop
        at = full.index(stop, max(0, len(TOK.decode(tokens[: params.min_tokens])) - len(stop) + 1))
        assert text == full[: at + len(stop)] if params.include_stop_str_in_output else full[:at]


@pytest.mark.parametrize("include", [False, True])
def test_llm_async_llm_and_serve_give_the_same_outputs(
    params: dict[bool, SamplingParams], client: openai.OpenAI, include: bool
) -> None:
    p = params[include]
    ref = through_llm(p)
    assert {c[6] for c in ref} >= set(p.stop)  # both stop strings were hit
    assert any(ord(ch) > 127 for ch in p.stop[0])
    check_text_by_hand(p, ref)
    assert through_async_llm(p, Kind.DELTA, multiprocess=True) == ref
    assert through_async_llm(p, Kind.CUMULATIVE, multiprocess=False) == ref
    for stream in (False, True):
        assert through_serve(client, p, stream) == by_text(ref)
