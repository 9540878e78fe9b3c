"""vLLM's tokens-in, tokens-out /inference/v1/generate, over the app in process (tiny): the
token ids /v1/completions gives for the same prompt and options, in one body or streamed,
with vLLM's request id, usage, logprobs by token id and prompt logprobs; what it does not
implement, and what the engine refuses, are 400s naming the field, with nothing recorded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from tokentape import AsyncLLM
from tokentape.entrypoints.api_server import ServerOptions, build_app
from tokentape.events import schema as ev
from tokentape.replay import load_tape
from tokentape.replay.verify import verify

PROMPT = [84, 107, 104, 35, 119, 100, 115, 104]  # "The tape" in the byte tokenizer's ids
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}

Client = Callable[[httpx.AsyncClient], Awaitable[None]]


def run_app(tape: Path | None, body: Client, options: ServerOptions | None = None) -> None:
    engine = AsyncLLM(
        "tiny", tape=str(tape) if tape else False, multiprocess_mode=False, max_model_len=64
    )

    async def main() -> None:
        transport = httpx.ASGITransport(app=build_app(engine, options=options))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            await body(http)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def sse_events(text: str) -> list[Any]:
    lines = [x.removeprefix("data: ") for x in text.split("\n\n") if x]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(x) for x in lines[:-1]]


def test_token_ids_in_token_ids_out(tmp_path: Path) -> None:
    tape = tmp_path / "run.tape"

    async def body(http: httpx.AsyncClient) -> None:
        ref = await http.post(
            "/v1/completions", json={"prompt": PROMPT, "return_token_ids": True, **GREEDY}
        )
        want = ref.json()["choices"][0]["token_ids"]
        assert len(want) == 6
        r = await http.post(
            "/inference/v1/generate",
            json={"token_ids": PROMPT, "sampling_params": GREEDY, "request_id": "rl-1"},
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["request_id"] == "generate-tokens-rl-1"
        assert got["choices"] == [
            {"index": 0, "token_ids": want, "finish_reason": "length", "logprobs": None}
        ]
        assert got["usage"] == {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14}
        assert got["prompt_logprobs"] is None and got["kv_transfer_params"] is None

        # Logprobs of the sampled tokens (and the k most likely), named by token id; the
        # prompt's with prompt_logprobs (none for its first token, as vLLM's).
        sampling = {**GREEDY, "logprobs": 2, "prompt_logprobs": 1}
        r = await http.post(
            "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": sampling}
        )
        got = r.json()
        (choice,) = got["choices"]
        assert choice["token_ids"] == want
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in want]
        assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
        # greedy: the sampled token is the most likely one
        assert [c["top_logprobs"][0]["token"] for c in content] == [c["token"] for c in content]
        rows = got["prompt_logprobs"]
        assert len(rows) == len(PROMPT) and rows[0] is None
        assert all(str(t) in row for t, row in zip(PROMPT[1:], rows[1:]))

        # Streamed: one choice's new ids a chunk, the usage last, then [DONE].
        r = await http.post(
            "/inference/v1/generate",
            json={
                "token_ids": PROMPT,
                "sampling_params": {**GREEDY, "n": 2, "seed": 1, "temperature": 1.0},
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        events = sse_events(r.text)
        by_index: dict[int, list[int]] = {0: [], 1: []}
        for e in events[:-1]:
            (c,) = e["choices"]
            by_index[c["index"]] += c["token_ids"]
        assert [len(v) for v in by_index.values()] == [6, 6]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12

    run_app(tape, body)
    recorded = [e for _, e in load_tape(tape).events() if isinstance(e, ev.RequestAdded)]
    assert len(recorded) == 1 + 1 + 1 + 2  # completions, two generates, two children
    assert verify(tape).ok


def test_what_is_refused_is_a_400_naming_its_field_and_nothing_is_recorded(
    tmp_path: Path,
) -> None:
    tape = tmp_path / "run.tape"
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {"token_ids": PROMPT, "sampling_params": {**GREEDY, "allowed_token_ids": [5]}},
            "sampling_params.allowed_token_ids",
            "allowed_token_ids is not implemented",
        ),
        (
            {"token_ids": PROMPT, "sampling_params": GREEDY, "cache_salt": "s"},
            "cache_salt",
            "prefix-cache salts",
        ),
        (
            {"token_ids": PROMPT, "sampling_params": {**GREEDY, "max_tokens": 100}},
            "sampling_params.max_tokens",
            "maximum context length is 64",
        ),
        ({"token_ids": [5, 99999], "sampling_params": GREEDY}, "token_ids", "99999"),
        (
            {"token_ids": PROMPT, "sampling_params": {**GREEDY, "temperature": -1}},
            "sampling_params.temperature",
            "temperature",
        ),
        (
            {"token_ids": PROMPT, "sampling_params": GREEDY, "model": "other"},
            "model",
            "does not exist",
        ),
    ]

    async def body(http: httpx.AsyncClient) -> None:
        for request, param, words in cases:
            r = await http.post("/inference/v1/generate", json=request)
            error = r.json()["error"]
            assert r.status_code in (400, 404) and error["param"] == param, (request, r.text)
            assert words in error["message"], error
        r = await http.post("/inference/v1/generate", json={"sampling_params": GREEDY})
        assert r.status_code == 422 and r.json()["error"]["param"] == "token_ids"
        ok = await http.post(
            "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": GREEDY}
        )
        assert ok.status_code == 200  # the engine serves on

    run_app(tape, body)
    added = [e for _, e in load_tape(tape).events() if isinstance(e, ev.RequestAdded)]
    assert len(added) == 1


def test_the_api_key_guards_it() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        request = {"token_ids": PROMPT, "sampling_params": GREEDY}
        r = await http.post("/inference/v1/generate", json=request)
        assert r.status_code == 401
        r = await http.post(
            "/inference/v1/generate", json=request, headers={"Authorization": "Bearer k"}
        )
        assert r.status_code == 200

    run_app(None, body, ServerOptions(api_keys=("k",)))
