"""`tokentape serve` under bad calls: API keys, the RL endpoints only when asked for,
/update_weights only under --allowed-weight-dirs (revealing nothing of the rest of the disk),
bounded work per request with every refusal naming its `param`, JSON that is malformed in
the ways that used to give 500s, and the exit statuses the CLI documents."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import ServerProcess

from tokentape.events import schema as ev
from tokentape.replay import load_tape, verify

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Live:
    def __init__(self, server: ServerProcess, tape: str, weights: Path) -> None:
        self.server, self.tape, self.weights, self.url = server, tape, weights, server.url
        self.http = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kwargs)

    def refused(self, path: str, body: dict[str, Any], status: int = 400) -> dict[str, Any]:
        r = self.post(path, body)
        assert r.status_code == status, r.text
        return r.json()["error"]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("reliable")
    tape, weights = str(root / "serve.tape"), root / "weights"
    weights.mkdir()
    server = ServerProcess(
        "--model",
        "oracle",
        "--tape",
        tape,
        "--block-size",
        "4",
        "--num-kv-blocks",
        "64",
        "--enable-rl-endpoints",
        "--allowed-weight-dirs",
        str(weights),
        env={"TOKENTAPE_API_KEY": KEY},
    )
    try:
        yield Live(server, tape, weights)
    finally:
        assert server.stop() == 0, server.stderr


def test_the_api_key_guards_v1_and_the_rl_endpoints(live: Live) -> None:
    bare = httpx.Client(base_url=live.url, timeout=30)
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/pause"),
        ("GET", "/is_paused"),
        ("POST", "/update_weights"),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = bare.request(method, path, headers=headers, json={"prompt": "x"})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "AuthenticationError"
    assert bare.get("/health").status_code == 200 and bare.get("/metrics").status_code == 200
    assert live.http.get("/v1/models").json()["data"][0]["id"] == "oracle"
    assert live.http.get("/is_paused").json() == {"is_paused": False}


def test_update_weights_loads_only_under_the_allowed_folders(live: Live, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (live.weights / "link").symlink_to(outside)
    messages = set()
    for path in (
        "/etc/passwd",
        "/etc",
        "/no/such/folder",
        str(outside),
        str(live.weights / "link"),
        str(live.weights / ".." / "elsewhere"),
    ):
        error = live.refused("/update_weights", {"path": path}, 403)
        assert error["param"] == "path"
        messages.add(error["message"])
    assert len(messages) == 1  # the same answer whatever exists there
    assert "passwd" not in messages.pop()
    assert live.refused("/update_weights", {"path": "relative/dir"})["param"] == "path"
    # Under the allowed folder: the engine's own refusal (no weight files there), a 400.
    assert live.post("/pause", params={"mode": "keep"}).status_code == 200
    bad = live.weights / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("[1, 2]")
    for folder in (bad, live.weights / "missing"):
        error = live.refused("/update_weights", {"path": str(folder)})
        assert error["param"] == "path"
    assert live.post("/resume").status_code == 200
    out = live.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}).json()
    assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param", "text"),
    [
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 10**12},
            "max_tokens",
            "maximum context length is 256",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 256},
            "max_tokens",
            "maximum context length",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be"),
        (
            "/v1/completions",
            {"prompt": "x", "temperature": -1},
            "temperature",
            "temperature must be",
        ),
        ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p", "top_p must be"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n must be"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed", "seed must be"),
        ("/v1/completions", {"prompt": "x", "logprobs": 1000}, "logprobs", "at most 20"),
        ("/v1/completions", {"prompt": [5, 2**64]}, "prompt", "prompt_token_ids[1] must be"),
        ("/v1/completions", {"prompt": [[5], [6, 10**6]]}, "prompt", "vocabulary"),
        (
            "/v1/completions",
            {"prompt": "x", "stop_token_ids": [2**70]},
            "stop_token_ids",
            "stop_token_ids",
        ),
        ("/v1/completions", {"prompt": "x", "stop": ["s"] * 100_000}, "stop", "at most 64 strings"),
        (
            "/v1/completions",
            {"prompt": "x", "presence_penalty": 0.5},
            "presence_penalty",
            "cannot honour",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "logprobs": True,
                "top_logprobs": 1000,
            },
            "top_logprobs",
            "at most 20",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000},
            "max_completion_tokens",
            "context length",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 300}]},
            "messages",
            "input tokens. Please reduce",
        ),
    ],
)
def test_every_refusal_names_its_param(
    live: Live, path: str, body: dict[str, Any], param: str, text: str
) -> None:
    error = live.refused(path, body)
    assert error["param"] == param and text in error["message"], error


def test_a_flood_of_bad_words_is_refused_at_once(live: Live) -> None:
    body = {"prompt": "x", "bad_words": [f"w{i}" for i in range(100_000)]}
    r = live.post("/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"
    assert r.elapsed.total_seconds() < 5


@pytest.mark.parametrize(
    ("data", "status", "text"),
    [
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 422, "Expected `int`"),
        (
            b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            400,
            "nested too deeply",
        ),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "deep": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}]}]}",
            400,
            "nested too deeply",
        ),
        (b'{"prompt": "\\ud800 lone"}', 400, "lone UTF-16 surrogate"),
        (b'{"prompt": "ok", "stop": ["\\udfff"]}', 400, "lone UTF-16 surrogate"),
        (b"{nope", 400, "not valid JSON"),
    ],
)
def test_malformed_json_is_a_clear_4xx_never_a_500(
    live: Live, data: bytes, status: int, text: str
) -> None:
    path = "/v1/chat/completions" if b"messages" in data else "/v1/completions"
    r = live.http.post(path, content=data, headers={"content-type": "application/json"})
    assert r.status_code == status and text in r.json()["error"]["message"], r.text
    if b"ud800" in data:
        assert r.json()["error"]["param"] == "prompt"


def test_nothing_refused_is_on_the_tape(live: Live) -> None:
    """Last of the module's tests that send requests: none of the refused ones is on the tape."""
    live.post(
        "/v1/completions",
        {"prompt": [7, 8], "max_tokens": 3},
        headers={**AUTH, "X-Request-Id": "good"},
    )
    live.server.wait_idle()
    events = [e for _, e in load_tape(live.tape).events()]  # read while it is written
    added = [
        (e.prompt_token_ids, e.params.max_tokens) for e in events if isinstance(e, ev.RequestAdded)
    ]
    assert sorted(added) == [([5, 6], 2), ([7, 8], 3)], added


def test_rl_endpoints_are_not_served_unless_asked_for(tmp_path: Path) -> None:
    with ServerProcess("--model", "oracle", "--no-tape") as server:
        for path in ("/pause", "/resume", "/reset_prefix_cache", "/update_weights"):
            assert httpx.post(f"{server.url}{path}", json={"path": "/x"}).status_code == 404
        assert httpx.get(f"{server.url}/is_paused").status_code == 404
        assert httpx.get(f"{server.url}/v1/models").status_code == 200  # no key asked for
    with ServerProcess(
        "--model", "oracle", "--no-tape", env={"VLLM_SERVER_DEV_MODE": "1"}
    ) as server:
        assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": False}
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(tmp_path)})
        assert r.status_code == 403 and "--allowed-weight-dirs" in r.json()["error"]["message"]


def test_a_port_in_use_exits_2_with_one_line(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tokentape.entrypoints.api_server",
                "--model",
                "oracle",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--tape",
                str(tmp_path / "t.tape"),
            ],
            capture_output=True,
            check=False,
            text=True,
            timeout=120,
        )
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    assert not (tmp_path / "t.tape").exists()  # refused before the engine (and its tape) was made


def test_a_core_that_dies_mid_stream_ends_each_stream_cleanly(tmp_path: Path) -> None:
    """Each open stream gets vLLM's error event and [DONE]; the server drains and exits 1."""
    tape = str(tmp_path / "dies.tape")
    server = ServerProcess("--model", "oracle", "--tape", tape, "--drain-timeout", "5")
    try:
        body = {"prompt": "forever", "max_tokens": 30_000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(server.core_pid, 9)
            rest = [line for line in lines if line]
    finally:
        code = server.stop()
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert rest[-1] == "data: [DONE]" and error["code"] == 503, rest[-3:]
    assert (
        error["type"] == "ServiceUnavailableError" and "was killed by SIGKILL" in error["message"]
    )
    assert code == 1, server.stderr
    assert "engine core failed while serving" in server.stderr
    assert "response already started" not in server.stderr and "Traceback" not in server.stderr
    assert verify(tape).ok


def test_health_turns_503_when_the_core_dies() -> None:
    """In-process (the server itself stops at once when its core dies, so /health is read
    here, over the app): 200 while serving, 503 once the core is gone, and requests a 503."""
    from tokentape import AsyncLLM
    from tokentape.entrypoints.api_server import build_app

    engine = AsyncLLM("oracle", tape=False)

    async def main() -> None:
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            body = {"prompt": [5, 6], "max_tokens": 2}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            assert (await http.get("/health")).status_code == 200
            os.kill(engine.engine_core.proc.pid, 9)  # type: ignore[attr-defined]
            for _ in range(100):
                if engine.errored:
                    break
                await asyncio.sleep(0.05)
            health = await http.get("/health")
            assert health.status_code == 503, health.text
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert engine.failure is not None and "was killed by SIGKILL" in engine.failure


def test_a_missing_allowed_weight_dir_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokentape import cli

    missing = str(tmp_path / "missing")
    code = cli.main(["serve", "--model", "oracle", "--no-tape", "--allowed-weight-dirs", missing])
    assert code == 2
    assert (
        capsys.readouterr().err == f"error: --allowed-weight-dirs: {missing} is not a directory\n"
    )
