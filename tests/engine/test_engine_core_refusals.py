"""The engine core survives any bad command: whatever a command raises is a refusal sent to
its caller (type and message), and the engine and its tape go on. Only a failure inside a
step, or a broken tape, is fatal, and it is on the tape as an EngineError whatever raised it.
The frontend never blocks on a dead core."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tokentape import AsyncLLM, SamplingParams
from tokentape.engine.core import client as core_client
from tokentape.engine.core.engine_core_proc import EngineCoreProc
from tokentape.engine.core.messages import AddRequest, CoreDead, CoreOutputs, UtilityCall
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.errors import EngineDeadError
from tokentape.events import schema as ev
from tokentape.replay import load_tape, verify

ORACLE = {"block_size": 4, "num_kv_blocks": 256}
PARAMS = SamplingParams(max_tokens=6)


def core_of(tmp_path: Path) -> tuple[EngineCoreProc, str]:
    tape = str(tmp_path / "core.tape")
    return EngineCoreProc("oracle", tape, dict(ORACLE)), tape


def run_until_done(core: EngineCoreProc, requests: list[Any]) -> list[Any]:
    """Every message the core sends for `requests`, then while it has work."""
    messages, done = core.run_once(requests)
    while not done and core.has_work():
        more, done = core.run_once([])
        messages += more
    return messages


def tokens_of(messages: list[Any], req_id: str) -> list[int]:
    return [
        t
        for m in messages
        if isinstance(m, CoreOutputs)
        for o in m.outputs
        if o.request_id == req_id
        for t in o.new_token_ids
    ]


def kinds(tape: str) -> list[str]:
    return [ev.kind_of(e) for _, e in load_tape(tape).events()]


def test_any_exception_of_a_call_is_a_refusal_and_the_engine_serves_on(tmp_path: Path) -> None:
    core, tape = core_of(tmp_path)

    class Failing:  # a runner capability (runners.base.UpdatesWeights) that raises
        def update_weights(self, weights: object) -> str:
            raise ZeroDivisionError("a checkpoint whose config divides by zero")

    core.engine_core.weights_updater = Failing()
    try:
        run_until_done(core, [UtilityCall(0, "pause_generation", ["keep", True])])
        messages = run_until_done(core, [UtilityCall(1, "update_weights", ["/ckpt"])])
        (answer,) = [m.utility for m in messages if isinstance(m, CoreOutputs) and m.utility]
        assert answer.error == ("ZeroDivisionError", "a checkpoint whose config divides by zero")
        assert not [m for m in messages if isinstance(m, CoreDead)]
        run_until_done(core, [UtilityCall(2, "resume_generation", [])])
        messages = run_until_done(core, [AddRequest("after", [5, 6], PARAMS)])
        assert tokens_of(messages, "after") == OracleRunner().expected_stream([5, 6], PARAMS)
    finally:
        core.shutdown()
    assert "WeightsUpdated" not in kinds(tape) and "EngineError" not in kinds(tape)
    assert verify(tape).ok


def test_an_add_that_raises_anything_is_refused_and_records_nothing(tmp_path: Path) -> None:
    core, tape = core_of(tmp_path)
    real_check = core.engine_core.check_request

    def check(request_id: str, prompt: Any, params: SamplingParams) -> None:
        if request_id == "odd":
            raise AttributeError("'list' object has no attribute 'get'")
        real_check(request_id, prompt, params)

    core.engine_core.check_request = check  # type: ignore[method-assign]
    try:
        messages = run_until_done(
            core, [AddRequest("odd", [5, 6], PARAMS), AddRequest("ok", [5, 6], PARAMS)]
        )
        errors = {
            o.request_id: o.error
            for m in messages
            if isinstance(m, CoreOutputs)
            for o in m.outputs
            if o.error
        }
        assert errors == {"odd": ("AttributeError", "'list' object has no attribute 'get'")}
        assert tokens_of(messages, "ok") == OracleRunner().expected_stream([5, 6], PARAMS)
        # An unknown call is refused the same way.
        messages = run_until_done(core, [UtilityCall(7, "no_such_call", [])])
        (answer,) = [m.utility for m in messages if isinstance(m, CoreOutputs) and m.utility]
        assert answer.error is not None and "unknown engine call" in answer.error[1]
    finally:
        core.shutdown()
    assert [e.req_id for _, e in load_tape(tape).events() if isinstance(e, ev.RequestAdded)] == [
        "ok"
    ]


def test_a_failure_inside_a_step_is_fatal_and_on_the_tape(tmp_path: Path) -> None:
    core, tape = core_of(tmp_path)

    def collect(step: int) -> Any:
        raise MemoryError("the runner ran out of memory")

    try:
        core.engine_core.runner.collect = collect  # type: ignore[method-assign]
        messages = run_until_done(core, [AddRequest("r", [5, 6], PARAMS)])
        (dead,) = [m for m in messages if isinstance(m, CoreDead)]
        assert "MemoryError" in dead.message
    finally:
        core.shutdown()
    errors = [e for _, e in load_tape(tape).events() if isinstance(e, ev.EngineError)]
    assert [(e.error_type, e.message) for e in errors] == [
        ("MemoryError", "the runner ran out of memory")
    ]


def test_a_failure_of_the_core_around_a_step_is_on_the_tape_too(tmp_path: Path) -> None:
    """Outside the engine's recorded part (the core's handling of a step's outputs): still
    an EngineError on the tape, with the requests as they stand."""
    core, tape = core_of(tmp_path)
    run_until_done(core, [AddRequest("r", [5, 6], SamplingParams(max_tokens=50))])  # may finish
    # The step's deltas, broken after the engine's recorded part handed them over.
    core.engine_core._ready = None  # type: ignore[assignment]
    try:
        messages, done = core.run_once([AddRequest("s", [7, 8], SamplingParams(max_tokens=50))])
        assert done and isinstance(messages[-1], CoreDead) and "TypeError" in messages[-1].message
    finally:
        core.shutdown()
    errors = [e for _, e in load_tape(tape).events() if isinstance(e, ev.EngineError)]
    assert len(errors) == 1 and errors[0].error_type == "TypeError"
    assert errors[0].message.startswith("engine core: ")


def test_a_malformed_checkpoint_folder_through_async_llm_is_a_refusal(tmp_path: Path) -> None:
    """vLLM's RL loop with a bad folder: refused (not EngineDeadError); the engine serves on."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("[1, 2, 3]")  # JSON, but a list
    tape = str(tmp_path / "run.tape")
    engine = AsyncLLM("tiny", tape=tape, device="cpu", num_kv_blocks=64)

    async def main() -> list[int]:
        await engine.pause_generation(mode="keep")
        with pytest.raises(Exception) as refused:  # its type is the loader's
            await engine.update_weights(str(bad))
        assert not isinstance(refused.value, EngineDeadError)
        assert "config.json" in str(refused.value)
        await engine.resume_generation()
        outs = [o async for o in engine.generate([5, 6], SamplingParams(max_tokens=3), "after")]
        return outs[-1].outputs[0].token_ids

    try:
        assert len(asyncio.run(main())) == 3 and not engine.errored
    finally:
        engine.shutdown()
    assert "EngineError" not in kinds(tape) and verify(tape).ok


def test_a_prompt_id_past_64_bits_is_refused_before_it_is_sent() -> None:
    engine = AsyncLLM("oracle", tape=False, **ORACLE)

    async def main() -> None:
        with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] must be"):
            async for _ in engine.generate([5, 2**64], PARAMS, "huge"):
                pass
        outs = [o async for o in engine.generate([5, 6], PARAMS, "ok")]
        assert outs[-1].finished

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_shutdown_never_blocks_on_a_dead_core() -> None:
    engine = AsyncLLM("oracle", tape=False, **ORACLE)
    os.kill(engine.engine_core.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    engine.engine_core.proc.wait(10)  # type: ignore[attr-defined]

    async def main() -> None:
        with pytest.raises(EngineDeadError):  # a bounded send: the core's socket is gone
            async for _ in engine.generate([5, 6], PARAMS, "r"):
                pass

    asyncio.run(asyncio.wait_for(main(), 10))
    assert engine.failure is not None
    start = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - start < 2.0


def test_a_stuck_core_is_killed_past_the_shutdown_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_client, "STOP_GRACE_S", 0.5)
    engine = AsyncLLM("oracle", tape=False, **ORACLE)
    proc = engine.engine_core.proc  # type: ignore[attr-defined]
    os.kill(proc.pid, signal.SIGSTOP)  # neither reads its sockets nor its stdin
    start = time.monotonic()
    engine.shutdown(timeout_s=0.5)
    elapsed = time.monotonic() - start
    assert proc.returncode == -signal.SIGKILL
    assert elapsed < 0.5 + 0.5 + 2.0
