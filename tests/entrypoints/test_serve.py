"""`tokentape serve` with the real openai client against a live server on 127.0.0.1: the
OpenAI endpoints, vLLM's RL endpoints, errors, disconnects and SIGTERM (aborts on the tape,
which verifies)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from serve_process import ServerProcess

from tokentape import SamplingParams
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.engine.runners.oracle_weights import oracle_state_dict
from tokentape.engine.tokenizer import ByteTokenizer
from tokentape.entrypoints.chat_template import ChatTemplate
from tokentape.events import schema as ev
from tokentape.replay import load_tape, verify

TOK = ByteTokenizer()
ORACLE = OracleRunner()
# A stream that runs until it is aborted. max_tokens is capped at max_model_len (the KV
# capacity): with the default 2048 blocks of 4 (8192 tokens) the oracle finished such a
# stream by length in ~0.5 s, within SIGTERM's drain, so it was not aborted. 2**18 blocks
# hold 2**20 tokens: over a minute of stepping, far past any drain or test timeout here.
FOREVER_TOKENS = 1_000_000
KV_BLOCKS = "262144"


def expected(tokens: list[int], max_tokens: int) -> list[int]:
    return ORACLE.expected_stream(tokens, SamplingParams(max_tokens=max_tokens))


class Live:
    def __init__(self, server: ServerProcess, tape: str) -> None:
        self.server, self.tape, self.url = server, tape, server.url
        self.weights = os.path.join(os.path.dirname(tape), "weights")  # --allowed-weight-dirs
        self.client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60
        )


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder = tmp_path_factory.mktemp("serve")
    tape = str(folder / "serve.tape")
    (folder / "weights").mkdir()
    server = ServerProcess(
        "--model",
        "oracle",
        "--tape",
        tape,
        "--block-size",
        "4",
        "--num-kv-blocks",
        KV_BLOCKS,
        "--drain-timeout",
        "0.5",
        "--enable-rl-endpoints",
        "--allowed-weight-dirs",
        str(folder / "weights"),
    )
    try:
        yield Live(server, tape)
    finally:
        server.stop()


def test_models_health_and_metrics(live: Live) -> None:
    models = live.client.models.list()
    assert [m.id for m in models.data] == ["oracle"]
    assert httpx.get(f"{live.url}/health").status_code == 200
    live.client.completions.create(model="oracle", prompt="metrics", max_tokens=3)
    text = httpx.get(f"{live.url}/metrics").text
    assert 'vllm:request_success_total{finished_reason="length",model_name="oracle"}' in text
    assert "vllm:time_to_first_token_seconds_bucket" in text
    assert "vllm:num_requests_running" in text
    # vLLM's names only: no metric is served twice, under tokentape's old names too.
    assert 'vllm:kv_cache_usage_perc{model_name="oracle"}' in text
    assert 'vllm:num_preemptions_total{model_name="oracle"} 0.0' in text
    assert 'vllm:prompt_tokens_total{model_name="oracle"}' in text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert {n for n in names if n.startswith("tokentape:")} <= {
        "tokentape:is_paused",
        "tokentape:engine_step",
        "tokentape:http_errors_total",
    }
    # The engine core runs at the engine's defaults: one lane per CPU, as `generate` does.
    assert load_tape(live.tape).header.config["cpu_threads"] is None


def test_completions_with_a_string_or_token_ids(live: Live) -> None:
    out = live.client.completions.create(
        model="oracle", prompt="Hello", max_tokens=7, extra_body={"return_token_ids": True}
    )
    choice = out.choices[0]
    assert choice.token_ids == expected(TOK.encode("Hello"), 7)  # type: ignore[attr-defined]
    assert choice.text == TOK.decode(choice.token_ids) and choice.finish_reason == "length"  # type: ignore[attr-defined]
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        5,
        7,
    )
    by_ids = live.client.completions.create(model="oracle", prompt=[5, 6, 7], max_tokens=4)
    assert by_ids.choices[0].text == TOK.decode(expected([5, 6, 7], 4))
    batch = live.client.completions.create(model="oracle", prompt=["ab", "cd"], max_tokens=3)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [
        TOK.decode(expected(TOK.encode(p), 3)) for p in ("ab", "cd")
    ]


def test_streamed_completion_equals_the_oracle(live: Live) -> None:
    chunks = list(
        live.client.completions.create(
            model="oracle",
            prompt="stream me",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == TOK.decode(expected(TOK.encode("stream me"), 12))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_completions_with_the_builtin_template(live: Live) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = TOK.encode(ChatTemplate.for_model("oracle").render(messages))
    want = TOK.decode(expected(prompt, 6))
    out = live.client.chat.completions.create(model="oracle", messages=messages, max_tokens=6)  # type: ignore[arg-type]
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    stream = live.client.chat.completions.create(
        model="oracle", messages=messages, max_tokens=6, stream=True
    )  # type: ignore[arg-type]
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_bad_requests_get_openai_errors_and_the_server_serves_on(live: Live) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        live.client.completions.create(model="oracle", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        live.client.completions.create(model="oracle", prompt=[5, 10**6], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="cannot honour presence_penalty"):  # no logits
        live.client.completions.create(
            model="oracle", prompt="x", max_tokens=2, presence_penalty=0.5
        )
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        live.client.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    with pytest.raises(openai.UnprocessableEntityError, match="max_tokens"):
        live.client.completions.create(model="oracle", prompt="x", max_tokens="many")  # type: ignore[arg-type]
    r = httpx.post(
        f"{live.url}/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{live.url}/pause", params={"mode": "nap"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "mode"
    r = httpx.get(f"{live.url}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.post(
        f"{live.url}/update_weights", json={"path": os.path.join(live.weights, "step-1")}
    )
    assert r.status_code == 400 and "pause" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "path"
    # Still serving, and none of the refused requests is on the tape (checked at the end).
    out = live.client.completions.create(model="oracle", prompt=[5, 6], max_tokens=2)
    assert out.choices[0].text == TOK.decode(expected([5, 6], 2))


def test_pause_resume_and_reset_endpoints(live: Live) -> None:
    url = live.url
    assert httpx.post(f"{url}/pause", params={"mode": "keep", "clear_cache": "true"}).json() == {
        "status": "paused"
    }
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
    got: dict[str, Any] = {}
    waiter = threading.Thread(
        target=lambda: got.setdefault(
            "out",
            live.client.completions.create(model="oracle", prompt="while paused", max_tokens=3),
        )
    )
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # queued until resume
    r = httpx.post(f"{url}/update_weights", json={"path": live.weights})
    assert r.status_code == 400 and "no weight files" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/resume").json() == {"status": "resumed"}
    waiter.join(30)
    assert got["out"].choices[0].text == TOK.decode(expected(TOK.encode("while paused"), 3))
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": False}
    assert httpx.post(f"{url}/reset_prefix_cache").json() == {"success": True}


def test_chunked_weight_transfer_endpoints(live: Live) -> None:
    """vLLM's /start_weight_update, /update_weights per chunk (a folder of *.safetensors under
    --allowed-weight-dirs), /finish_weight_update with its weight_version, /weight_info."""
    from safetensors.torch import save_file

    url, new = live.url, oracle_state_dict(5)
    for name, tensors in (
        ("chunk-0", {"lm_head.weight": new["lm_head.weight"]}),
        ("chunk-1", {"embed_tokens.weight": new["embed_tokens.weight"]}),
        ("bad", {"embed_tokens.weight": new["embed_tokens.weight"][:3]}),
    ):
        os.makedirs(os.path.join(live.weights, name))
        save_file(tensors, os.path.join(live.weights, name, "model.safetensors"))
    version = httpx.get(f"{url}/weight_info").json()["weight_version"]
    r = httpx.post(f"{url}/start_weight_update")
    assert r.status_code == 400 and "pause generation first" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}).status_code == 200
    assert httpx.post(f"{url}/start_weight_update").json() == {"status": "ok"}
    chunk = {"path": os.path.join(live.weights, "chunk-0")}
    assert httpx.post(f"{url}/update_weights", json=chunk).json() == {"status": "ok"}
    r = httpx.post(f"{url}/update_weights", json={"path": os.path.join(live.weights, "bad")})
    error = r.json()["error"]
    assert r.status_code == 400 and "'embed_tokens.weight' has shape (3, 8)" in error["message"]
    r = httpx.post(f"{url}/resume")
    assert r.status_code == 400 and "finish_weight_update first" in r.json()["error"]["message"]
    chunk = {"path": os.path.join(live.weights, "chunk-1")}
    assert httpx.post(f"{url}/update_weights", json=chunk).status_code == 200
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": version}  # not yet
    r = httpx.post(f"{url}/finish_weight_update", json={"weight_version": "step-5"})
    assert r.status_code == 200 and r.json()["weight_version"] == "step-5"
    assert r.json()["weights_id"].startswith("sha256:")
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "step-5"}
    r = httpx.post(f"{url}/finish_weight_update")  # nothing open any more
    assert r.status_code == 400 and "no weight update is open" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/resume").json() == {"status": "resumed"}
    out = live.client.completions.create(model="oracle", prompt=[5, 6], max_tokens=2)
    assert out.choices[0].text == TOK.decode(expected([5, 6], 2))  # the oracle ignores weights


def test_a_client_that_disconnects_is_aborted_on_the_tape(live: Live) -> None:
    body = {
        "model": "oracle",
        "prompt": "bye",
        "max_tokens": FOREVER_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{live.url}/v1/completions", json=body, headers={"X-Request-Id": "gone"}
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # Also one that leaves a non-streaming request while it waits.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{live.url}/v1/completions",
            json={**body, "stream": False},
            headers={"X-Request-Id": "gone-too"},
            timeout=0.5,
        )
    live.server.wait_idle()  # both endless requests were aborted when their clients left
    # The aborts are checked on the tape after SIGTERM (test_sigterm_...), the file's last test.


def test_sigterm_aborts_what_is_in_flight_and_the_tape_verifies(live: Live) -> None:
    body = {
        "model": "oracle",
        "prompt": "forever",
        "max_tokens": FOREVER_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    started = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream(
                "POST",
                f"{live.url}/v1/completions",
                json=body,
                headers={"X-Request-Id": "inflight"},
                timeout=60,
            ) as r:
                for _ in r.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    code = live.server.stop()
    t.join(30)
    assert code == 0, live.server.stderr  # a SIGTERM that drained and closed the tape
    assert f"tape: {live.tape}" in live.server.stderr
    assert verify(live.tape).ok
    events = [e for _, e in load_tape(live.tape).events()]
    aborted = {e.req_id for e in events if isinstance(e, ev.RequestAborted)}
    assert {"gone-0", "gone-too-0", "inflight-0"} <= aborted
    refused = ("x", [5, 10**6])
    added = [e for e in events if isinstance(e, ev.RequestAdded)]
    assert not [e for e in added if e.params.max_tokens == 0 or e.prompt_token_ids == refused[1]]


# -- a real model from a checkpoint folder: its chat template, and the RL loop over HTTP --------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    from tokentape.engine.model.loader import builtin_model, save_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    old = save_checkpoint(builtin_model("tiny", seed=0)[1], root / "old")
    new = save_checkpoint(builtin_model("tiny", seed=1)[1], root / "new")
    template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    (root / "old" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(old), str(new)


def test_rl_loop_over_http_with_a_checkpoint(tmp_path: Any, checkpoints: tuple[str, str]) -> None:
    from tokentape import LLM

    old, new = checkpoints
    tape = str(tmp_path / "rl.tape")
    prompts = ["The capital of France is", "Once upon a time"]
    max_tokens = 384  # long enough that the pause comes mid-stream, even on a busy machine
    with ServerProcess(
        "--model",
        old,
        "--tape",
        tape,
        "--enable-rl-endpoints",
        "--allowed-weight-dirs",
        os.path.dirname(new),
    ) as server:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120
        )
        chat = client.chat.completions.create(
            model=old,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        chat_ids = chat.choices[0].token_ids  # type: ignore[attr-defined]
        # The front end (HTTP, the tokenizer) runs without torch: only the engine core loads it
        with (
            open(f"/proc/{server.proc.pid}/maps") as front,
            open(f"/proc/{server.core_pid}/maps") as core,
        ):
            assert "libtorch" not in front.read() and "libtorch" in core.read()

        async def rl_round() -> tuple[list[list[int]], list[int]]:
            tokens: list[list[int]] = [[] for _ in prompts]
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

                async def stream(i: int) -> None:
                    body = {
                        "model": old,
                        "prompt": prompts[i],
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                        "return_token_ids": True,
                    }
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                tokens[i] += json.loads(line[6:])["choices"][0]["token_ids"]

                tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
                while min(map(len, tokens)) < 3:
                    await asyncio.sleep(0.005)
                assert (
                    await http.post("/pause", params={"mode": "keep", "clear_cache": "true"})
                ).status_code == 200
                await asyncio.sleep(0.2)  # the drained tokens reach the clients; nothing new comes
                before = [len(t) for t in tokens]
                r = await http.post("/update_weights", json={"path": new})
                assert r.status_code == 200, r.text
                assert (await http.post("/resume")).status_code == 200
                await asyncio.gather(*tasks)
                return tokens, before

        streams, before = asyncio.run(rl_round())
    assert verify(tape).ok
    # The core settled the server's defaults for the device it runs the model on.
    import torch

    from tokentape.engine.arg_utils import SERVER_CPU_DEFAULTS
    from tokentape.engine.config import EngineConfig

    config = load_tape(tape).config
    limits = {name: getattr(config, name) for name in SERVER_CPU_DEFAULTS}
    on_cpu = not torch.cuda.is_available()
    assert limits == (
        SERVER_CPU_DEFAULTS if on_cpu else {n: getattr(EngineConfig(), n) for n in limits}
    )
    assert all(0 < b < max_tokens for b in before), before
    # A plain run: the old weights up to the pause, the new ones from that prefix on.
    with LLM(old, tape=None) as llm_old, LLM(new, tape=None) as llm_new:
        rendered = ChatTemplate.for_model(old).render([{"role": "user", "content": "Hi"}])
        greedy = SamplingParams(max_tokens=3, temperature=0)
        assert (
            chat_ids
            == llm_old.generate([llm_old.tokenizer.encode(rendered)], greedy)[0]
            .outputs[0]
            .token_ids
        )
        for i, text in enumerate(prompts):
            prompt = llm_old.tokenizer.encode(text)
            p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            prefix = llm_old.generate([prompt], p)[0].outputs[0].token_ids[: before[i]]
            rest = SamplingParams(
                max_tokens=max_tokens - len(prefix), temperature=0, ignore_eos=True
            )
            assert (
                streams[i]
                == prefix + llm_new.generate([prompt + prefix], rest)[0].outputs[0].token_ids
            )
