"""vLLM's collective_rpc and worker_extension_cls: the RL framework's code runs in the worker,
reaches the model (`self.model_runner.model.load_weights`), and every call is on the tape
(method, argument digest, the weights' hash when they changed), from LLM, from AsyncLLM's
engine core process and over the dev-mode /collective_rpc. A method that raises comes back to
the caller and the engine serves on; the tape verifies throughout."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tokentape import LLM, AsyncLLM, SamplingParams
from tokentape.engine.model.loader import weights_hash
from tokentape.entrypoints.api_server import ServerOptions, build_app
from tokentape.events import schema as ev
from tokentape.replay import load_tape
from tokentape.replay.verify import verify
from tokentape.replay.whatif import WhatIfError, whatif

HERE = Path(__file__).resolve().parent
EXTENSION = "rpc_extension.WeightSync"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9]
ARGS: dict[str, Any] = dict(num_kv_blocks=64, max_model_len=256)


@pytest.fixture(autouse=True)
def extension_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension's module importable here and in an engine core process."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", str(HERE))


def rpc_events(path: Path) -> list[ev.CollectiveRPC]:
    return [e for _, e in load_tape(path).events() if isinstance(e, ev.CollectiveRPC)]


def test_an_extension_loads_weights_and_the_tape_names_the_calls_that_changed_them(
    tmp_path: Path,
) -> None:
    tape = tmp_path / "rpc.tape"
    llm = LLM("tiny", tape=str(tape), worker_extension_cls=EXTENSION, **ARGS)
    before = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.collective_rpc("whoami") == [{"rank": 0, "device": "cpu"}]
    count = len(list(llm.llm_engine.engine_core.worker.get_model().parameters()))
    assert llm.collective_rpc("load_seeded", args=(3,)) == [count]
    assert llm.collective_rpc("scale_norms", kwargs={"factor": 0.5})[0] > 0
    after = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    state = {
        n: p.detach().clone() for n, p in llm.llm_engine.engine_core.runner.model.named_parameters()
    }  # type: ignore[attr-defined]
    served = weights_hash(llm.llm_engine.engine_core.runner.model)  # type: ignore[attr-defined]
    llm.close()
    assert after != before

    # The weights the calls left serve exactly as the same weights loaded the plain way:
    # writes through `.data` reached the matmuls' packed copies too.
    fresh = LLM("tiny", tape=False, **ARGS)
    fresh.llm_engine.engine_core.pause_generation("keep")
    fresh.llm_engine.engine_core.update_weights(state)
    fresh.llm_engine.engine_core.resume_generation()
    assert fresh.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == after
    fresh.close()

    calls = rpc_events(tape)
    assert [c.method for c in calls] == ["whoami", "load_seeded", "scale_norms"]
    assert calls[0].weights_id is None  # it read, it did not write
    assert calls[1].weights_id is not None and calls[2].weights_id == served
    assert calls[1].args_digest != calls[2].args_digest
    assert verify(tape).ok
    assert load_tape(tape).fold().weights_id == served


def test_a_method_that_raises_comes_back_and_the_engine_serves_on(tmp_path: Path) -> None:
    tape = tmp_path / "rpc.tape"
    llm = LLM("tiny", tape=str(tape), worker_extension_cls=EXTENSION, **ARGS)
    with pytest.raises(ValueError, match="no good"):
        llm.collective_rpc("fail", args=("no good",))
    with pytest.raises(AttributeError, match="no method 'nope'"):
        llm.collective_rpc("nope")  # refused: not recorded
    with pytest.raises(AttributeError, match="no method '_secret'"):
        llm.collective_rpc("_secret")
    assert llm.collective_rpc(lambda worker, x: x + worker.rank, args=(41,)) == [41]
    assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    llm.close()
    calls = rpc_events(tape)
    assert [(c.method, c.error) for c in calls] == [
        ("fail", "ValueError: no good"),
        ("test_a_method_that_raises_comes_back_and_the_engine_serves_on.<locals>.<lambda>", None),
    ]
    assert verify(tape).ok


def test_a_bad_extension_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    tape = tmp_path / "never.tape"
    with pytest.raises(ValueError, match="cannot be imported"):
        LLM("tiny", tape=str(tape), worker_extension_cls="rpc_extension.Missing")
    with pytest.raises(ValueError, match="module.Class"):
        LLM("tiny", tape=str(tape), worker_extension_cls="NoModule")
    with pytest.raises(ValueError, match="which the worker has already"):
        LLM("tiny", tape=str(tape), worker_extension_cls="rpc_extension.Clashes")
    assert not tape.exists()


def test_whatif_notes_a_call_and_refuses_one_that_changed_the_weights(tmp_path: Path) -> None:
    tape = tmp_path / "rpc.tape"
    llm = LLM("tiny", tape=str(tape), worker_extension_cls=EXTENSION, **ARGS)
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.collective_rpc("whoami")
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.close()
    result = whatif(tape, pipeline_depth=2)
    assert result.diff.identical and any("collective_rpc 'whoami'" in n for n in result.notes)
    llm = LLM("tiny", tape=str(tmp_path / "w.tape"), worker_extension_cls=EXTENSION, **ARGS)
    llm.collective_rpc("load_seeded", args=(1,))
    llm.close()
    with pytest.raises(WhatIfError, match="changed the weights"):
        whatif(tmp_path / "w.tape")


@pytest.mark.parametrize("multiprocess", [True, False], ids=["process", "inproc"])
def test_async_llm_calls_the_worker_in_the_engine_core(tmp_path: Path, multiprocess: bool) -> None:
    tape = tmp_path / "rpc.tape"
    engine = AsyncLLM(
        "tiny",
        tape=str(tape),
        multiprocess_mode=multiprocess,
        worker_extension_cls=EXTENSION,
        **ARGS,
    )

    async def main() -> None:
        assert await engine.collective_rpc("whoami") == [{"rank": 0, "device": "cpu"}]
        assert (await engine.collective_rpc("load_seeded", args=(2,)))[0] > 0
        with pytest.raises(ValueError, match="from the worker"):
            await engine.collective_rpc("fail", args=("from the worker",))
        with pytest.raises(AttributeError, match="no method 'nope'"):  # refused, as itself
            await engine.collective_rpc("nope")
        if multiprocess:
            with pytest.raises(TypeError, match="name of a worker method"):
                await engine.collective_rpc(lambda w: None)
            with pytest.raises(TypeError, match="cannot travel"):
                await engine.collective_rpc("whoami", args=(torch.zeros(2),))
        async for out in engine.generate(PROMPT, GREEDY, "r1"):
            last = out
        assert len(last.outputs[0].token_ids) == 8

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert [c.method for c in rpc_events(tape)] == ["whoami", "load_seeded", "fail"]
    assert verify(tape).ok


def test_the_dev_mode_endpoint(tmp_path: Path) -> None:
    engine = AsyncLLM(
        "tiny", tape=False, multiprocess_mode=False, worker_extension_cls=EXTENSION, **ARGS
    )

    async def main() -> None:
        for options, status in [
            (ServerOptions(enable_rl_endpoints=True), 404),  # not without dev mode
            (ServerOptions(enable_collective_rpc=True, api_keys=("k",)), 401),
        ]:
            transport = httpx.ASGITransport(app=build_app(engine, options=options))
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
                r = await http.post("/collective_rpc", json={"method": "whoami"})
                assert r.status_code == status
        app = build_app(engine, options=ServerOptions(enable_collective_rpc=True))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            r = await http.post("/collective_rpc", json={"method": "whoami"})
            assert r.status_code == 200 and r.json() == {"results": [{"rank": 0, "device": "cpu"}]}
            r = await http.post("/collective_rpc", json={"method": "scale_norms", "args": [2.0]})
            assert r.status_code == 200 and r.json()["results"] == ["17"]
            r = await http.post("/collective_rpc", json={"method": "fail", "args": ["oops"]})
            assert r.status_code == 500 and "ValueError: oops" in r.text
            r = await http.post("/collective_rpc", json={"method": "nope"})
            assert r.status_code == 400 and "no method 'nope'" in r.text
            r = await http.post("/collective_rpc", json={"args": []})
            assert r.status_code == 422 and "method" in r.text  # a body without the method
            r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
            assert r.status_code == 200

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
