"""The OpenAI server's sampling options on the tiny model, against LLM.generate in-process:
n choices (each with its index, in streaming too), the text cut at a stop string (and
include_stop_str_in_output), stop_reason, logprobs in OpenAI's shapes (completions: tokens,
token_logprobs, top_logprobs, text_offset; chat: logprobs.content[...]), bad words as
strings."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from serve_process import tiny_openai_client

from tokentape import LLM, SamplingParams
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.entrypoints.chat_template import ChatTemplate

TOK = ByteTokenizer()
PROMPT = "The tape says"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with tiny_openai_client(str(tmp_path_factory.mktemp("serve") / "serve.tape")) as client:
        yield client


def pick_stops(outputs: list[Any]) -> list[str]:
    """Stop strings that the streams without stops hit: one ASCII character of the first
    stream, two of the second (so the streamed text must be held back)."""
    stops = []
    for c, size in zip(outputs, (1, 2)):
        toks = list(c.token_ids)
        at = next(
            j
            for j in range(3, len(toks) - size)
            if all(3 + 32 <= t < 3 + 127 for t in toks[j : j + size])
        )
        stops.append(TOK.decode(toks[at : at + size]))
    return stops


def reference(prompt: list[int], **kw: Any) -> list[Any]:
    llm = LLM("tiny", tape=None, seed=0)
    out = llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs
    llm.close()
    return out


@pytest.mark.parametrize("include", [False, True])
def test_completions_n_stop_strings_and_logprobs(client: openai.OpenAI, include: bool) -> None:
    kw: dict[str, Any] = dict(max_tokens=24, temperature=0.8, seed=11, n=3, logprobs=2)
    kw["stop"] = pick_stops(reference(TOK.encode(PROMPT), **kw))
    ref = reference(TOK.encode(PROMPT), include_stop_str_in_output=include, **kw)
    assert ref[0].stop_reason == kw["stop"][0] and ref[1].stop_reason is not None
    body = {"include_stop_str_in_output": include, "return_token_ids": True}
    out = client.completions.create(model="tiny", prompt=PROMPT, extra_body=body, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c, r in zip(out.choices, ref):
        assert c.text == r.text and c.finish_reason == r.finish_reason
        assert getattr(c, "stop_reason", None) == r.stop_reason  # omitted when None
        assert c.token_ids == list(r.token_ids)  # type: ignore[attr-defined]
        lp = c.logprobs
        assert lp is not None and lp.tokens == [TOK.decode([t]) for t in r.token_ids]
        assert lp.token_logprobs == pytest.approx(r.logprobs, abs=1e-5)
        # vLLM's: the running length of the tokens' own texts.
        assert lp.text_offset == [sum(len(x) for x in lp.tokens[:j]) for j in range(len(lp.tokens))]
        assert lp.top_logprobs == [
            {TOK.decode([t]): pytest.approx(v, abs=1e-5) for t, v in d.items()}
            for d in r.top_logprobs
        ]
    assert out.usage is not None and out.usage.completion_tokens == sum(
        len(r.token_ids) for r in ref
    )
    # Streamed: every choice's chunks carry its index and join into the same text.
    chunks = list(
        client.completions.create(model="tiny", prompt=PROMPT, stream=True, extra_body=body, **kw)
    )
    texts: dict[int, str] = {}
    finals: dict[int, tuple[Any, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finals[c.index] = (c.finish_reason, getattr(c, "stop_reason", None))
    assert texts == {i: r.text for i, r in enumerate(ref)}
    assert finals == {i: (r.finish_reason, r.stop_reason) for i, r in enumerate(ref)}


def test_chat_n_and_top_logprobs(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt = TOK.encode(ChatTemplate.for_model("tiny").render(messages))
    kw: dict[str, Any] = dict(max_tokens=24, temperature=0.8, seed=4, n=2)
    kw["stop"] = pick_stops(reference(prompt, **kw))
    ref = reference(prompt, logprobs=3, **kw)
    assert ref[0].stop_reason == kw["stop"][0]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
        **kw,
    )
    assert [c.index for c in out.choices] == [0, 1]
    for c, r in zip(out.choices, ref):
        assert c.message.content == r.text and c.finish_reason == r.finish_reason
        assert getattr(c, "stop_reason", None) == r.stop_reason  # omitted when None
        content = c.logprobs.content  # type: ignore[union-attr]
        assert [x.token for x in content] == [TOK.decode([t]) for t in r.token_ids]
        assert [x.logprob for x in content] == pytest.approx(r.logprobs, abs=1e-5)
        for x, top in zip(content, r.top_logprobs):
            best = sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
            assert [a.token for a in x.top_logprobs] == [TOK.decode([t]) for t, _ in best]
            assert [a.logprob for a in x.top_logprobs] == pytest.approx(
                [v for _, v in best], abs=1e-5
            )
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True, **kw)  # type: ignore[arg-type]
    texts: dict[int, str] = {}
    roles = set()
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert roles == {0, 1} and texts == {i: r.text for i, r in enumerate(ref)}


def test_bad_words_as_strings_and_penalties(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(max_tokens=24, temperature=0.0)
    plain = (
        client.completions.create(
            model="tiny", prompt=PROMPT, extra_body={"ignore_eos": True}, **kw
        )
        .choices[0]
        .text
    )
    word = next(ch for ch in plain if " " < ch < "\x7f")  # a character the greedy stream has
    body = {"bad_words": [word], "repetition_penalty": 1.3, "ignore_eos": True}
    out = client.completions.create(
        model="tiny", prompt=PROMPT, extra_body=body, presence_penalty=0.5, **kw
    )
    ref = reference(
        TOK.encode(PROMPT),
        bad_words=[word],
        repetition_penalty=1.3,
        ignore_eos=True,
        presence_penalty=0.5,
        **kw,
    )
    assert out.choices[0].text == ref[0].text and TOK.encode(word)[0] not in ref[0].token_ids
