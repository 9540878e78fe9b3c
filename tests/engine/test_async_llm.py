"""AsyncLLM: output kinds, abort on cancel (on the tape), refusals that record nothing, the
engine core in its process and in-process, and the RL seed flow of vLLM #42043 at depths 1-3."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable
from typing import Any

import pytest
from terminal import run_in_terminal

from tokentape import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from tokentape.engine.core.client import MPClient
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.errors import EngineDeadError
from tokentape.events import schema as ev
from tokentape.postmortem import postmortem
from tokentape.replay import load_tape, verify

ORACLE = dict(block_size=4, num_kv_blocks=512)


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def events_of(path: str, kind: type) -> list[Any]:
    return [e for _, e in load_tape(path).events() if isinstance(e, kind)]


async def collect(engine: AsyncLLM, prompt: Any, params: SamplingParams, req_id: str) -> list[Any]:
    return [out async for out in engine.generate(prompt, params, req_id)]


@pytest.mark.parametrize("multiprocess", [True, False], ids=["process", "inproc"])
def test_output_kinds_give_the_oracle_stream(tmp_path: Any, multiprocess: bool) -> None:
    tape = str(tmp_path / "run.tape")
    engine = AsyncLLM("oracle", tape=tape, multiprocess_mode=multiprocess, **ORACLE)
    oracle = OracleRunner()
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(9)]

    async def main() -> list[list[Any]]:
        return await asyncio.gather(
            *(
                collect(
                    engine,
                    prompts[i],
                    SamplingParams(max_tokens=12 + i, output_kind=RequestOutputKind(i % 3)),
                    f"r{i}",
                )
                for i in range(len(prompts))
            )
        )

    try:
        results = run(main())
    finally:
        engine.shutdown()
    for i, outs in enumerate(results):
        expected = oracle.expected_stream(prompts[i], SamplingParams(max_tokens=12 + i))
        kind = RequestOutputKind(i % 3)
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].finish_reason == "length"
        assert all(o.prompt_token_ids == prompts[i] for o in outs)
        if kind == RequestOutputKind.DELTA:
            assert [t for o in outs for t in o.outputs[0].token_ids] == expected
        elif kind == RequestOutputKind.CUMULATIVE:
            streams = [o.outputs[0].token_ids for o in outs]
            assert streams[-1] == expected and all(expected[: len(s)] == s for s in streams)
            assert [len(s) for s in streams] == sorted({len(s) for s in streams})  # grows each time
        else:
            assert len(outs) == 1 and outs[0].outputs[0].token_ids == expected
        assert (
            outs[-1].outputs[0].text == engine.tokenizer.decode(outs[-1].outputs[0].token_ids)
            or kind == 1
        )
    assert verify(tape).ok


@pytest.mark.parametrize("multiprocess", [True, False], ids=["process", "inproc"])
def test_stream_interval_groups_tokens_and_a_pause_flushes_them(
    tmp_path: Any, multiprocess: bool
) -> None:
    """vLLM's stream_interval: the first tokens at once, then outputs of at least N tokens
    (the last may have fewer), the same stream; a pause hands out what has gathered."""
    tape = str(tmp_path / "run.tape")
    engine = AsyncLLM(
        "oracle", tape=tape, multiprocess_mode=multiprocess, stream_interval=4, **ORACLE
    )
    prompts = [[5 + i, 6, 7] for i in range(6)]
    params = SamplingParams(max_tokens=23, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main() -> list[list[Any]]:
        return await asyncio.gather(
            *(collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts))
        )

    try:
        results = run(main())
    finally:
        engine.shutdown()
    oracle = OracleRunner()
    for prompt, outs in zip(prompts, results):
        sizes = [len(o.outputs[0].token_ids) for o in outs]
        assert [t for o in outs for t in o.outputs[0].token_ids] == oracle.expected_stream(
            prompt, params
        )
        assert all(n >= 4 for n in sizes[1:-1]) and outs[-1].finished and len(outs) < 23, sizes
    assert verify(tape).ok
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncLLM("oracle", tape=False, stream_interval=0)

    # An interval no stream reaches: after its first output, only the pause hands tokens out.
    tape = str(tmp_path / "paused.tape")
    engine = AsyncLLM(
        "oracle", tape=tape, multiprocess_mode=multiprocess, stream_interval=10**9, **ORACLE
    )
    endless = SamplingParams(
        max_tokens=1_000_000, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def paused() -> list[int]:
        seen: list[int] = []
        first = asyncio.Event()

        async def consume() -> None:
            async for out in engine.generate([9, 9, 9], endless, "p"):
                seen.extend(out.outputs[0].token_ids)
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 30)
        await asyncio.sleep(0.05)  # more tokens gather
        await engine.pause_generation(mode="keep", clear_cache=False)
        await asyncio.sleep(0.1)  # the consumer takes what the pause handed out
        got = list(seen)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return got

    try:
        got = run(paused())
    finally:
        engine.shutdown()
    emitted: list[int] = []  # what the engine gave the stream before the pause returned
    for _, e in load_tape(tape).events():
        if isinstance(e, ev.RequestAborted):
            break
        if isinstance(e, ev.OutputsEmitted):
            emitted += [t for o in e.entries if o.req_id == "p" for t in o.token_ids]
    assert len(got) > 1 and got == emitted


def test_text_and_dict_prompts() -> None:
    engine = AsyncLLM("oracle", tape=False, multiprocess_mode=False, **ORACLE)
    params = SamplingParams(max_tokens=5)
    outs = run(collect(engine, {"prompt": "Hello"}, params, "a"))
    by_ids = run(
        collect(engine, {"prompt_token_ids": engine.tokenizer.encode("Hello")}, params, "b")
    )
    engine.shutdown()
    assert outs[-1].prompt == "Hello" and outs[-1].prompt_token_ids == engine.tokenizer.encode(
        "Hello"
    )
    assert (
        by_ids[-1].prompt is None
        and by_ids[-1].outputs[0].token_ids == outs[-1].outputs[0].token_ids
    )


def test_cancelling_the_consumer_aborts_the_request_on_the_tape(tmp_path: Any) -> None:
    tape = str(tmp_path / "run.tape")
    engine = AsyncLLM("oracle", tape=tape)  # the core in its process
    endless = SamplingParams(max_tokens=1_000_000, ignore_eos=True)

    async def main() -> list[Any]:
        got: list[Any] = []

        async def consume(req_id: str) -> None:
            async for out in engine.generate([5, 6, 7], endless, req_id):
                got.append(out)

        task = asyncio.create_task(consume("cancelled"))
        while not got:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Leaving the loop early aborts too; and an abort by id ends a stream with "abort".
        async for _ in engine.generate([8, 9], endless, "left"):
            break
        outs: list[Any] = []

        async def aborted() -> None:
            async for out in engine.generate([10, 11], endless, "by-id"):
                outs.append(out)
                if len(outs) == 1:
                    await engine.abort("by-id")

        await asyncio.wait_for(aborted(), 30)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        return got

    try:
        run(main())
    finally:
        engine.shutdown()
    assert {e.req_id for e in events_of(tape, ev.RequestAborted)} == {"cancelled", "left", "by-id"}
    assert verify(tape).ok


def test_refusals_record_nothing_and_the_engine_serves_on(tmp_path: Any) -> None:
    tape = str(tmp_path / "run.tape")
    engine = AsyncLLM("oracle", tape=tape, **ORACLE)
    params = SamplingParams(max_tokens=4)

    async def main() -> None:
        await collect(engine, [5, 6], params, "ok")
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, [5, 6], params, "ok")
        with pytest.raises(ValueError, match="vocabulary"):
            await collect(engine, [5, 6, 10**6], params, "bad-token")
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, [], params, "empty")
        with pytest.raises(TypeError, match="prompt"):
            await collect(engine, 3.5, params, "float")
        with pytest.raises(ValueError, match="mode"):
            await engine.pause_generation(mode="nap")
        with pytest.raises(RuntimeError, match="pause generation first"):
            await engine.update_weights(str(tmp_path))
        await engine.pause_generation(mode="keep")
        with pytest.raises(ValueError, match="no weight files"):  # refused, serves on
            await engine.update_weights(str(tmp_path))
        assert await engine.is_paused()
        await engine.resume_generation()
        assert not await engine.is_paused()
        assert await engine.reset_prefix_cache() is True
        outs = await collect(engine, [5, 6], params, "after")
        assert outs[-1].outputs[0].token_ids == OracleRunner().expected_stream([5, 6], params)

    try:
        run(main())
    finally:
        engine.shutdown()
    added = [e.req_id for e in events_of(tape, ev.RequestAdded)]
    assert added == ["ok", "after"]
    assert verify(tape).ok


def test_bad_engine_arguments_fail_before_any_process() -> None:
    with pytest.raises(ValueError, match="pipeline_depth"):
        AsyncLLM("oracle", pipeline_depth=9)
    with pytest.raises(ValueError, match="unknown model"):
        AsyncLLM("no-such-model", tape=False)  # the core reports why it could not start


def test_a_bad_checkpoint_folder_is_a_value_error_from_the_core(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"CheckpointError: .*config.json: not valid JSON"):
        AsyncLLM(str(tmp_path), tape=False)  # a CheckpointError in the core's process


def test_a_dead_core_fails_the_streams_instead_of_hanging() -> None:
    engine = AsyncLLM("oracle", tape=False)
    assert isinstance(engine.engine_core, MPClient)
    endless = SamplingParams(max_tokens=1_000_000, ignore_eos=True)

    async def main() -> None:
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([5, 6], endless, "x"):
                os.kill(engine.engine_core.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        with pytest.raises(EngineDeadError):
            await engine.is_paused()

    try:
        run(asyncio.wait_for(main(), 30))
    finally:
        engine.shutdown()


def test_the_core_shares_the_frontends_session_but_not_its_ctrl_c() -> None:
    """A session of its own was a scheduler autogroup of its own: under Ray (actors at nice 15)
    the core took the CPU from the actor reading its outputs, and ran 500 steps past a pause
    the actor asked for after 8 tokens. Its own process group keeps a terminal's Ctrl-C (sent
    to the foreground group) for the frontend, which stops the core in order. (Linux: /proc.)"""
    engine = AsyncLLM("oracle", tape=False)
    try:
        pid = engine.engine_core.proc.pid  # type: ignore[attr-defined]
        assert os.getsid(pid) == os.getsid(0)
        assert os.getpgid(pid) == pid != os.getpgid(0)
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)
        # A background group's write to the terminal under `stty tostop` stops it, unless it
        # ignores SIGTTOU (the core writes its warnings to stderr).
        with open(f"/proc/{pid}/status") as f:
            ignored = int(next(ln for ln in f if ln.startswith("SigIgn:")).split()[1], 16)
        assert ignored >> (signal.SIGTTOU - 1) & 1
    finally:
        engine.shutdown()


TOSTOP_SCRIPT = """
import asyncio, os, signal, time
from tokentape import AsyncLLM, SamplingParams
os.system("stty tostop")
engine = AsyncLLM("oracle", tape=False)
engine.engine_core._push.send(b"\\xc1")  # the core warns on stderr, the terminal
time.sleep(0.5)
async def run():
    outs = [o async for o in engine.generate([5, 6], SamplingParams(max_tokens=3), "r")]
    return len(outs[-1].outputs[0].token_ids)
try:
    print("generated", asyncio.run(asyncio.wait_for(run(), 20)), flush=True)
finally:
    os.kill(engine.engine_core.proc.pid, signal.SIGCONT)  # had it stopped
    engine.shutdown()
"""


def test_a_core_writing_to_a_tostop_terminal_keeps_serving() -> None:
    """In the frontend's session, the core is a background group of its terminal: under
    `stty tostop` its first warning on stderr stopped it (SIGTTOU), and the stream hung."""
    text, code = run_in_terminal(TOSTOP_SCRIPT)
    assert "dropped a message that does not decode" in text and "generated 3" in text, text
    assert code == 0, text


# -- the seed flow: concurrent streams, pause(keep, clear_cache), update_weights, resume -------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 5, 8,"]
MAX_TOKENS = 128  # the pause comes well before the end, even on a busy machine (a compiled
# core steps 4 requests of tiny in ~2 ms: 32 tokens were all out before a pause under load)
TOKENS_BEFORE_PAUSE = 3


def seed_params(i: int) -> SamplingParams:
    # Seeded and greedy mixed: a seeded draw is keyed by (seed, position), so a plain run
    # continuing from the same prefix draws the same tokens.
    if i % 2:
        return SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        top_p=0.95,
        seed=100 + i,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )


@pytest.fixture(scope="module")
def new_weights() -> dict[str, Any]:
    from tokentape.engine.model.loader import builtin_model

    return builtin_model("tiny", seed=1)[1].state_dict()


def seed_flow(
    depth: int, policy: str, tape: str, weights: dict[str, Any]
) -> tuple[list[list[int]], list[int]]:
    """The RL round through AsyncLLM; each stream's tokens, and how many came before the pause."""
    engine = AsyncLLM("tiny", tape=tape, pipeline_depth=depth, discard_policy=policy, device="cpu")

    async def main() -> tuple[list[list[int]], list[int]]:
        tokens: list[list[int]] = [[] for _ in PROMPTS]

        async def stream(i: int) -> None:
            async for out in engine.generate(PROMPTS[i], seed_params(i), str(i)):
                tokens[i] += out.outputs[0].token_ids

        tasks = [asyncio.create_task(stream(i)) for i in range(len(PROMPTS))]
        while min(map(len, tokens)) < TOKENS_BEFORE_PAUSE:
            await asyncio.sleep(0.001)
        await engine.pause_generation(mode="keep", clear_cache=True)
        for _ in range(20):  # the drained tokens are with the streams: let them take them
            await asyncio.sleep(0)
        before = [len(t) for t in tokens]
        await engine.update_weights(weights)
        assert [len(t) for t in tokens] == before  # paused: nothing new
        await engine.resume_generation()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return tokens, before

    try:
        return run(main())
    finally:
        engine.shutdown()


def plain_runs(
    weights: dict[str, Any], streams: list[list[int]], before: list[int]
) -> list[list[int]]:
    """What a plain run gives: the old weights up to the pause, then the new weights
    continuing from the same prefix (a fresh engine, nothing in flight, no pause)."""
    old = LLM("tiny", tape=None, pipeline_depth=1, device="cpu")
    new = LLM("tiny", tape=None, pipeline_depth=1, device="cpu")
    new.llm_engine.pause_generation(mode="keep", clear_cache=False)
    new.llm_engine.update_weights(weights)
    new.llm_engine.resume_generation()
    expected = []
    for i, text in enumerate(PROMPTS):
        p = seed_params(i)
        prompt = old.tokenizer.encode(text)
        prefix = old.generate([prompt], p)[0].outputs[0].token_ids[: before[i]]
        rest = SamplingParams(
            max_tokens=MAX_TOKENS - len(prefix),
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            ignore_eos=True,
        )
        expected.append(prefix + new.generate([prompt + prefix], rest)[0].outputs[0].token_ids)
    old.close()
    new.close()
    return expected


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_seed_flow_through_async_llm_loses_no_token(
    tmp_path: Any, depth: int, new_weights: dict[str, Any]
) -> None:
    tape = str(tmp_path / "run.tape")
    streams, before = seed_flow(depth, "epoch", tape, new_weights)
    assert all(0 < b < MAX_TOKENS for b in before)
    assert streams == plain_runs(new_weights, streams, before)
    assert events_of(tape, ev.WeightsUpdated) and events_of(tape, ev.GenerationPaused)
    assert verify(tape).ok
    assert postmortem(tape).ok


def test_seed_flow_under_the_flag_policy_is_named_42043(
    tmp_path: Any, new_weights: dict[str, Any]
) -> None:
    tape = str(tmp_path / "flag.tape")
    streams, before = seed_flow(2, "flag", tape, new_weights)
    assert streams != plain_runs(
        new_weights, streams, before
    )  # the first token after resume is lost
    report = postmortem(tape)
    assert "vllm#42043" in {f.bug_class for f in report.findings}


# -- how a tape ends when its frontend goes away without shutdown() ----------------------------

_FRONTEND = """
import asyncio, os, signal, sys
from tokentape import AsyncLLM, SamplingParams
engine = AsyncLLM("oracle", tape=sys.argv[1], pipeline_depth=2)
async def main():
    n = 0
    async for _ in engine.generate(
        [5, 6, 7], SamplingParams(max_tokens=1_000_000, ignore_eos=True), "r"
    ):
        n += 1
        if n == 50:
            if sys.argv[2] == "killed":
                os.kill(os.getpid(), signal.SIGKILL)  # as an engine actor that crashes
            return  # the interpreter exits with the AsyncLLM never shut down
asyncio.run(main())
"""


def frontend_run(tmp_path: Any, how: str) -> str:
    import subprocess
    import sys
    import time

    from tokentape.events.sqlite_reader import tape_file_status

    tape = str(tmp_path / f"{how}.tape")
    proc = subprocess.run(
        [sys.executable, "-c", _FRONTEND, tape, how], capture_output=True, timeout=120
    )
    assert proc.returncode == (-9 if how == "killed" else 0), proc.stderr
    deadline = time.monotonic() + 60
    while not tape_file_status(tape).finished:  # the core closes the tape on its own
        assert time.monotonic() < deadline, "the engine core did not close the tape"
        time.sleep(0.05)
    return tape


def test_a_killed_frontend_is_on_the_tape(tmp_path: Any) -> None:
    tape = frontend_run(tmp_path, "killed")
    errors = events_of(tape, ev.EngineError)
    assert [e.error_type for e in errors] == [
        "FrontendDied"
    ] and "1 request(s) unfinished" in errors[0].message
    assert events_of(tape, ev.RequestAborted) == []  # the request as it stood
    assert verify(tape).ok
    (finding,) = postmortem(tape).findings
    assert (
        finding.kind == "engine_error"
        and "FrontendDied: the frontend (AsyncLLM) went away" in finding.message
    )


def test_a_frontend_dropped_without_shutdown_lets_its_core_go(tmp_path: Any) -> None:
    tape = frontend_run(tmp_path, "dropped")
    assert events_of(tape, ev.EngineError) == []
    assert [e.req_id for e in events_of(tape, ev.RequestAborted)] == ["r"]  # as a shutdown() does
    assert postmortem(tape).findings == []
