"""Sleep mode and abort-all over HTTP, against a live server on 127.0.0.1: vLLM's POST /sleep,
POST /wake_up and GET /is_sleeping (their paths, query parameters and bodies), SGLang's POST
/abort_request, the requests that arrive during a /sleep (vLLM #45268) and a /sleep over
decodes in flight (vLLM #45520); the tape verifies after the server stops."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import ServerProcess

from tokentape import SamplingParams
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.events import schema as ev
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape, verify

KEY = "sleepy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORACLE = OracleRunner()
SLEEP_PATHS = (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"))


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    return ORACLE.expected_stream(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


class Live:
    def __init__(self, server: ServerProcess, tape: str) -> None:
        self.server, self.tape, self.url = server, tape, server.url
        self.http = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)

    def complete(self, prompt: list[int], max_tokens: int, rid: str) -> dict[str, Any]:
        body = {
            "model": "oracle",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "return_token_ids": True,
            "request_id": rid,
        }
        return self.http.post("/v1/completions", json=body).json()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tape = str(tmp_path_factory.mktemp("sleep") / "serve.tape")
    server = ServerProcess(
        "--model",
        "oracle",
        "--tape",
        tape,
        "--pipeline-depth",
        "2",
        "--block-size",
        "4",
        "--num-kv-blocks",
        "65536",
        "--enable-rl-endpoints",
        env={"TOKENTAPE_API_KEY": KEY},
    )
    try:
        yield Live(server, tape)
    finally:
        server.stop()


def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    got: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: got.setdefault("out", fn(*args)), daemon=True)
    thread.start()
    return thread, got


def test_sleep_over_decodes_in_flight_then_wake_up_tag_by_tag(live: Live) -> None:
    """/sleep answers once the engine drained and fell asleep (vLLM #45520); what was running
    and what arrives while it sleeps (vLLM #45268) is served after the wake-up."""
    started = threading.Event()
    body = {"model": "oracle", "prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True}
    chunks: list[str] = []

    def stream() -> None:
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        with live.http.stream("POST", "/v1/completions", json={**body, **usage}) as r:
            for line in r.iter_lines():
                if line:
                    chunks.append(line)
                    started.set()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert started.wait(30)
    r = live.http.post("/sleep", params={"level": 1, "mode": "keep"})
    assert r.status_code == 200 and r.content == b""  # vLLM's answer: no body
    assert live.http.get("/is_sleeping").json() == {"is_sleeping": True}
    late, got = in_thread(live.complete, [9, 8, 7], 6, "late")
    seen = len(chunks)
    late.join(0.5)
    assert late.is_alive() and len(chunks) == seen  # nothing runs while it sleeps
    assert live.http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert live.http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert live.http.post("/wake_up").status_code == 200
    assert live.http.get("/is_sleeping").json() == {"is_sleeping": False}
    late.join(30)
    streamer.join(60)
    assert got["out"]["choices"][0]["token_ids"] == expected([9, 8, 7], 6)
    assert chunks[-1] == "data: [DONE]"
    data = [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]
    assert data[-1]["usage"]["completion_tokens"] == 4000  # none lost over the sleep
    assert data[-2]["choices"][0]["finish_reason"] == "length"
    live.server.wait_idle()
    events = [e for _, e in load_tape(live.tape).events()]
    at = next(i for i, e in enumerate(events) if isinstance(e, ev.EngineSlept))
    slept = events[at]
    assert isinstance(slept, ev.EngineSlept) and slept.level == 1 and len(slept.kept) == 1
    # The decode in flight when /sleep came was drained before the memory went: its frame is
    # between the sleep's pause and EngineSlept, which lists nothing in flight.
    paused = max(i for i, e in enumerate(events[:at]) if isinstance(e, ev.GenerationPaused))
    assert any(isinstance(e, ev.FrameProduced) for e in events[paused:at])
    assert slept.in_flight == []


def test_requests_racing_the_sleep_are_served_or_aborted_never_parked(live: Live) -> None:
    """vLLM #45268, raced: completions sent together with a /sleep (vLLM's default mode,
    abort) each end, either aborted by the sleep or served after the wake-up."""

    async def race(i: int) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=60) as client:

            async def complete(j: int) -> dict[str, Any]:
                body = {
                    "model": "oracle",
                    "prompt": [3 + i, 4 + j],
                    "max_tokens": 30,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                return (await client.post("/v1/completions", json=body)).json()

            async def sleep_then_wake() -> None:
                assert (await client.post("/sleep", params={"level": 2})).status_code == 200
                await asyncio.sleep(0.2)
                assert (await client.post("/wake_up")).status_code == 200

            *outs, _ = await asyncio.wait_for(
                asyncio.gather(*(complete(j) for j in range(4)), sleep_then_wake()), 60
            )
            return [*outs, {"prompts": [[3 + i, 4 + j] for j in range(4)]}]

    for i in range(4):
        *outs, meta = asyncio.run(race(i))
        for out, prompt in zip(outs, meta["prompts"]):
            choice = out["choices"][0]
            want = expected(prompt, 30)
            if choice["finish_reason"] == "abort":
                assert choice["token_ids"] == want[: len(choice["token_ids"])]
            else:
                assert choice["finish_reason"] == "length" and choice["token_ids"] == want
    assert live.http.get("/is_sleeping").json() == {"is_sleeping": False}


def running(live: Live) -> float:
    for line in live.http.get("/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1])
    raise AssertionError("no vllm:num_requests_running in /metrics")


def test_abort_request_aborts_one_or_all(live: Live) -> None:
    threads = [in_thread(live.complete, [5, i], 200_000, f"long{i}") for i in range(3)]
    for _ in range(1200):  # until the three run (a busy machine admits them slowly)
        if running(live) >= 3:
            break
        threading.Event().wait(0.05)
    assert running(live) >= 3, live.http.get("/metrics").text
    assert live.http.post("/abort_request", json={"rid": "nobody"}).json() == {"aborted": []}
    first = live.http.post("/abort_request", json={"rid": "long0-0"}).json()
    rest = live.http.post("/abort_request", json={"abort_all": True}).json()
    for thread, _ in threads:
        thread.join(30)
    assert first == {"aborted": ["long0-0"]}
    # The abort of long0 reached the engine core before the abort-all (messages keep order).
    assert {"long1-0", "long2-0"} <= set(rest["aborted"]) and "long0-0" not in rest["aborted"]
    for i, (_, got) in enumerate(threads):
        choice = got["out"]["choices"][0]
        assert choice["finish_reason"] == "abort"
        assert choice["token_ids"] == expected([5, i], 200_000)[: len(choice["token_ids"])]
    assert live.http.post("/abort_request", json={"abort_all": True}).json() == {"aborted": []}


def test_bad_calls_get_errors_and_the_key_guards_them(live: Live) -> None:
    bare = httpx.Client(base_url=live.url, timeout=30)
    for method, path in (*SLEEP_PATHS, ("POST", "/abort_request")):
        assert bare.request(method, path).status_code == 401, path
    for params in ({"level": 3}, {"level": "deep"}, {"mode": "later"}):
        r = live.http.post("/sleep", params=params)
        assert r.status_code == 422 and r.json()["error"]["param"] in ("level", "mode")
    r = live.http.post("/wake_up", params={"tags": "gpu"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
    assert "unknown tag 'gpu'" in r.json()["error"]["message"]
    r = live.http.post("/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    assert live.http.post("/abort_request", json={"abort_all": "yes"}).status_code in (400, 422)
    assert live.http.get("/is_sleeping").json() == {"is_sleeping": False}  # nothing changed


def test_the_tape_verifies_after_the_server_stops(live: Live) -> None:
    live.server.stop()
    assert verify(live.tape).ok
    assert postmortem(live.tape).findings == []


def test_sleep_endpoints_are_not_served_unless_asked_for(tmp_path: Path) -> None:
    with ServerProcess("--model", "oracle", "--no-tape") as server:
        for method, path in (*SLEEP_PATHS, ("POST", "/abort_request")):
            assert httpx.request(method, f"{server.url}{path}").status_code == 404, path
