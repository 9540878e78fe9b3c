"""Every row of README's table of request fields, through the `openai` client against a real
`tokentape serve` on 127.0.0.1: an implemented field has its effect (checked against the
in-process engine), a refused one gets a 400 naming it, and nothing is dropped silently. The
table and these tests are checked against each other, so neither can grow alone."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_process import ServerProcess

from tokentape import LLM, SamplingParams
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.entrypoints.unsupported_fields import CHAT, COMPLETION

ROOT = Path(__file__).resolve().parents[2]
TOK = ByteTokenizer()
CTX = 96  # the servers' max_model_len: the chat default (the rest of the context) stays short
PROMPT = "The tape says"
MSGS: list[Any] = [{"role": "user", "content": "Hi"}]
NOEOS = {"ignore_eos": True}


class Servers:
    def __init__(self, tiny: ServerProcess, ckpt: ServerProcess) -> None:
        self.tiny, self.ckpt = tiny, ckpt
        self.c = client(tiny)
        self.k = client(ckpt)


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def checkpoint(root: Path) -> str:
    """tiny as a checkpoint folder whose tokenizer adds a BOS (a post-processor, as Llama's)
    and whose chat template reads a chat_template_kwargs variable."""
    from tokentape.engine.model.loader import builtin_model, save_checkpoint

    folder = save_checkpoint(builtin_model("tiny", seed=0)[1], root / "ckpt")
    file = Path(folder, "tokenizer.json")
    tok = json.loads(file.read_text())
    bos = "<|tokentape:bos|>"  # written as JSON: the short form cannot hold its colon
    seq = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": seq,
        "pair": [*seq, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}},
    }
    file.write_text(json.dumps(tok))
    template = (
        "{% if style %}<{{ style }}>{% endif %}{% for m in messages %}[{{ m.role }}]"
        "{% if m.name %}({{ m.name }}){% endif %} {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    Path(folder, "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("fields")
    common = ("--seed", "0", "--max-model-len", str(CTX), "--no-tape", "--cpu-threads", "1")
    tiny = ServerProcess("--model", "tiny", *common)
    try:
        ckpt = ServerProcess("--model", checkpoint(root), "--served-model-name", "ckpt", *common)
        try:
            yield Servers(tiny, ckpt)
        finally:
            ckpt.stop()
    finally:
        tiny.stop()


def reference(prompt: str | list[int], **kw: Any) -> list[Any]:
    """The in-process engine's outputs for the same request."""
    llm = LLM("tiny", tape=None, seed=0, max_model_len=CTX)
    ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
    out = llm.generate([ids], SamplingParams(**kw), use_tqdm=False)[0].outputs
    llm.close()
    return out


def complete(s: Servers, **kw: Any) -> Any:
    """A completion of PROMPT on tiny, without EOS, with its token ids."""
    body = {**NOEOS, "return_token_ids": True, **kw.pop("extra_body", {})}
    return s.c.completions.create(
        model=kw.pop("model", "tiny"), prompt=kw.pop("prompt", PROMPT), extra_body=body, **kw
    )


def ids(choice: Any) -> list[int]:
    return list(choice.token_ids)  # the random model's bytes are not all UTF-8 text


GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0}


# -- implemented fields: one check per row of README's table ------------------------------------


def check_model(s: Servers) -> None:
    assert complete(s, model="tiny", **GREEDY).model == "tiny"
    with pytest.raises(openai.NotFoundError):
        s.c.completions.create(model="other", prompt=PROMPT, max_tokens=1)


def check_prompt(s: Servers) -> None:
    want = reference(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)[0].token_ids
    for prompt in (PROMPT, TOK.encode(PROMPT), [PROMPT, TOK.encode(PROMPT)]):
        out = complete(s, prompt=prompt, **GREEDY, extra_body={"return_token_ids": True})
        assert all(c.token_ids == want for c in out.choices)  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as exc:  # past the context: vLLM's words
        complete(s, prompt=[5] * CTX, max_tokens=1)
    assert exc.value.body["param"] == "prompt"  # type: ignore[index]
    assert (
        f"This model's maximum context length is {CTX} tokens. However, your request has "
        f"{CTX} input tokens. Please reduce the length of the input messages."
    ) in exc.value.body["message"]  # type: ignore[index]


def check_max_tokens(s: Servers) -> None:
    assert complete(s).usage.completion_tokens == 16  # OpenAI's and vLLM's default
    assert complete(s, prompt=[5] * (CTX - 3)).usage.completion_tokens == 3  # cut to the context
    assert complete(s, max_tokens=5).usage.completion_tokens == 5
    # Several prompts: each its own default (vLLM's), and null is the default too.
    two = complete(s, prompt=[PROMPT, [5] * (CTX - 3)], extra_body={"max_tokens": None})
    assert [len(c.token_ids) for c in two.choices] == [16, 3]  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as exc:  # each prompt's own context check
        complete(s, prompt=[PROMPT, [5] * CTX])
    assert exc.value.body["param"] == "prompt"  # type: ignore[index]
    assert f"your request has {CTX} input tokens" in str(exc.value)
    with pytest.raises(openai.BadRequestError) as exc:
        complete(s, max_tokens=CTX)
    assert exc.value.body["param"] == "max_tokens"  # type: ignore[index]
    assert "'max_tokens' or 'max_completion_tokens' is too large" in str(exc.value)
    # Chat: the rest of the context by default, as vLLM's.
    out = s.c.chat.completions.create(model="tiny", messages=MSGS, extra_body=NOEOS)
    assert out.usage.completion_tokens == CTX - out.usage.prompt_tokens


def check_max_completion_tokens(s: Servers) -> None:
    out = s.c.chat.completions.create(
        model="tiny", messages=MSGS, max_completion_tokens=4, extra_body=NOEOS
    )
    assert out.usage.completion_tokens == 4


def check_temperature(s: Servers) -> None:
    ref = reference(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    assert ids(complete(s, **GREEDY).choices[0]) == ref.token_ids


def check_seed(s: Servers) -> None:
    kw = {"max_tokens": 8, "temperature": 1.0, "seed": 7}
    ref = reference(PROMPT, **kw, ignore_eos=True)[0]
    assert ids(complete(s, **kw).choices[0]) == ref.token_ids
    assert ids(complete(s, **{**kw, "seed": 8}).choices[0]) != ref.token_ids


def check_sampling_filter(field: str, value: float) -> Callable[[Servers], None]:
    """A filter that keeps only the best token at temperature 2 gives the greedy tokens."""

    def check(s: Servers) -> None:
        greedy = ids(complete(s, **GREEDY).choices[0])
        hot = {"max_tokens": 8, "temperature": 2.0, "seed": 3}
        assert ids(complete(s, **hot).choices[0]) != greedy
        out = (
            complete(s, **hot, extra_body={field: value})
            if field in ("top_k", "min_p")
            else (complete(s, **hot, **{field: value}))
        )
        assert ids(out.choices[0]) == greedy

    return check


def check_n(s: Servers) -> None:
    out = complete(s, max_tokens=4, temperature=1.0, seed=1, n=2)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text != out.choices[1].text


def check_stream(s: Servers) -> None:
    chunks = list(complete(s, **GREEDY, stream=True, stream_options={"include_usage": True}))
    assert (
        "".join(c.choices[0].text for c in chunks if c.choices)
        == complete(s, **GREEDY).choices[0].text
    )
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    with pytest.raises(openai.BadRequestError) as exc:  # without stream: refused, as vLLM's
        complete(s, **GREEDY, stream_options={"include_usage": True})
    assert exc.value.body["param"] == "stream_options"  # type: ignore[index]
    assert all(c.system_fingerprint.startswith("tokentape-") for c in chunks)


def check_continuous_usage(s: Servers) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(complete(s, **GREEDY, n=2, stream=True, stream_options=opts))
    *per_choice, last = chunks
    assert last.usage.completion_tokens == 16 and not last.choices
    prompt = len(TOK.encode(PROMPT))
    for j in (0, 1):  # each choice's chunks count its own tokens so far
        mine = [c for c in per_choice if c.choices[0].index == j]
        so_far = [len(c.choices[0].token_ids) for c in mine]  # type: ignore[attr-defined]
        so_far = [sum(so_far[: i + 1]) for i in range(len(so_far))]
        assert [c.usage.completion_tokens for c in mine] == so_far and so_far[-1] == 8
        assert all(c.usage.prompt_tokens == prompt for c in mine)
        assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in mine)
    chat = list(
        s.c.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=3,
            stream=True,
            stream_options=opts,
            extra_body=NOEOS,
        )
    )
    counts = [c.usage.completion_tokens for c in chat]  # the role chunk, the tokens, the usage
    assert counts[0] == 0 and counts[-2:] == [3, 3] and counts == sorted(counts)


def check_stop(s: Servers) -> None:
    quote = {"logit_bias": {"42": 100}}  # every token "'" (byte 39: id 42)
    assert complete(s, **GREEDY, **quote).choices[0].text == "'" * 8
    out = complete(s, **GREEDY, **quote, stop=["''"])
    assert out.choices[0].text == "" and out.choices[0].finish_reason == "stop"
    assert out.choices[0].stop_reason == "''"  # type: ignore[attr-defined]
    body = {"include_stop_str_in_output": True}
    kept = complete(s, **GREEDY, **quote, stop=["''"], extra_body=body)
    assert kept.choices[0].text == "''"


def check_stop_token_ids(s: Servers) -> None:
    greedy = ids(complete(s, **GREEDY).choices[0])
    out = complete(s, **GREEDY, extra_body={"stop_token_ids": [greedy[0]]})
    assert ids(out.choices[0]) == greedy[:1] and out.choices[0].finish_reason == "stop"
    # min_tokens masks the stop id until the output has that many tokens.
    out = complete(s, **GREEDY, extra_body={"stop_token_ids": [greedy[0]], "min_tokens": 3})
    assert len(ids(out.choices[0])) >= 3


def check_ignore_eos(s: Servers) -> None:
    eos = complete(s, **GREEDY, logit_bias={"1": 100}, extra_body={"ignore_eos": False})
    assert eos.choices[0].finish_reason == "stop" and eos.usage.completion_tokens == 1
    assert complete(s, **GREEDY, logit_bias={"1": 100}).usage.completion_tokens == 8


def check_penalty(field: str) -> Callable[[Servers], None]:
    def check(s: Servers) -> None:
        greedy = reference(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)[0].token_ids
        ref = reference(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, **{field: 1.5})
        assert ref[0].token_ids != greedy
        body = {field: 1.5}
        out = (
            complete(s, **GREEDY, extra_body=body)
            if field == "repetition_penalty"
            else (complete(s, **GREEDY, **body))
        )
        assert ids(out.choices[0]) == ref[0].token_ids

    return check


def check_logit_bias(s: Servers) -> None:
    out = complete(s, **GREEDY, logit_bias={"42": 100})
    assert ids(out.choices[0]) == [42] * 8
    with pytest.raises(openai.BadRequestError) as exc:
        complete(s, **GREEDY, logit_bias={"9999": 1})
    assert exc.value.body["param"] == "logit_bias"  # type: ignore[index]


def check_bad_words(s: Servers) -> None:
    quote = {"logit_bias": {"42": 100}}  # every token "'", unless banned
    out = complete(s, **GREEDY, **quote, extra_body={"bad_words": ["'"]})
    assert 42 not in ids(out.choices[0]) and len(ids(out.choices[0])) == 8


def check_logprobs(s: Servers) -> None:
    ref = reference(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)[0]
    lp = complete(s, max_tokens=4, temperature=0.0, logprobs=2).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert [len(d) for d in lp.top_logprobs] == [len(d) for d in ref.top_logprobs]
    # logprobs=0: each token's own logprob, and it alone as the "top 0 + 1" (vLLM's).
    zero = complete(s, max_tokens=4, temperature=0.0, logprobs=0).choices[0].logprobs
    assert zero.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert zero.top_logprobs == [{t: lp} for t, lp in zip(zero.tokens, zero.token_logprobs)]
    chat = s.c.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=2, extra_body=NOEOS
    )
    assert [len(c.top_logprobs) for c in chat.choices[0].logprobs.content] == [2, 2, 2]
    with pytest.raises(openai.BadRequestError) as exc:  # top_logprobs alone: refused
        s.c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, top_logprobs=2)
    assert exc.value.body["param"] == "top_logprobs"  # type: ignore[index]


def check_return_token_ids(s: Servers) -> None:
    out = complete(s, **GREEDY, extra_body={"return_token_ids": True})
    assert TOK.decode(out.choices[0].token_ids) == out.choices[0].text  # type: ignore[attr-defined]
    assert out.choices[0].prompt_token_ids == TOK.encode(PROMPT)  # type: ignore[attr-defined]


def check_request_id(s: Servers) -> None:
    assert complete(s, max_tokens=1, extra_body={"request_id": "mine-1"}).id == "mine-1"


def check_user(s: Servers) -> None:  # accepted, no effect on the output (as OpenAI's, vLLM's)
    assert complete(s, **GREEDY, user="u1").choices[0].text == complete(s, **GREEDY).choices[0].text


def check_response_format_text(s: Servers) -> None:
    out = complete(s, **GREEDY, extra_body={"response_format": {"type": "text"}})
    assert out.choices[0].text == complete(s, **GREEDY).choices[0].text


def check_add_special_tokens(s: Servers) -> None:
    # The checkpoint's tokenizer adds a BOS: completions run it by default (vLLM's), chat not.
    tokens = httpx.post(f"{s.ckpt.url}/tokenize", json={"prompt": "Hi"}).json()["tokens"]
    assert tokens == [0, *TOK.encode("Hi")]
    plain = {"prompt": "Hi", "add_special_tokens": False}
    assert httpx.post(f"{s.ckpt.url}/tokenize", json=plain).json()["tokens"] == TOK.encode("Hi")
    out = s.k.completions.create(model="ckpt", prompt="Hi", max_tokens=1)
    assert out.usage.prompt_tokens == 3
    out = s.k.completions.create(
        model="ckpt", prompt="Hi", max_tokens=1, extra_body={"add_special_tokens": False}
    )
    assert out.usage.prompt_tokens == 2
    chat = s.k.chat.completions.create(model="ckpt", messages=MSGS, max_tokens=1)
    with_bos = s.k.chat.completions.create(
        model="ckpt", messages=MSGS, max_tokens=1, extra_body={"add_special_tokens": True}
    )
    assert with_bos.usage.prompt_tokens == chat.usage.prompt_tokens + 1


def chat_prompt_tokens(s: Servers, messages: list[Any], **body: Any) -> int:
    out = s.k.chat.completions.create(
        model="ckpt", messages=messages, max_tokens=1, extra_body=body
    )
    tokens = httpx.post(f"{s.ckpt.url}/tokenize", json={"messages": messages, **body}).json()
    assert tokens["count"] == out.usage.prompt_tokens and tokens["max_model_len"] == CTX
    return out.usage.prompt_tokens


def check_add_generation_prompt(s: Servers) -> None:
    with_prompt = chat_prompt_tokens(s, MSGS)
    assert chat_prompt_tokens(s, MSGS, add_generation_prompt=False) == with_prompt - len(
        TOK.encode("[assistant] ")
    )


def check_continue_final_message(s: Servers) -> None:
    msgs = [*MSGS, {"role": "assistant", "content": "Sure, the"}]
    closed = chat_prompt_tokens(s, msgs, add_generation_prompt=False)
    assert chat_prompt_tokens(s, msgs, continue_final_message=True) == closed - 1  # no "\n"
    with pytest.raises(openai.BadRequestError) as exc:
        s.k.chat.completions.create(
            model="ckpt",
            messages=msgs,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in str(exc.value)


def check_chat_template_kwargs(s: Servers) -> None:
    plain = chat_prompt_tokens(s, MSGS)
    assert chat_prompt_tokens(s, MSGS, chat_template_kwargs={"style": "terse"}) == plain + 7
    with pytest.raises(openai.BadRequestError) as exc:
        s.k.chat.completions.create(
            model="ckpt", messages=MSGS, extra_body={"chat_template_kwargs": {"chat_template": "x"}}
        )
    assert "untrusted chat template" in str(exc.value)


def check_messages(s: Servers) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}
    ]
    assert chat_prompt_tokens(s, parts) == chat_prompt_tokens(s, MSGS)
    named = [{**MSGS[0], "name": "bob"}]  # the participant's name reaches the template
    assert chat_prompt_tokens(s, named) == chat_prompt_tokens(s, MSGS) + len("(bob)")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for bad in (
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            s.c.chat.completions.create(model="tiny", messages=[*MSGS, bad], max_tokens=1)
        assert exc.value.body["param"] == "messages" and "tool calling" in str(exc.value)  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as exc:
        s.c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * CTX}])
    assert "maximum context length" in str(exc.value)


def check_echo(s: Servers) -> None:
    """vLLM's echo: the prompt before each choice's text and, with logprobs, its tokens
    before the generated ones (the first with null logprobs); echo with max_tokens=0 scores
    the prompt (lm-eval's loglikelihood requests); text and token-id prompts; streamed."""
    llm = LLM("tiny", tape=None, seed=0, max_model_len=CTX)
    ref = llm.generate(
        [TOK.encode(PROMPT)],
        SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2
        ),
    )[0]
    llm.close()
    n = len(PROMPT)
    gen = ref.outputs[0]
    plain = {"return_token_ids": False}
    kw: dict[str, Any] = {"max_tokens": 4, "temperature": 0.0, "echo": True, "extra_body": plain}
    out = complete(s, **kw).choices[0]
    assert out.text == PROMPT + gen.text and out.logprobs is None
    for prompt in (PROMPT, TOK.encode(PROMPT)):  # a token-id prompt echoes its decoded text
        lp = complete(s, **kw, prompt=prompt, logprobs=2).choices[0].logprobs
        assert lp.tokens == [*PROMPT, *(TOK.decode([t]) for t in gen.token_ids)]
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert ref.prompt_logprobs is not None
        want = [row[t] for row, t in zip(ref.prompt_logprobs[1:], ref.prompt_token_ids[1:])]  # type: ignore[index]
        assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-5)
        assert lp.token_logprobs[n:] == pytest.approx(gen.logprobs, abs=1e-5)
        # By their text, as vLLM's: bytes that are no character all read as U+FFFD.
        tops = [{TOK.decode([t]) for t in row} for row in ref.prompt_logprobs[1:]]  # type: ignore[union-attr]
        assert [set(d) for d in lp.top_logprobs[1:n]] == tops
    # max_tokens=0: the prompt alone, scored; one token is generated and counted (vLLM's).
    score = complete(s, max_tokens=0, echo=True, logprobs=1, extra_body=plain)
    ch = score.choices[0]
    assert ch.text == PROMPT and ch.logprobs.tokens == list(PROMPT)
    assert ch.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert ch.finish_reason == "length" and score.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as exc:  # without echo: refused, as vLLM's
        complete(s, max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"  # type: ignore[index]
    # Streamed: the prompt comes with the first chunk; the chunks join into the whole.
    whole = complete(s, **kw, logprobs=2).choices[0]
    chunks = [c.choices[0] for c in complete(s, **kw, logprobs=2, stream=True) if c.choices]
    assert chunks[0].text.startswith(PROMPT) and "".join(c.text for c in chunks) == whole.text
    assert chunks[0].logprobs.tokens[:n] == list(PROMPT)
    joined = [x for c in chunks for x in c.logprobs.token_logprobs]
    assert joined[0] is None and joined[1:] == pytest.approx(whole.logprobs.token_logprobs[1:])
    assert [x for c in chunks for x in c.logprobs.text_offset] == whole.logprobs.text_offset
    opts = {"include_usage": True}
    streamed = list(
        complete(s, max_tokens=0, echo=True, stream=True, stream_options=opts, extra_body=plain)
    )
    assert [c.choices[0].text for c in streamed if c.choices] == [PROMPT]
    assert streamed[-1].usage.completion_tokens == 1
    # Each prompt echoes its own; with return_token_ids the text has no prompt (vLLM's).
    two = complete(s, **{**kw, "prompt": [PROMPT, "Hi"]}).choices
    assert two[0].text.startswith(PROMPT) and two[1].text.startswith("Hi")
    ids_too = complete(s, **{**kw, "extra_body": {}}, logprobs=0).choices[0]
    assert ids_too.text == gen.text and len(ids_too.logprobs.tokens) == n + 4
    # Chat: the last message's content, when its role is the reply's (vLLM's).
    msgs: list[Any] = [*MSGS, {"role": "assistant", "content": "Sure, the"}]
    cont = {"continue_final_message": True, "add_generation_prompt": False, **NOEOS}
    chat = {"model": "tiny", "messages": msgs, "max_tokens": 3, "temperature": 0.0}
    reply = s.c.chat.completions.create(**chat, extra_body=cont).choices[0].message.content
    echoed = s.c.chat.completions.create(**chat, extra_body={**cont, "echo": True})
    assert echoed.choices[0].message.content == "Sure, the" + reply
    deltas = [
        c.choices[0].delta.content
        for c in s.c.chat.completions.create(**chat, stream=True, extra_body={**cont, "echo": True})
        if c.choices
    ]
    assert deltas[1] == "Sure, the" and "".join(d or "" for d in deltas) == "Sure, the" + reply
    user_last = {"model": "tiny", "messages": MSGS, "max_tokens": 3, "temperature": 0.0}
    alone = s.c.chat.completions.create(**user_last, extra_body=NOEOS)
    mismatch = s.c.chat.completions.create(**user_last, extra_body={**NOEOS, "echo": True})
    assert mismatch.choices[0].message.content == alone.choices[0].message.content


IMPLEMENTED: dict[str, Callable[[Servers], None]] = {
    "model": check_model,
    "prompt": check_prompt,
    "messages": check_messages,
    "max_tokens": check_max_tokens,
    "max_completion_tokens": check_max_completion_tokens,
    "temperature": check_temperature,
    "seed": check_seed,
    "top_p": check_sampling_filter("top_p", 1e-6),
    "top_k": check_sampling_filter("top_k", 1),
    "min_p": check_sampling_filter("min_p", 1.0),
    "n": check_n,
    "stream": check_stream,
    "stream_options.include_usage": check_stream,
    "stream_options.continuous_usage_stats": check_continuous_usage,
    "stop": check_stop,
    "include_stop_str_in_output": check_stop,
    "stop_token_ids": check_stop_token_ids,
    "min_tokens": check_stop_token_ids,
    "ignore_eos": check_ignore_eos,
    "presence_penalty": check_penalty("presence_penalty"),
    "frequency_penalty": check_penalty("frequency_penalty"),
    "repetition_penalty": check_penalty("repetition_penalty"),
    "logit_bias": check_logit_bias,
    "bad_words": check_bad_words,
    "logprobs": check_logprobs,
    "top_logprobs": check_logprobs,
    "return_token_ids": check_return_token_ids,
    "request_id": check_request_id,
    "user": check_user,
    "response_format": check_response_format_text,
    "add_special_tokens": check_add_special_tokens,
    "add_generation_prompt": check_add_generation_prompt,
    "continue_final_message": check_continue_final_message,
    "chat_template_kwargs": check_chat_template_kwargs,
    "echo": check_echo,
}


@pytest.mark.parametrize("field", sorted(IMPLEMENTED))
def test_an_implemented_field_has_its_effect(servers: Servers, field: str) -> None:
    IMPLEMENTED[field](servers)


# -- refused fields ------------------------------------------------------------------------------

# A value that asks for something, per field refused by unsupported_fields (the rest: a string).
ASKING: dict[str, Any] = {
    "response_format": {"type": "json_object"},
    "use_beam_search": True,
    "length_penalty": 0.5,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "return_tokens_as_token_ids": True,
    "return_token_offsets": True,
    "priority": 1,
    "truncate_prompt_tokens": 4,
    "allowed_token_ids": [5, 6],
    "prompt_logprobs": 1,
    "logprob_token_ids": [5],
    "best_of": 2,
    "store": True,
    "stream_interval": 2,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "return_prompt_text": True,
    "include_reasoning": False,
    "modalities": ["text", "audio"],
    "metadata": {"a": "b"},
    "service_tier": "flex",
}
REFUSED = [("completions", f) for f in sorted(COMPLETION)] + [
    ("chat", f) for f in sorted(CHAT) if f not in COMPLETION
]


@pytest.mark.parametrize(("endpoint", "field"), REFUSED)
def test_a_refused_field_gets_a_400_naming_it(servers: Servers, endpoint: str, field: str) -> None:
    body = {field: ASKING.get(field, "x")}
    with pytest.raises(openai.BadRequestError) as exc:
        if endpoint == "completions":
            servers.c.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body=body)
        else:
            servers.c.chat.completions.create(
                model="tiny", messages=MSGS, max_tokens=1, extra_body=body
            )
    assert exc.value.status_code == 400 and exc.value.body["param"] == field  # type: ignore[index]
    assert field in exc.value.body["message"] or "chat template" in exc.value.body["message"]  # type: ignore[index]


def test_a_field_that_asks_for_nothing_passes(servers: Servers) -> None:
    out = servers.c.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"tool_choice": None, "priority": 0}
    )
    assert out.usage.completion_tokens == 1


def test_tokenize_detokenize_and_the_fingerprint(servers: Servers) -> None:
    url = servers.tiny.url
    out = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert out == {
        "count": len(PROMPT),
        "max_model_len": CTX,
        "tokens": TOK.encode(PROMPT),
        "token_strs": list(PROMPT),
    }
    assert httpx.post(f"{url}/detokenize", json={"tokens": TOK.encode(PROMPT)}).json() == {
        "prompt": PROMPT
    }
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [5, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    fp = complete(servers, max_tokens=1).system_fingerprint
    assert re.fullmatch(r"tokentape-[0-9.]+-[0-9a-f]{8}", fp)
    chat = servers.c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert chat.system_fingerprint == fp
    assert (
        servers.k.completions.create(model="ckpt", prompt=[5], max_tokens=1).system_fingerprint
        != fp
    )


# -- README's table and these tests, checked against each other -------------------------------


def readme_fields() -> dict[str, str]:
    """README's table of request fields: field -> 'implemented', 'accepted' or 'refused'."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("### Request fields") :]
    table = table[: table.index("\n\n", table.index("|"))]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        m = re.match(r"\| ((?:`[^`]+`(?:, )?)+) \| (implemented|accepted|refused)", line)
        if m:
            for name in re.findall(r"`([^`]+)`", m.group(1)):
                rows[name] = m.group(2)
    return rows


def test_readme_table_matches_the_server() -> None:
    rows = readme_fields()
    documented = {f for f, status in rows.items() if status != "refused"}
    assert documented == set(IMPLEMENTED), documented ^ set(IMPLEMENTED)
    refused = {f for f, status in rows.items() if status == "refused"}
    # response_format is a row of its own: {"type": "text"} is served, other types refused.
    expected = {*COMPLETION, *CHAT}
    assert refused == expected - {"response_format"}, refused ^ expected
