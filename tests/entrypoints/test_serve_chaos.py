"""A chaos suite for `tokentape serve`, on 127.0.0.1, bounded in count and time: good clients
stream while others send floods of stop strings and bad words, malformed bodies and bad
checkpoint folders to /update_weights (each between a pause and a resume), the engine core
is killed mid-stream, and the server is SIGTERMed under load.

Each scenario asserts that no good request waited longer than a bound measured on a 2-core
machine (docs/benchmarks.md, Serving under chaos), that every tape verifies, and that nothing
was lost: every token a client received is on the tape, as delivered there."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import ServerProcess

from tokentape import LLM, SamplingParams
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.events import schema as ev
from tokentape.replay import load_tape, verify

# The longest a good request may wait for its first token, and for its whole stream of
# GOOD_TOKENS tokens, while the chaos runs. Measured on a 2-core machine over 16 runs of the
# scenario below: first token at most 0.19 s (median 0.03 s), whole stream at most 0.17 s;
# the bounds leave 10x for a loaded machine. Before this suite's fixes, the bad-words flood
# alone stalled every client for minutes and the first bad folder ended the engine.
FIRST_TOKEN_BOUND_S = 2.0
STREAM_BOUND_S = 2.0
GOOD_CLIENTS, GOOD_TOKENS = 6, 12
CHAOS_CYCLES = 2


@dataclass
class Stream:
    """What one streaming client got."""

    req_id: str
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    status: int = 0
    first_token_s: float | None = None
    total_s: float | None = None


async def stream(http: httpx.AsyncClient, req_id: str, body: dict[str, Any]) -> Stream:
    """Stream a completion, reading every SSE event (an error event and [DONE] included)."""
    got, start = Stream(req_id), time.monotonic()
    body = {**body, "stream": True, "return_token_ids": True}
    try:
        async with http.stream(
            "POST", "/v1/completions", json=body, headers={"X-Request-Id": req_id}
        ) as r:
            got.status = r.status_code
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    got.done = True
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if "error" in data:
                        got.error = data["error"]
                    for choice in data.get("choices", ()):
                        if choice.get("token_ids") and got.first_token_s is None:
                            got.first_token_s = time.monotonic() - start
                        got.tokens += choice.get("token_ids") or []
                        got.finish = choice["finish_reason"] or got.finish
    except httpx.HTTPError as exc:  # a cut connection: recorded as such, asserted by the caller
        got.error = {"cut": repr(exc)}
    got.total_s = time.monotonic() - start
    return got


def delivered(tape: str) -> dict[str, list[int]]:
    """Every request's tokens as the tape says they were delivered to its client."""
    out: dict[str, list[int]] = {}
    for _, e in load_tape(tape).events():
        if isinstance(e, ev.OutputsEmitted):
            for entry in e.entries:
                out.setdefault(entry.req_id, []).extend(entry.token_ids)
    return out


def bad_checkpoints(root: Path) -> list[str]:
    """Folders /update_weights must refuse, each in its own way (inside the allowed folder),
    and paths outside it."""
    from safetensors.torch import load_file, save_file

    from tokentape.engine.model.loader import builtin_model, save_checkpoint

    good = Path(save_checkpoint(builtin_model("tiny", 0)[1], root / "good"))
    config = json.loads((good / "config.json").read_text())
    kinds = {
        "list-config": {"config.json": "[1, 2, 3]"},
        "not-json": {"config.json": "{not json"},
        "empty": {},
        "zero-heads": {"config.json": json.dumps({**config, "num_attention_heads": 0})},
        "wrong-shape": {"config.json": json.dumps(config)},
        "garbage-weights": {"config.json": json.dumps(config), "model.safetensors": "\x00" * 64},
    }
    paths = []
    for name, files in kinds.items():
        (root / name).mkdir()
        if name == "wrong-shape":  # the good weights, one of them a row short
            tensors = load_file(good / "model.safetensors")
            first = min(tensors)
            tensors[first] = tensors[first][:-1].contiguous()
            save_file(tensors, root / name / "model.safetensors")
        for file, text in files.items():
            (root / name / file).write_text(text)
        paths.append(str(root / name))
    (root / "a-file").write_text("not a folder")
    return [*paths, str(root / "a-file"), "/etc", "/etc/passwd", str(root / ".." / "outside")]


async def chaos_actions(http: httpx.AsyncClient, folders: list[str]) -> dict[str, int]:
    """Bad and heavy calls, CHAOS_CYCLES times over: each must be refused (or served) without
    disturbing anyone else. Returns how many of each kind were sent."""
    sent: dict[str, int] = {}
    heavy = {"prompt": [9, 9, 9], "max_tokens": 8, "temperature": 0}

    async def expect(kind: str, status: int, *args: Any, **kwargs: Any) -> None:
        r = await http.post(*args, **kwargs)
        assert r.status_code == status, (kind, r.text)
        sent[kind] = sent.get(kind, 0) + 1

    for _ in range(CHAOS_CYCLES):
        await expect(
            "bad_words_flood",
            400,
            "/v1/completions",
            json={**heavy, "bad_words": [f"w{i}" for i in range(100_000)]},
        )
        await expect("stop_flood", 400, "/v1/completions", json={**heavy, "stop": ["s"] * 100_000})
        await expect(
            "bad_words_at_limit",
            200,
            "/v1/completions",
            json={**heavy, "bad_words": [f"w{i}" for i in range(1024)]},
        )
        await expect(
            "stop_at_limit",
            200,
            "/v1/completions",
            json={**heavy, "stop": [f"{i:064d}" for i in range(64)]},
        )
        await expect(
            "deep_json",
            400,
            "/v1/completions",
            headers={"content-type": "application/json"},
            content=b'{"prompt": "x", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        )
        await expect("huge_id", 400, "/v1/completions", json={"prompt": [5, 2**64]})
        await expect("context", 400, "/v1/completions", json={"prompt": [5], "max_tokens": 10**12})
        for folder in folders:
            await expect("pause", 200, "/pause", params={"mode": "keep", "clear_cache": "true"})
            r = await http.post("/update_weights", json={"path": folder})
            assert r.status_code in (400, 403) and r.json()["error"]["param"] == "path", r.text
            sent["bad_update"] = sent.get("bad_update", 0) + 1
            await expect("resume", 200, "/resume")
    return sent


def test_good_clients_are_served_through_floods_and_bad_updates(tmp_path: Path) -> None:
    allowed = tmp_path / "weights"
    allowed.mkdir()
    folders = bad_checkpoints(allowed)
    tape = str(tmp_path / "chaos.tape")
    prompts = [[5 + i, 6, 7, 8] for i in range(GOOD_CLIENTS)]
    with ServerProcess(
        "--model",
        "tiny",
        "--tape",
        tape,
        "--num-kv-blocks",
        "256",
        "--enable-rl-endpoints",
        "--allowed-weight-dirs",
        str(allowed),
    ) as server:

        async def main() -> tuple[list[Stream], dict[str, int]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                chaos = asyncio.create_task(chaos_actions(http, folders))
                goods: list[Stream] = []
                r = 0
                while not chaos.done() or r < 2:  # rounds of good clients, all through the chaos
                    goods += await asyncio.gather(
                        *(
                            stream(
                                http,
                                f"good-{r}-{i}",
                                {
                                    "prompt": p,
                                    "max_tokens": GOOD_TOKENS,
                                    "temperature": 0,
                                    "ignore_eos": True,
                                },
                            )
                            for i, p in enumerate(prompts)
                        )
                    )
                    r += 1
                return goods, await chaos

        start = time.monotonic()
        goods, sent = asyncio.run(main())
        elapsed = time.monotonic() - start
        assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.proc.returncode == 0, server.stderr
    assert sent["bad_update"] == CHAOS_CYCLES * len(folders), sent
    with LLM("tiny", tape=None, num_kv_blocks=64) as llm:  # what each good client must get
        want = [
            o.outputs[0].token_ids
            for o in llm.generate(
                prompts, SamplingParams(max_tokens=GOOD_TOKENS, temperature=0, ignore_eos=True)
            )
        ]
    waits = sorted(g.first_token_s or 1e9 for g in goods)
    totals = sorted(g.total_s or 1e9 for g in goods)
    print(
        f"\nchaos: {len(goods)} good streams in {elapsed:.1f} s, first token median "
        f"{waits[len(waits) // 2]:.3f} s, max {waits[-1]:.3f} s; whole stream max "
        f"{totals[-1]:.3f} s; sent {sent}"
    )
    on_tape = delivered(tape)
    for g in goods:
        i = int(g.req_id.rsplit("-", 1)[1])
        assert g.status == 200 and g.done and g.error is None and g.finish == "length", g
        assert g.tokens == want[i] == on_tape[f"{g.req_id}-0"], g.req_id
    assert waits[-1] < FIRST_TOKEN_BOUND_S and totals[-1] < STREAM_BOUND_S, (waits, totals)
    assert verify(tape).ok
    added = {e.req_id for _, e in load_tape(tape).events() if isinstance(e, ev.RequestAdded)}
    assert {f"{g.req_id}-0" for g in goods} <= added
    assert not [
        e for _, e in load_tape(tape).events() if isinstance(e, (ev.EngineError, ev.WeightsUpdated))
    ]


def test_a_core_killed_mid_stream_loses_nothing(tmp_path: Path) -> None:
    tape = str(tmp_path / "killed.tape")
    server = ServerProcess("--model", "oracle", "--tape", tape, "--drain-timeout", "5")
    try:

        async def main() -> list[Stream]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                body = {"max_tokens": 30_000, "ignore_eos": True}
                tasks = [
                    asyncio.create_task(stream(http, f"s{i}", {**body, "prompt": [5 + i, 6]}))
                    for i in range(8)
                ]
                # Every stream under way: each request's tokens delivered for many steps, so
                # its client has its first ones whatever the machine's load (a tape's length
                # alone said nothing of the last request admitted).
                ids = [f"s{i}-0" for i in range(8)]
                while min(len(delivered(tape).get(r, ())) for r in ids) < 20:
                    await asyncio.sleep(0.02)
                os.kill(server.core_pid, signal.SIGKILL)
                return await asyncio.gather(*tasks)

        streams = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        code = server.stop()
    assert code == 1, server.stderr
    on_tape = delivered(tape)
    oracle = OracleRunner()
    for s in streams:
        assert s.done and s.error is not None and s.error.get("code") == 503, s
        full = on_tape[f"{s.req_id}-0"]
        assert s.tokens == full[: len(s.tokens)], s.req_id  # what the client got, as on the tape
        assert full == oracle.expected_stream(
            [5 + int(s.req_id[1:]), 6], SamplingParams(max_tokens=len(full), ignore_eos=True)
        )
    assert verify(tape).ok


@pytest.mark.parametrize("drain_s", [2.0])
def test_sigterm_under_load_drains_and_exits_0_in_time(tmp_path: Path, drain_s: float) -> None:
    tape = str(tmp_path / "sigterm.tape")
    server = ServerProcess("--model", "oracle", "--tape", tape, "--drain-timeout", str(drain_s))
    oracle = OracleRunner()
    try:

        async def main() -> tuple[list[Stream], float]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                short = [
                    asyncio.create_task(
                        stream(http, f"short{i}", {"prompt": [5 + i], "max_tokens": 64})
                    )
                    for i in range(8)
                ]
                long = [
                    asyncio.create_task(
                        stream(
                            http,
                            f"long{i}",
                            {"prompt": [9 + i], "max_tokens": 30_000, "ignore_eos": True},
                        )
                    )
                    for i in range(8)
                ]
                # Every request admitted and under way before the signal: SIGTERM stops taking
                # requests, so one still in the listener's backlog would be refused, not drained.
                ids = [f"short{i}-0" for i in range(8)] + [f"long{i}-0" for i in range(8)]
                while min(len(delivered(tape).get(r, ())) for r in ids) < 1:
                    await asyncio.sleep(0.01)
                signalled = time.monotonic()
                os.kill(server.proc.pid, signal.SIGTERM)
                streams = await asyncio.gather(*short, *long)
                await asyncio.to_thread(server.proc.wait, 60)
                return streams, time.monotonic() - signalled

        streams, exit_s = asyncio.run(main())
    finally:
        code = server.stop()
    print(
        f"\nSIGTERM under load: exited {code} {exit_s:.2f} s after the signal (drain {drain_s} s)"
    )
    assert code == 0, server.stderr
    # The drain, the aborted streams' last chunks, the core closing the tape: well within.
    assert exit_s < drain_s + 5.0
    on_tape = delivered(tape)
    for s in streams:
        assert s.done and s.error is None, s  # every stream ended with [DONE], none was cut
        assert s.tokens == on_tape[f"{s.req_id}-0"], s.req_id
        prompt = (
            [5 + int(s.req_id[5:])] if s.req_id.startswith("short") else [9 + int(s.req_id[4:])]
        )
        assert s.tokens == oracle.expected_stream(
            prompt, SamplingParams(max_tokens=len(s.tokens), ignore_eos=True)
        )
        assert s.finish == (
            "length" if s.req_id.startswith("short") or len(s.tokens) == 30_000 else "abort"
        )
    assert verify(tape).ok
