"""AsyncLLM's sleep mode and abort_all, through the engine core (in its process and
in-process): a sleep with streams in flight returns once drained and asleep (vLLM #45520), a
request sent with the sleep is served after the wake-up or aborted by it, never parked (vLLM
#45268), and every tape verifies."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokentape import AsyncLLM, SamplingParams
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.errors import EngineDeadError
from tokentape.events import schema as ev
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape, verify

ARGS: dict[str, Any] = dict(block_size=4, num_kv_blocks=1 << 14, pipeline_depth=2)
ORACLE = OracleRunner()
# Long enough to be running when the call that follows its first token reaches the core.
LONG = SamplingParams(max_tokens=8000, ignore_eos=True)


def tape_events(path: str) -> list[ev.Event]:
    return [e for _, e in load_tape(path).events()]


def check_tape(path: str) -> None:
    assert verify(path).ok
    assert postmortem(path).findings == []


class Stream:
    """A request streamed in a task: its tokens so far, and an event set at its first output."""

    def __init__(self, engine: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str):
        self.prompt, self.params, self.rid = prompt, params, rid
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.started = asyncio.Event()
        self.task = asyncio.create_task(self._run(engine))

    async def _run(self, engine: AsyncLLM) -> None:
        async for out in engine.generate(self.prompt, self.params, self.rid):
            self.tokens = list(out.outputs[0].token_ids)
            self.finish = out.outputs[0].finish_reason
            self.started.set()

    def expected(self) -> list[int]:
        return ORACLE.expected_stream(self.prompt, self.params)


@pytest.mark.parametrize("multiprocess", [True, False], ids=["process", "inproc"])
def test_sleep_with_streams_in_flight_drains_and_serves_them_after_the_wake_up(
    tmp_path: Any, multiprocess: bool
) -> None:
    tape = str(tmp_path / "sleep.tape")
    engine = AsyncLLM("oracle", tape=tape, multiprocess_mode=multiprocess, **ARGS)

    async def main() -> list[Stream]:
        streams = [Stream(engine, [5 + i, 6, 7], LONG, f"r{i}") for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 30)
        await engine.sleep(level=1, mode="keep")
        assert await engine.is_sleeping()
        counts = [len(s.tokens) for s in streams]
        late = Stream(engine, [9, 9, 9], SamplingParams(max_tokens=5), "late")
        await asyncio.sleep(0.3)
        assert [len(s.tokens) for s in streams] == counts and not late.tokens  # nothing runs
        assert not any(s.task.done() for s in [*streams, late])
        await engine.wake_up(["weights"])
        assert await engine.is_sleeping()  # the KV cache still sleeps: nothing runs yet
        await engine.wake_up(["kv_cache"])
        assert not await engine.is_sleeping()
        await asyncio.wait_for(asyncio.gather(*(s.task for s in [*streams, late])), 60)
        return [*streams, late]

    try:
        streams = asyncio.run(main())
    finally:
        engine.shutdown()
    for s in streams:
        assert s.tokens == s.expected() and s.finish == "length"
    events = tape_events(tape)
    (slept,) = [e for e in events if isinstance(e, ev.EngineSlept)]
    assert slept.level == 1 and slept.in_flight == [] and slept.kept == ["r0", "r1", "r2"]
    assert [e.tags for e in events if isinstance(e, ev.EngineWokeUp)] == [["weights"], ["kv_cache"]]
    check_tape(tape)


@pytest.mark.parametrize("mode", ["keep", "abort"])
@pytest.mark.parametrize("request_first", [True, False], ids=["request-first", "sleep-first"])
def test_a_request_sent_with_the_sleep_is_never_parked(
    tmp_path: Any, mode: str, request_first: bool
) -> None:
    """vLLM #45268: whichever reaches the engine core first, the request is served after the
    wake-up, or (sent before a sleep in mode "abort") aborted by it; it never waits for ever."""
    tape = str(tmp_path / "race.tape")
    engine = AsyncLLM("oracle", tape=tape, **ARGS)
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main() -> Stream:
        await engine.is_sleeping()  # the core is up and serving
        stream = Stream(engine, [7, 8, 9], params, "racer")
        if request_first:
            await asyncio.sleep(0)  # its add is sent before the sleep's call
        await engine.sleep(level=2, mode=mode)
        await engine.wake_up()
        await asyncio.wait_for(stream.task, 30)
        return stream

    try:
        stream = asyncio.run(main())
    finally:
        engine.shutdown()
    if request_first and mode == "abort" and stream.finish == "abort":
        # Aborted by the sleep (unless it finished first: the core may step it to its end
        # before the sleep's call arrives).
        assert stream.tokens == stream.expected()[: len(stream.tokens)]
    else:
        assert stream.finish == "length" and stream.tokens == stream.expected()
    added = next(i for i, e in enumerate(tape_events(tape)) if isinstance(e, ev.RequestAdded))
    slept = next(i for i, e in enumerate(tape_events(tape)) if isinstance(e, ev.EngineSlept))
    assert (added < slept) == request_first
    check_tape(tape)


def test_abort_all_returns_the_aborted_ids_and_ends_their_streams(tmp_path: Any) -> None:
    tape = str(tmp_path / "abort_all.tape")
    engine = AsyncLLM("oracle", tape=tape, **ARGS)

    async def main() -> tuple[list[str], list[Stream], list[str]]:
        streams = [Stream(engine, [5, 6, 7], LONG, "a"), Stream(engine, [8, 9], LONG, "b")]
        pair = Stream(engine, [3, 4], SamplingParams(max_tokens=8000, n=2, ignore_eos=True), "p")
        await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in [*streams, pair])), 30)
        ids = await engine.abort_all()
        await asyncio.wait_for(asyncio.gather(*(s.task for s in [*streams, pair])), 30)
        return ids, [*streams, pair], await engine.abort_all()

    try:
        ids, streams, again = asyncio.run(main())
    finally:
        engine.shutdown()
    assert sorted(ids) == ["a", "b", "p"] and again == []
    assert all(s.finish == "abort" for s in streams)
    aborted = {e.req_id for e in tape_events(tape) if isinstance(e, ev.RequestAborted)}
    assert aborted == {"a", "b", "0_p", "1_p"}
    check_tape(tape)


def test_a_shutdown_while_asleep_ends_the_queued_streams(tmp_path: Any) -> None:
    tape = str(tmp_path / "shutdown.tape")
    engine = AsyncLLM("oracle", tape=tape, **ARGS)

    async def main() -> BaseException | None:
        await engine.sleep(level=1)
        stream = Stream(engine, [5, 6], SamplingParams(max_tokens=4), "queued")
        await asyncio.sleep(0.2)
        assert not stream.task.done()
        engine.shutdown()
        done, _ = await asyncio.wait([stream.task], timeout=30)
        assert done
        return stream.task.exception()

    error = asyncio.run(main())
    assert error is None or isinstance(error, EngineDeadError)
    events = tape_events(tape)
    assert ev.RequestAborted(events[-2].step, "queued") in events
    assert verify(tape).ok


def test_bad_sleep_arguments_are_refused_before_they_are_sent(tmp_path: Any) -> None:
    engine = AsyncLLM("oracle", tape=None, multiprocess_mode=False, **ARGS)

    async def main() -> None:
        with pytest.raises(ValueError, match="level must be in 0..2"):
            await engine.sleep(level=5)
        with pytest.raises(ValueError, match="mode must be one of"):
            await engine.sleep(mode="soon")
        with pytest.raises(ValueError, match="unknown tag 'gpu'"):
            await engine.wake_up(["gpu"])
        assert not await engine.is_sleeping()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_sleep_that_breaks_the_engine_raises_and_is_never_answered_ok(tmp_path: Any) -> None:
    """vLLM #45520's other half: the caller of a sleep whose release failed hears of it
    (EngineDeadError, which the server answers with a 503), and every stream ends."""
    tape = str(tmp_path / "broken.tape")
    engine = AsyncLLM("tiny", tape=tape, multiprocess_mode=False, num_kv_blocks=64, block_size=16)

    def fail(runner: object, level: int) -> None:
        raise RuntimeError("the device went away")

    engine.engine_core.core.engine_core.runner.memory.sleep = fail  # type: ignore[attr-defined]

    async def main() -> Stream:
        stream = Stream(engine, [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True), "r")
        await asyncio.wait_for(stream.started.wait(), 30)
        with pytest.raises(EngineDeadError, match="the device went away"):
            await engine.sleep(level=1, mode="keep")
        await asyncio.wait([stream.task], timeout=30)
        return stream

    try:
        stream = asyncio.run(main())
    finally:
        engine.shutdown()
    assert stream.task.done() and isinstance(stream.task.exception(), EngineDeadError)
    kinds = [ev.kind_of(e) for e in tape_events(tape)]
    assert kinds[-2:] == ["EngineSlept", "EngineError"]
    assert verify(tape).ok
