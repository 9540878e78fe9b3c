"""vLLM's sleep mode on LLMEngine (EngineCore.sleep and wake_up, runners/sleep_memory.py): what each
level releases (measured on the runner's tensors and the process's RSS), what a wake-up
restores, what happens to the requests in flight and to those that arrive while it sleeps,
and the calls it refuses. Every tape verifies and has no postmortem finding."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tokentape import LLM, SamplingParams
from tokentape.engine.llm_engine import LLMEngine
from tokentape.engine.model.layers import Linear
from tokentape.engine.model.loader import builtin_model
from tokentape.events import schema as ev
from tokentape.postmortem import postmortem
from tokentape.replay import fold, load_tape, verify

GREEDY = SamplingParams(max_tokens=24, temperature=0)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 45))]


_OPEN: list[LLM] = []  # closed after each test: their runners' threads and memory go


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def tiny(**kw: object) -> LLM:
    args: dict[str, object] = dict(
        model="tiny", tape=None, num_kv_blocks=128, block_size=16, pipeline_depth=2
    )
    args.update(kw)
    _OPEN.append(LLM(**args))  # type: ignore[arg-type]
    return _OPEN[-1]


def oracle(**kw: object) -> LLM:
    args: dict[str, object] = dict(model="oracle", tape=None, block_size=4, num_kv_blocks=64)
    args.update(kw)
    _OPEN.append(LLM(**args))  # type: ignore[arg-type]
    return _OPEN[-1]


def events(engine: LLMEngine) -> list[ev.Event]:
    return [e for _, e in load_tape(engine.engine_core.tape).events()]  # type: ignore[arg-type]


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    raise AssertionError("the engine did not finish its requests")


def reference(prompts: list[list[int]], params: SamplingParams, **kw: object) -> list[list[int]]:
    outs = tiny(**kw).generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def clean(engine: LLMEngine) -> None:
    """The tape verifies, folds to the engine's state and has no finding."""
    assert verify(engine.engine_core.tape).ok
    assert fold(engine.engine_core.tape) == engine.engine_core.state
    assert postmortem(engine.engine_core.tape).findings == []  # type: ignore[arg-type]


def weight_bytes(engine: LLMEngine) -> int:
    model = engine.engine_core.runner.model  # type: ignore[attr-defined]
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def resident_bytes(ranges: list[tuple[int, int]]) -> int:
    """Resident bytes of exactly these address ranges: the present bit of each page in
    /proc/self/pagemap. Only those pages count: the rest of the process's heap (a
    pytest-xdist worker holds earlier files') cannot move the figure, even where the
    kernel merged the pool's mappings with their neighbours into one."""
    page = os.sysconf("SC_PAGE_SIZE")
    present = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for start, end in ranges:
            first, last = start // page, (end - 1) // page
            pagemap.seek(first * 8)
            entries = memoryview(pagemap.read((last - first + 1) * 8)).cast("Q")
            present += sum(entry >> 63 for entry in entries)
    return present * page


def test_level_1_drains_offloads_and_wakes_to_the_same_tokens() -> None:
    llm = tiny()
    engine = llm.llm_engine
    before = weight_bytes(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    for _ in range(4):
        engine.step()
    assert (
        engine.engine_core.state.in_flight_steps
    )  # depth 2: a step is in flight when sleep is called
    engine.sleep(level=1, mode="keep")
    tape = events(engine)
    slept = next(i for i, e in enumerate(tape) if isinstance(e, ev.EngineSlept))
    assert tape[slept] == ev.EngineSlept(engine.engine_core.state.step, 1, [], ["0", "1", "2"])
    # Paused first, drained (the frame in flight applied), the cache reset, then asleep.
    kinds = [ev.kind_of(e) for e in tape[:slept]]
    pause = kinds.index("GenerationPaused")
    assert "FrameProduced" in kinds[pause:] and "PrefixCacheReset" in kinds[pause:]
    assert engine.is_sleeping() and engine.engine_core.state.sleeping_tags == (
        "weights",
        "kv_cache",
    )
    # The runner's tensors are freed: the weights live in the host copy, the packed copies and
    # the KV cache are gone.
    runner = engine.engine_core.runner
    assert weight_bytes(engine) == 0 and runner.kv_caches == []  # type: ignore[attr-defined]
    host = runner.memory.host_copy  # type: ignore[attr-defined]
    assert sum(t.untyped_storage().nbytes() for t in host.values()) == before
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]  # type: ignore[attr-defined]
    assert linears and all(m.packed_weight.empty for m in linears)
    drained = engine.step()  # the tokens of the drained frame, as after a pause
    assert {o.request_id for o in drained} == {"0", "1", "2"}
    assert (
        engine.step() == [] and not engine.engine_core.state.in_flight_steps
    )  # nothing runs asleep
    engine.wake_up()
    assert not engine.is_sleeping() and weight_bytes(engine) == before
    assert isinstance(events(engine)[-1], ev.GenerationResumed)
    done = run_to_end(engine)
    assert [done[str(i)] for i in range(3)] == reference(PROMPTS, GREEDY)
    clean(engine)


def written_kv_pool(llm: LLM) -> list[tuple[int, int]]:
    """Write 47 MiB of KV (12,000 tokens in distinct prompts, no prefix shared) and return
    the address ranges of the pool's tensors, checking that those pages are resident."""
    prompts = [[3 + (7 * i + j) % 250 for j in range(2000)] for i in range(6)]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    kv = llm.llm_engine.engine_core.runner.kv_caches  # type: ignore[attr-defined]
    pool = [(t.data_ptr(), t.data_ptr() + t.nbytes) for pair in kv for t in pair]
    held = resident_bytes(pool)
    assert held > 40 * 2**20, f"only {held / 2**20:.1f} MiB of the KV written is resident"
    return pool


def test_level_1_releases_the_kv_cache_pages() -> None:
    """The KV pool is committed as it is written: a sleep gives those pages back."""
    llm = tiny(num_kv_blocks=4096, pipeline_depth=1)  # 64k token slots of 4 KiB
    pool = written_kv_pool(llm)
    llm.sleep(level=1)
    # The pool's mappings are gone (a new small mapping may reuse an address: a few pages).
    left = resident_bytes(pool)
    assert left < 2 * 2**20, f"{left / 2**20:.1f} MiB of the KV cache still resident asleep"
    llm.wake_up()
    out = llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == reference([[5, 6, 7, 8]], GREEDY)[0]


def test_close_gives_the_kv_cache_and_the_weights_back_at_once() -> None:
    """A closed engine's memory goes when it is closed, not when the collector reaches the
    engine's reference cycles: a benchmark's vLLM, started next, was killed for memory
    while a closed Qwen3-0.6B engine still held 8 GB of KV cache."""
    llm = tiny(num_kv_blocks=4096, pipeline_depth=1)
    pool = written_kv_pool(llm)
    runner = llm.llm_engine.engine_core.runner
    model = runner.model  # type: ignore[attr-defined]
    assert len(runner.scratch) and len(model._stack_scratch)  # type: ignore[attr-defined]
    llm.close()  # the object stays referenced here, and the collector does not run
    left = resident_bytes(pool)
    assert left < 2 * 2**20, f"{left / 2**20:.1f} MiB of the KV cache still resident"
    assert weight_bytes(llm.llm_engine) == 0 and runner.kv_caches == []  # type: ignore[attr-defined]
    assert not len(runner.scratch) and not len(model._stack_scratch)  # type: ignore[attr-defined]


def test_level_2_drops_the_weights_and_rebuilds_them_from_the_seed() -> None:
    llm = tiny(seed=3)
    engine = llm.llm_engine
    original = engine.engine_core.runner.weights_id  # type: ignore[attr-defined]
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.step()
    engine.sleep(level=2, mode="keep")
    assert [o.request_id for o in engine.step()] == ["a"]  # its drained token
    assert weight_bytes(engine) == 0 and engine.engine_core.runner.memory.host_copy == {}  # type: ignore[attr-defined]
    engine.wake_up(tags=["kv_cache"])
    assert engine.is_sleeping() and engine.engine_core.state.sleeping_tags == ("weights",)
    engine.add_request("b", PROMPTS[1], GREEDY)  # arrives while the weights sleep: queued
    assert engine.step() == [] and engine.engine_core.state.requests["b"].status.value == "waiting"
    engine.wake_up(tags=["weights"])
    woke = [e for e in events(engine) if isinstance(e, ev.EngineWokeUp)]
    assert [w.tags for w in woke] == [["kv_cache"], ["weights"]]
    assert woke[0].weights_id is None and woke[1].weights_id == original
    assert engine.engine_core.state.weights_id == original and not engine.is_sleeping()
    done = run_to_end(engine)
    assert [done["a"], done["b"]] == reference(PROMPTS[:2], GREEDY, seed=3)
    clean(engine)


def test_level_2_then_new_weights_before_the_kv_cache_wakes() -> None:
    """The RL loop of vLLM's docs: sleep(2), wake the weights, load new ones, wake the rest."""
    llm = tiny()
    engine = llm.llm_engine
    engine.sleep(level=2)
    new = builtin_model("tiny", seed=1)[1].state_dict()
    with pytest.raises(RuntimeError, match="the weights sleep"):
        engine.update_weights(new)
    engine.wake_up(["weights"])
    weights_id = engine.update_weights(new)
    engine.wake_up(["kv_cache"])
    assert engine.engine_core.state.weights_id == weights_id
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == reference(PROMPTS, GREEDY, seed=1)
    clean(engine)


def test_the_default_mode_aborts_like_vllms() -> None:
    llm = oracle(pipeline_depth=3)
    engine = llm.llm_engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=50))
    for _ in range(4):
        engine.step()
    engine.sleep()  # level 1, mode "abort"
    finished = {o.request_id: o.outputs[0].finish_reason for o in engine.step()}
    assert finished == {"a": "abort", "b": "abort"}  # handed out by the next step
    slept = next(e for e in events(engine) if isinstance(e, ev.EngineSlept))
    assert slept.kept == [] and slept.in_flight == []
    engine.wake_up()
    clean(engine)


def test_a_request_that_arrives_asleep_is_served_after_the_wake_up() -> None:
    """vLLM #45268: a request that arrived during /sleep was parked for ever."""
    llm = oracle(pipeline_depth=2)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=12)
    engine.add_request("before", [5, 6, 7], params)
    engine.step()
    engine.sleep(level=1, mode="keep")
    engine.add_request("during", [8, 9, 10], params)
    engine.step()  # the drained frame's tokens
    for _ in range(5):
        assert engine.step() == []
    assert engine.engine_core.state.step == next(
        e.step for e in events(engine) if isinstance(e, ev.EngineSlept)
    )
    engine.wake_up(["scheduling"])  # wakes nothing that level 1 released: still asleep
    assert engine.is_sleeping()
    engine.wake_up()
    done = run_to_end(engine)
    runner = engine.engine_core.runner
    for req_id, prompt in (("before", [5, 6, 7]), ("during", [8, 9, 10])):
        assert done[req_id] == runner.expected_stream(prompt, params)  # type: ignore[attr-defined]
    clean(engine)


def test_level_0_releases_nothing_and_any_wake_up_resumes() -> None:
    llm = tiny(pipeline_depth=1)
    engine = llm.llm_engine
    before = weight_bytes(engine)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.step()
    engine.sleep(level=0, mode="keep")
    assert engine.is_sleeping() and engine.engine_core.state.sleeping_tags == ()
    assert weight_bytes(engine) == before and engine.engine_core.runner.kv_caches  # type: ignore[attr-defined]
    assert engine.engine_core.state.requests["a"].status.value == "running"  # kept with its KV
    assert engine.step() == []
    engine.wake_up(["scheduling"])
    assert not engine.is_sleeping()
    assert run_to_end(engine)["a"] == reference(PROMPTS[:1], GREEDY, pipeline_depth=1)[0]
    clean(engine)


def test_calls_refused_while_asleep_record_nothing() -> None:
    llm = oracle()
    engine = llm.llm_engine
    engine.sleep(level=1, mode="keep")
    engine.sleep(level=2)  # already asleep: nothing, as vLLM's
    n = engine.engine_core.state.num_events
    with pytest.raises(RuntimeError, match="the engine sleeps"):
        engine.resume_generation()
    with pytest.raises(RuntimeError, match="the engine sleeps"):
        engine.pause_generation("wait")
    with pytest.raises(RuntimeError, match="generate: the engine sleeps"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="unknown tag 'gpu'"):
        engine.wake_up(["gpu"])
    with pytest.raises(TypeError, match="tags must be a list"):
        engine.wake_up("weights")  # type: ignore[arg-type]
    assert engine.engine_core.state.num_events == n and engine.engine_core.state.sleep_level == 1
    engine.wake_up()
    with pytest.raises(ValueError, match="level must be in 0..2"):
        engine.sleep(level=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.sleep(mode="later")
    assert not engine.is_sleeping()
    clean(engine)


def test_is_sleeping_and_wake_up_on_a_paused_engine_are_vllms() -> None:
    """vLLM's is_sleeping is true while paused (its sleep level 0), and wake_up resumes."""
    engine = oracle().engine
    engine.pause_generation("keep")
    assert engine.is_sleeping() and engine.engine_core.state.sleep_level is None
    engine.wake_up()
    assert not engine.is_sleeping() and not engine.is_paused()
    assert isinstance(events(engine)[-1], ev.GenerationResumed)
    engine.wake_up()  # neither asleep nor paused: nothing
    assert isinstance(events(engine)[-1], ev.GenerationResumed)


def test_level_2_is_refused_where_the_weights_cannot_be_rebuilt() -> None:
    engine = tiny().engine
    engine.engine_core.runner.model_id = "a model built in memory"  # type: ignore[misc]
    n = engine.engine_core.state.num_events
    with pytest.raises(ValueError, match="sleep at level 1"):
        engine.sleep(level=2)
    assert engine.engine_core.state.num_events == n and not engine.is_paused()


def test_a_wake_up_the_runner_cannot_do_leaves_the_engine_asleep(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tokentape.engine.model.loader import save_checkpoint

    folder = tmp_path / "ckpt"
    save_checkpoint(builtin_model("tiny", seed=2)[1], folder)
    llm = LLM(model=str(folder), tape=None, num_kv_blocks=64, block_size=16)
    _OPEN.append(llm)
    engine = llm.llm_engine
    engine.sleep(level=2)
    for f in folder.glob("*.safetensors"):
        f.unlink()  # the checkpoint the weights were to be rebuilt from is gone
    n = engine.engine_core.state.num_events
    with pytest.raises(Exception, match="safetensors"):
        engine.wake_up()
    assert engine.engine_core.state.num_events == n and engine.engine_core.state.sleep_level == 2
    assert engine.engine_core.dead_reason is None
    save_checkpoint(builtin_model("tiny", seed=2)[1], folder)
    engine.wake_up()
    assert not engine.is_sleeping()
    clean(engine)


def test_abort_all_returns_the_ids_and_discards_the_frames_in_flight() -> None:
    llm = oracle(pipeline_depth=3, num_speculative_tokens=2)
    engine = llm.llm_engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=60))
    engine.add_request("p", [8, 9], SamplingParams(max_tokens=60, n=2))
    engine.add_request("done", [3, 4], SamplingParams(max_tokens=1))
    for _ in range(6):
        engine.step()
    assert engine.engine_core.state.in_flight_steps
    assert engine.abort_all() == ["a", "p"]  # p's two children, once
    assert engine.abort_all() == []
    run_to_end(engine)  # the frames in flight come back and are discarded
    reqs = engine.engine_core.state.requests
    assert [reqs[r].finish_reason for r in ("a", "0_p", "1_p", "done")] == [
        "abort",
        "abort",
        "abort",
        "length",
    ]
    aborted = [e.req_id for e in events(engine) if isinstance(e, ev.RequestAborted)]
    assert aborted == ["a", "0_p", "1_p"]
    clean(engine)


def test_a_sleepy_tape_replays_in_a_what_if() -> None:
    from tokentape.replay.whatif import whatif

    llm = oracle(pipeline_depth=2)
    engine = llm.llm_engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20))
    engine.step()
    engine.sleep(level=1, mode="keep")
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=20))
    engine.wake_up(["weights"])
    engine.wake_up()
    run_to_end(engine)
    result = whatif(engine.engine_core.tape, pipeline_depth=4)  # type: ignore[arg-type]
    assert result.diff.identical, result.diff
    kinds = [ev.kind_of(e) for _, e in result.tape.events()]
    assert kinds.count("EngineSlept") == 1 and kinds.count("EngineWokeUp") == 2
    assert kinds.count("GenerationResumed") == 1


def test_a_release_that_fails_ends_the_engine_on_the_tape() -> None:
    """Never an answer over a broken engine (vLLM #45520): a runner that fails to release its
    memory ends the engine, the failure is on the tape after EngineSlept, and every later call
    raises EngineDeadError."""
    from tokentape.errors import EngineDeadError

    engine = tiny().engine
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.step()

    def fail(runner: object, level: int) -> None:
        raise RuntimeError("pinned host memory exhausted")

    engine.engine_core.runner.memory.sleep = fail  # type: ignore[attr-defined,method-assign]
    with pytest.raises(RuntimeError, match="pinned host memory exhausted"):
        engine.sleep(level=1, mode="keep")
    assert engine.engine_core.dead_reason is not None
    with pytest.raises(EngineDeadError):
        engine.wake_up()
    with pytest.raises(EngineDeadError):
        engine.sleep()
    tape = events(engine)
    assert [ev.kind_of(e) for e in tape[-2:]] == ["EngineSlept", "EngineError"]
    result = verify(engine.engine_core.tape)
    assert result.ok and result.ended_with_error is not None


def test_fall_asleep_alone_is_refused_unless_paused_and_drained() -> None:
    engine = oracle(pipeline_depth=2).engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8))
    engine.step()
    n = engine.engine_core.state.num_events
    with pytest.raises(RuntimeError, match="only once paused and drained"):
        engine.engine_core.fall_asleep(1)
    assert engine.engine_core.state.num_events == n and engine.engine_core.dead_reason is None
    run_to_end(engine)
    clean(engine)


def test_a_chunked_transfer_between_the_wake_ups_of_a_level_2_sleep() -> None:
    """sleep(2), wake the weights, a chunked transfer, then the KV cache: the wake-up that
    would resume is refused while the transfer is open; the tokens are the new weights'."""
    llm = tiny()
    engine = llm.llm_engine
    engine.sleep(level=2)
    new = builtin_model("tiny", seed=1)[1].state_dict()
    with pytest.raises(RuntimeError, match="the weights sleep"):
        engine.start_weight_update()
    engine.wake_up(["weights"])
    assert engine.get_weight_version() == "default"
    engine.start_weight_update()
    for name, tensor in new.items():
        engine.update_weights({name: tensor})
    n = engine.engine_core.state.num_events
    with pytest.raises(RuntimeError, match="wake_up: a weight update is open"):
        engine.wake_up()
    assert engine.engine_core.state.num_events == n and engine.is_sleeping()
    engine.finish_weight_update(weight_version="rl-1")
    engine.wake_up()
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == reference(PROMPTS, GREEDY, seed=1)
    assert all(o.outputs[0].weight_version == "rl-1" for o in out)
    clean(engine)
