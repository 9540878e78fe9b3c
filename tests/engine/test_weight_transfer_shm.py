"""vLLM's weight transfer engine with tokentape's "shm" backend (engine/weight_transfer.py):
the trainer's tensors go in buckets through shared memory, each bucket one chunk of the
engine's transfer (start_weight_update, update_weights(update_info) per bucket,
finish_weight_update). Through AsyncLLM with the engine core in its own process, and over
HTTP (the app in process, and a server process with send_mode="http"): one
WeightChunkReceived per bucket, the tokens of an engine given the same state_dict, a refused
bucket that records nothing and leaves the transfer open, and no block left in /dev/shm."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serve_process import ServerProcess

from tokentape import LLM, AsyncLLM, SamplingParams
from tokentape.cli import main
from tokentape.engine.model.loader import builtin_model, tensor_sha256
from tokentape.engine.weight_transfer import (
    SHM_PREFIX,
    ShmTrainerSendWeightsArgs,
    ShmWeightTransferEngine,
    WeightTransferConfig,
    check_update_info,
)
from tokentape.entrypoints.api_server import ServerOptions, build_app
from tokentape.events import schema as ev
from tokentape.replay import load_tape
from tokentape.replay.verify import verify

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [84, 107, 104, 35, 119, 100, 115, 104]
BUCKET = 4 << 20  # the tiny model's 13 MB in 4 buckets
SHM = WeightTransferConfig(backend="shm")
ENGINE_ARGS: dict[str, Any] = {"max_model_len": 64, "num_kv_blocks": 16}


def new_weights() -> dict[str, torch.Tensor]:
    return builtin_model("tiny", seed=1)[1].state_dict()


def blocks_left() -> list[str]:
    """The trainer's blocks still in /dev/shm (every one should be unlinked once sent)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX))


def reference(weights: dict[str, torch.Tensor]) -> tuple[str, list[int]]:
    """An engine given the same weights whole (update_weights(state_dict)): their SHA-256 and
    its greedy tokens."""
    llm = LLM("tiny", tape=None, **ENGINE_ARGS)
    try:
        llm.llm_engine.pause_generation(mode="keep")
        weights_id = llm.llm_engine.update_weights(weights)
        llm.llm_engine.resume_generation()
        tokens = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    finally:
        llm.close()
    assert weights_id is not None
    return weights_id, list(tokens)


def thread_sender(
    loop: asyncio.AbstractEventLoop, send: Callable[[dict[str, Any]], Any], sent: list[Any]
) -> Callable[[dict[str, Any]], None]:
    """send_mode for a trainer on a thread of its own: each bucket's update_info handed to an
    engine coroutine on the event loop, waited for (a refusal raises here)."""

    def deliver(info: dict[str, Any]) -> None:
        assert info["shm_name"] in blocks_left()  # the block exists while it is sent
        sent.append(info)
        asyncio.run_coroutine_threadsafe(send(info), loop).result(timeout=120)

    return deliver


def check_chunks(tape: Path, sent: list[dict[str, Any]], weights: dict[str, torch.Tensor]) -> None:
    """One WeightChunkReceived per bucket sent and taken, with its tensors' names and hashes,
    then the transfer's WeightsUpdated; the tape verifies."""
    events = [e for _, e in load_tape(tape).events()]
    chunks = [e for e in events if isinstance(e, ev.WeightChunkReceived)]
    assert len(chunks) == len(sent) >= 3
    for chunk, info in zip(chunks, sent):
        assert chunk.names == sorted(info["names"])
        assert chunk.hashes == [tensor_sha256(n, weights[n]) for n in chunk.names]
    last = events.index(chunks[-1])
    assert any(isinstance(e, ev.WeightsUpdated) and e.weight_version == "v1" for e in events[last:])
    assert verify(tape).ok


def test_buckets_through_async_llm_with_the_core_in_its_own_process(tmp_path: Path) -> None:
    weights = new_weights()
    want_id, want_tokens = reference(weights)
    tape = tmp_path / "shm.tape"
    engine = AsyncLLM(
        "tiny", tape=str(tape), multiprocess_mode=True, weight_transfer_config=SHM, **ENGINE_ARGS
    )
    sent: list[dict[str, Any]] = []

    async def run() -> tuple[str, list[int]]:
        loop = asyncio.get_running_loop()
        await engine.init_weight_transfer_engine({})
        await engine.pause_generation(mode="keep")
        await engine.start_weight_update()
        args = ShmTrainerSendWeightsArgs(
            thread_sender(loop, engine.update_weights, sent), bucket_size_bytes=BUCKET
        )
        send = ShmWeightTransferEngine.trainer_send_weights
        await asyncio.to_thread(send, weights.items(), args)
        assert blocks_left() == []
        # A refused bucket (a wrong shape): an error, nothing recorded, the transfer open.
        bad = [("model.norm.weight", torch.ones(3))]
        with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
            await asyncio.to_thread(send, bad, ShmTrainerSendWeightsArgs(args.send_mode))
        sent.pop()  # delivered, refused: not on the tape
        assert blocks_left() == []
        with pytest.raises(RuntimeError, match=f"{len(sent)} chunk\\(s\\) received"):
            await engine.resume_generation()
        weights_id = await engine.finish_weight_update("v1")
        await engine.resume_generation()
        out = [o async for o in engine.generate(PROMPT, GREEDY, "after")][-1]
        assert out.outputs[0].weight_versions == ["v1"] * GREEDY.max_tokens
        return weights_id, list(out.outputs[0].token_ids)

    try:
        got_id, got_tokens = asyncio.run(run())
    finally:
        engine.shutdown()
    assert (got_id, got_tokens) == (want_id, want_tokens)
    check_chunks(tape, sent, weights)
    header = load_tape(tape).header
    assert header.config["weight_transfer_config"] == {"backend": "shm"}


def test_buckets_over_http_with_the_app_in_process(tmp_path: Path) -> None:
    weights = new_weights()
    want_id, want_tokens = reference(weights)
    tape = tmp_path / "http.tape"
    engine = AsyncLLM(
        "tiny", tape=str(tape), multiprocess_mode=False, weight_transfer_config=SHM, **ENGINE_ARGS
    )
    options = ServerOptions(enable_rl_endpoints=True)
    sent: list[dict[str, Any]] = []

    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        transport = httpx.ASGITransport(app=build_app(engine, options=options))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:

            async def post(info: dict[str, Any]) -> None:
                r = await http.post("/update_weights", json={"update_info": info})
                if r.status_code != 200:
                    raise RuntimeError(r.json()["error"]["message"])
                assert r.json() == {"status": "ok"}

            r = await http.post("/init_weight_transfer_engine", json={"init_info": {"x": 1}})
            assert r.status_code == 400 and "init_info.x: unknown field" in r.text
            r = await http.post("/init_weight_transfer_engine", json={"init_info": {}})
            assert r.json() == {"status": "ok"}
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
            assert (await http.post("/start_weight_update")).json() == {"status": "ok"}
            args = ShmTrainerSendWeightsArgs(
                thread_sender(loop, post, sent), bucket_size_bytes=BUCKET
            )
            send = ShmWeightTransferEngine.trainer_send_weights
            await asyncio.to_thread(send, weights.items(), args)
            bad = [("model.norm.weight", torch.ones(3))]
            with pytest.raises(RuntimeError, match=r"'model.norm.weight' has shape \(3,\)"):
                await asyncio.to_thread(send, bad, args)
            sent.pop()
            assert blocks_left() == []
            # A malformed update_info is a 400 naming the field; a body with neither form too.
            info = {**sent[0], "offsets": sent[0]["offsets"][:-1]}
            r = await http.post("/update_weights", json={"update_info": info})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"].startswith("update_info.offsets: holds")
            r = await http.post("/update_weights", json={})
            assert r.status_code == 400 and "one of them" in r.text
            r = await http.post("/finish_weight_update", json={"weight_version": "v1"})
            assert r.status_code == 200, r.text
            assert (await http.post("/resume")).status_code == 200
            body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
            r = await http.post("/v1/completions", json={**body, "return_token_ids": True})
            return r.json()["choices"][0]["token_ids"]

    try:
        tokens = asyncio.run(run())
    finally:
        engine.shutdown()
    assert tokens == want_tokens
    check_chunks(tape, sent, weights)
    updated = [e for _, e in load_tape(tape).events() if isinstance(e, ev.WeightsUpdated)]
    assert [e.weights_id for e in updated] == [want_id]


def test_send_mode_http_against_a_server_process(tmp_path: Path) -> None:
    """send_mode="http": the trainer POSTs each bucket to a `tokentape serve` process (behind
    its API key); a refused bucket raises with the server's message, and no block is left."""
    weights = new_weights()
    tape = tmp_path / "serve.tape"
    with ServerProcess(
        "--model",
        "tiny",
        "--tape",
        str(tape),
        "--max-model-len",
        "64",
        "--num-kv-blocks",
        "16",
        "--enable-rl-endpoints",
        "--api-key",
        "k",
        "--weight-transfer-config",
        '{"backend": "shm"}',
    ) as server:
        auth = {"Authorization": "Bearer k"}
        assert httpx.post(f"{server.url}/init_weight_transfer_engine").status_code == 401
        r = httpx.post(f"{server.url}/init_weight_transfer_engine", headers=auth, json={})
        assert r.json() == {"status": "ok"}
        httpx.post(f"{server.url}/pause", params={"mode": "keep"}, headers=auth)
        httpx.post(f"{server.url}/start_weight_update", headers=auth).raise_for_status()
        args = ShmTrainerSendWeightsArgs(
            "http", url=server.url, api_key="k", bucket_size_bytes=BUCKET
        )
        ShmWeightTransferEngine.trainer_send_weights(weights.items(), args)
        with pytest.raises(RuntimeError, match=r"refused the bucket \(400\): .*has shape \(3,\)"):
            ShmWeightTransferEngine.trainer_send_weights(
                [("model.norm.weight", torch.ones(3))], args
            )
        assert blocks_left() == []
        r = httpx.post(
            f"{server.url}/finish_weight_update", headers=auth, json={"weight_version": "v1"}
        )
        assert r.json()["weight_version"] == "v1"
    chunks = [e for _, e in load_tape(tape).events() if isinstance(e, ev.WeightChunkReceived)]
    assert len(chunks) == 4 and sum(len(c.names) for c in chunks) == len(weights)
    assert verify(tape).ok


def test_gpu_backends_and_an_engine_without_the_config_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for backend in ("nccl", "ipc"):
        with pytest.raises(ValueError, match=f"backend '{backend}' needs GPUs"):
            WeightTransferConfig(backend=backend)
        with pytest.raises(ValueError, match="needs GPUs; this engine moves weights through"):
            AsyncLLM("tiny", weight_transfer_config={"backend": backend})
    assert main(["generate", "--weight-transfer-config", '{"backend": "nccl"}', "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--weight-transfer-config: weight_transfer_config: backend 'nccl' needs GPUs" in err[-1]
    assert main(["generate", "--weight-transfer-config", "shm", "hello"]) == 2
    assert "expected JSON such as" in capsys.readouterr().err
    llm = LLM("tiny", tape=None, **ENGINE_ARGS)
    try:
        with pytest.raises(RuntimeError, match="init_weight_transfer_engine: the engine has no"):
            llm.llm_engine.init_weight_transfer_engine()
        llm.llm_engine.pause_generation(mode="keep")
        llm.llm_engine.start_weight_update()
        with pytest.raises(RuntimeError, match="update_weights: the engine has no weight transfer"):
            llm.llm_engine.update_weights(
                {"shm_name": "x", "names": [], "dtype_names": [], "shapes": [], "offsets": []}
            )
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"shm_name": "a/b"}, "shm_name"),
        ({"names": ["w", "w"]}, "names[1]"),
        ({"dtype_names": ["float32", "complex64"]}, "dtype_names[1]"),
        ({"shapes": [[2], [2, -1]]}, "shapes[1]"),
        ({"offsets": [0, 7]}, "offsets[1]"),
        ({"offsets": [0]}, "offsets"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_bad_update_info_names_its_field(change: dict[str, Any], field: str) -> None:
    good = {
        "shm_name": "tokentape_wt_x",
        "names": ["v", "w"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[2], [3]],
        "offsets": [0, 64],
    }
    assert check_update_info(good).nbytes == [8, 6]
    with pytest.raises(ValueError, match="^update_info." + re.escape(field)):
        check_update_info({**good, **change})


def test_a_bucket_whose_tensors_run_past_its_block_is_refused_unrecorded() -> None:
    """The block's bounds are checked once attached, before the engine takes anything; the
    trainer's block is unlinked all the same (a bucket that fails inside the send too)."""
    llm = LLM("tiny", tape=None, weight_transfer_config=SHM, **ENGINE_ARGS)
    engine = llm.llm_engine
    try:
        engine.init_weight_transfer_engine()
        engine.pause_generation(mode="keep")
        engine.start_weight_update()

        def too_long(info: dict[str, Any]) -> None:
            engine.update_weights({**info, "shapes": [[1 << 20]]})

        args = ShmTrainerSendWeightsArgs(too_long)
        bad_shape = [("model.norm.weight", torch.ones(3))]
        with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
            ShmWeightTransferEngine.trainer_send_weights(
                bad_shape, ShmTrainerSendWeightsArgs(engine.update_weights)
            )
        assert engine.engine_core.weight_transfer is not None
        assert engine.engine_core.weight_transfer._lingering == []  # closed though refused
        with pytest.raises(ValueError, match=r"update_info.offsets\[0\]: .* ends past the block"):
            ShmWeightTransferEngine.trainer_send_weights(
                [("model.norm.weight", torch.ones(256))], args
            )

        def fails(info: dict[str, Any]) -> None:
            raise OSError("the trainer's link went down")

        with pytest.raises(OSError, match="link went down"):
            ShmWeightTransferEngine.trainer_send_weights(
                new_weights().items(), ShmTrainerSendWeightsArgs(fails, bucket_size_bytes=BUCKET)
            )
        assert blocks_left() == []
        assert engine.engine_core.state.weight_update_chunks == 0
        assert engine.engine_core.weight_transfer is not None
        assert engine.engine_core.weight_transfer._lingering == []  # every block closed
    finally:
        llm.close()
