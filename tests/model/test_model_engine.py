"""The real model through the engine: the paged, batched, chunked, pipelined path gives the
tokens and logprobs of a plain dense forward pass, and the same tokens whatever the schedule."""

from __future__ import annotations

import ctypes
import glob
import os
import random
import threading
import time

import msgspec
import pytest
import torch
from dense_reference import dense_greedy, dense_logits

from tokentape import LLM, SamplingParams
from tokentape.engine.model.loader import builtin_model
from tokentape.events import schema as ev
from tokentape.kernels import cpu_native
from tokentape.replay import verify

PROMPTS = ["Hello", "The quick brown fox jumps", "a", "tokentape " * 6, "0123456789" * 3]


def tiny_llm(**kw: object) -> LLM:
    # The CPU in float32 (batch-invariant) whatever the machine has: the tests compare bits.
    args: dict[str, object] = {
        "model": "tiny",
        "device": "cpu",
        "tape": None,
        "block_size": 4,
        "num_kv_blocks": 128,
    }
    args.update(kw)
    return LLM(**args)  # type: ignore[arg-type]


def run_tokens(
    llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_matches_a_dense_forward_pass() -> None:
    _, model = builtin_model("tiny", 0)
    llm = tiny_llm(max_num_batched_tokens=16)  # chunked prefills mixed with decodes
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = run_tokens(llm, PROMPTS, params)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == dense_greedy(model, llm.tokenizer.encode(prompt), 12)


def test_frame_logprobs_are_the_raw_log_softmax() -> None:
    _, model = builtin_model("tiny", 0)
    llm = tiny_llm()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS[:2], params)
    frames = [
        e
        for _, event in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(event, ev.FrameProduced)
        for e in event.entries
    ]
    by_req: dict[str, list[float]] = {}
    for f in frames:
        assert f.logprobs is not None and len(f.logprobs) == len(f.token_ids)
        by_req.setdefault(f.req_id, []).extend(f.logprobs)
    for o in outs:
        tokens = o.prompt_token_ids + o.outputs[0].token_ids
        ref = dense_logits(model, tokens).log_softmax(-1)
        n = len(o.prompt_token_ids)
        expected = [float(ref[n - 1 + i, t]) for i, t in enumerate(o.outputs[0].token_ids)]
        assert by_req[o.request_id] == pytest.approx(expected, abs=1e-4)
        assert o.outputs[0].logprobs == by_req[o.request_id]


def test_no_logprobs_unless_asked() -> None:
    llm = tiny_llm()
    llm.generate(["Hi"], SamplingParams(max_tokens=3))
    frames = [
        e
        for _, event in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(event, ev.FrameProduced)
        for e in event.entries
    ]
    assert frames and all(f.logprobs is None for f in frames)


MIXED = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.8, top_k=20, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.2, top_p=0.9, seed=11, ignore_eos=True),
]


def test_batch_size_1_and_32_give_identical_tokens_and_logprobs() -> None:
    # Logprobs compared bit for bit: stricter than tokens, which rarely flip on a last-bit change.
    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(32)]
    params = [msgspec.structs.replace(MIXED[i % len(MIXED)], logprobs=0) for i in range(32)]
    batched = tiny_llm(num_kv_blocks=512).generate(prompts, params)
    alone = tiny_llm(max_num_seqs=1).generate(prompts, params)  # one sequence per step
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in alone]
    assert [o.outputs[0].logprobs for o in batched] == [o.outputs[0].logprobs for o in alone]


@pytest.mark.parametrize("lanes", [2, 3])
def test_sharing_a_step_over_lanes_gives_the_same_bits(lanes: int) -> None:
    """cpu_threads > 1 shares each step's sequences out over that many threads: prefill chunks,
    decodes with speculative tokens and samples all keep their bits, logprobs included."""
    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(24)] + ["abcabcabcabc"] * 4
    params = [msgspec.structs.replace(MIXED[i % len(MIXED)], logprobs=0) for i in range(28)]
    kwargs = {"num_kv_blocks": 512, "max_num_batched_tokens": 64, "num_speculative_tokens": 2}
    one = tiny_llm(cpu_threads=1, **kwargs).generate(prompts, params)
    llm = tiny_llm(cpu_threads=lanes, **kwargs)
    runner = llm.llm_engine.engine_core.runner
    runner.min_lane_work = 0  # share out every step, however small (see the test below)
    threads: set[str] = set()
    logits = runner._logits

    def spy(entries: list[object]) -> torch.Tensor:
        threads.add(threading.current_thread().name)
        return logits(entries)  # type: ignore[arg-type]

    runner._logits = spy  # type: ignore[method-assign]
    shared = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in shared] == [o.outputs[0].token_ids for o in one]
    assert [o.outputs[0].logprobs for o in shared] == [o.outputs[0].logprobs for o in one]
    expected = {"tokentape-model-runner"} | {f"tokentape-model-lane-{i}" for i in range(1, lanes)}
    assert threads == expected


def test_a_step_on_one_lane_shares_its_matmuls_and_decodes_with_the_helper() -> None:
    """With two CPU threads a step too small for two lanes runs on one, lent the runner's
    helper thread (kernels/cpu/helper.c): the same bits as one thread, logprobs included,
    and the helper took part."""
    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(12)] + ["abcabcabcabc"] * 2
    params = [msgspec.structs.replace(MIXED[i % len(MIXED)], logprobs=0) for i in range(14)]
    kwargs = {"num_kv_blocks": 512, "max_num_batched_tokens": 64, "num_speculative_tokens": 2}
    one = tiny_llm(cpu_threads=1, **kwargs)
    assert one.llm_engine.engine_core.runner._helper is None
    llm = tiny_llm(cpu_threads=2, **kwargs)
    helper = llm.llm_engine.engine_core.runner._helper
    if helper is None:
        pytest.skip(f"no compiled CPU kernels here: {cpu_native.load_error()}")
    shared = llm.generate(prompts, params)
    want = one.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in shared] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].logprobs for o in shared] == [o.outputs[0].logprobs for o in want]
    assert helper.items_done > 0


def test_lanes_start_later_where_the_helper_takes_half_of_the_matmuls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One lane with the helper beats two up to a bigger step where the helper can split
    the matmuls (MKL's packed GEMM); with another backend it shares only the attention, and
    a step is shared out over lanes from the old size. The bits stay the same either way."""
    from tokentape.engine.model import cpu_matmul
    from tokentape.engine.runners.input_batch import MIN_LANE_WORK, MIN_LANE_WORK_SPLIT_MATMULS

    if cpu_native.load() is None:
        pytest.skip(f"no compiled CPU kernels here: {cpu_native.load_error()}")
    expected = {"mkl": MIN_LANE_WORK_SPLIT_MATMULS, "onednn": MIN_LANE_WORK}
    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    for name, least in expected.items():
        if name not in cpu_matmul.available():
            continue
        monkeypatch.setattr(cpu_matmul, "BACKEND", cpu_matmul.available()[name])
        llm = tiny_llm(cpu_threads=2)
        assert llm.llm_engine.engine_core.runner.min_lane_work == least, name
        one = tiny_llm(cpu_threads=1).generate(prompts, params)
        two = llm.generate(prompts, params)
        assert [o.outputs[0].logprobs for o in two] == [o.outputs[0].logprobs for o in one]


def test_a_big_model_shares_its_matmuls_instead_of_the_batch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Above input_batch.LANES_MAX_WEIGHT_BYTES the step runs as one lane on all the threads
    (intra-op): the same bits as one thread, logprobs included."""
    from tokentape.engine.runners import input_batch

    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(12)] + ["abcabcabcabc"] * 2
    params = [msgspec.structs.replace(MIXED[i % len(MIXED)], logprobs=0) for i in range(14)]
    kwargs = {"num_kv_blocks": 512, "max_num_batched_tokens": 64, "num_speculative_tokens": 2}
    one = tiny_llm(cpu_threads=1, **kwargs).generate(prompts, params)
    monkeypatch.setattr(input_batch, "LANES_MAX_WEIGHT_BYTES", 0)
    llm = tiny_llm(cpu_threads=2, **kwargs)
    runner = llm.llm_engine.engine_core.runner
    assert runner._lanes == []
    assert runner._worker.run(torch.get_num_threads) == 2
    shared = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in shared] == [o.outputs[0].token_ids for o in one]
    assert [o.outputs[0].logprobs for o in shared] == [o.outputs[0].logprobs for o in one]


def test_a_step_goes_to_another_lane_only_with_enough_work() -> None:
    """A lane's pass has a fixed cost (input_batch.MIN_LANE_WORK): a small step stays on one
    lane, a big one is shared out over as many lanes as it holds the minimum of work."""
    from tokentape.engine.runners.input_batch import (
        FLOPS_PER_BYTE,
        EntryInputs,
        SeqState,
        split_over_lanes,
    )

    def decodes(n: int, context: int) -> list[EntryInputs]:
        seq = SeqState(
            SamplingParams(), 0, [1] * context, list(range(context // 16 + 1)), context - 1
        )
        return [EntryInputs(f"r{i}", seq, [1], context - 1, [], samples=True) for i in range(n)]

    def lanes(num_lanes: int, least: int) -> list[int]:  # 1,000 flops a token, 10 KV bytes
        return [len(s) for s in split_over_lanes(decodes(8, 100), num_lanes, 16, 1_000, 10, least)]

    total = 8 * (1_000 + 100 * 10 * FLOPS_PER_BYTE)  # each decode's token and its context
    assert lanes(4, total + 1) == [8]
    assert lanes(4, total // 2) == [4, 4]
    assert sorted(lanes(4, total // 3)) == [2, 3, 3]
    assert lanes(4, 0) == [2, 2, 2, 2]
    assert lanes(1, 0) == [8]


def test_choose_lanes() -> None:
    from tokentape.engine.runners.input_batch import LANES_MAX_WEIGHT_BYTES, choose_lanes

    assert choose_lanes(LANES_MAX_WEIGHT_BYTES, 2) == (2, 1)
    assert choose_lanes(LANES_MAX_WEIGHT_BYTES + 1, 2) == (1, 2)
    assert choose_lanes(1, 1) == (1, 1)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_preemptions_and_pipelining_do_not_change_tokens(depth: int) -> None:
    prompts = [f"request {i}: " + "xyz" * i for i in range(12)]
    params = [MIXED[i % len(MIXED)] for i in range(12)]
    reference = run_tokens(tiny_llm(num_kv_blocks=256, async_scheduling=False), prompts, params)
    llm = tiny_llm(num_kv_blocks=24, pipeline_depth=depth, max_num_batched_tokens=24)
    got = run_tokens(llm, prompts, params)
    assert sum(r.num_preemptions for r in llm.llm_engine.engine_core.state.requests.values()) > 0
    assert got == reference


def test_speculative_decoding_gives_the_same_tokens() -> None:
    prompts = ["abcabcabcabc", "the cat the cat the cat", "xyz"]
    params = [MIXED[0], MIXED[1], MIXED[3]]
    plain = run_tokens(tiny_llm(), prompts, params)
    llm = tiny_llm(num_speculative_tokens=3)
    assert run_tokens(llm, prompts, params) == plain
    frames = [
        e
        for _, event in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(event, ev.FrameProduced)
        for e in event.entries
    ]
    assert any(f.draft_token_ids for f in frames)


def test_seed_keys_the_samples() -> None:
    def p(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)

    a = run_tokens(tiny_llm(), ["Hello", "Hello"], [p(1), p(1)])
    b = run_tokens(tiny_llm(), ["Hello"], [p(2)])
    assert a[0] == a[1] != b[0]


def test_a_model_tape_verifies_without_the_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "model.tape"
    llm = tiny_llm(tape=str(path), num_kv_blocks=24, num_speculative_tokens=2)
    llm.generate([f"p{i} " * 5 for i in range(6)], MIXED[1])
    llm.close()
    result = verify(path)
    assert result.ok, result.first_divergence and result.first_divergence.format()


def test_a_runner_failure_is_recorded_and_raised() -> None:
    llm = tiny_llm(pipeline_depth=2)
    llm.llm_engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8))
    llm.llm_engine.step()
    # A KV cache that no longer fits the model: the worker thread's forward pass fails.
    llm.llm_engine.engine_core.runner.kv_caches[0] = (torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="k_cache"):
        while True:
            llm.llm_engine.step()
    errors = [
        e for _, e in llm.llm_engine.engine_core.tape.iter_events() if isinstance(e, ev.EngineError)
    ]
    assert len(errors) == 1 and "k_cache" in errors[0].message


def test_prefix_cache_hits_read_the_same_kv() -> None:
    shared = "a shared system prompt, long enough to fill blocks. "
    prompts = [shared + tail for tail in ("first", "second one", "third")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    cached_llm = tiny_llm()
    cached = cached_llm.generate(prompts[:1], params) + cached_llm.generate(prompts[1:], params)
    hits = [
        e
        for _, event in cached_llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(event, ev.StepScheduled)
        for e in event.entries
        if e.num_computed_before > 0 and e.req_id != "0" and len(e.new_block_ids) > 1
    ]
    assert hits  # the later requests started from cached blocks
    plain = tiny_llm(enable_prefix_caching=False).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    for a, b in zip(cached, plain):
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-5)


@pytest.mark.parametrize("policy", ["epoch", "counter", "flag"])
@pytest.mark.parametrize("depth,spec", [(1, 0), (3, 2)])
def test_stress_preempt_abort_pause_reset_and_verify(policy: str, depth: int, spec: int) -> None:
    """The model under KV pressure, speculative decoding, an abort, a pause with a cache reset
    and a reset of running requests: it finishes every request and its tape verifies."""
    rng = random.Random(f"{policy}-{depth}-{spec}")
    llm = tiny_llm(
        num_kv_blocks=12,
        pipeline_depth=depth,
        num_speculative_tokens=spec,
        discard_policy=policy,
        max_num_batched_tokens=20,
        max_model_len=48,
    )
    engine = llm.llm_engine
    for i in range(8):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(1, 30))]
        engine.add_request(
            str(i),
            prompt,
            SamplingParams(
                max_tokens=rng.randint(1, 30),
                temperature=rng.choice([0.0, 1.0]),
                seed=i,
                stop_token_ids=(rng.randrange(3, 259),),
            ),
        )
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 5:
            engine.abort_request("3")
        if steps == 9:
            engine.pause_generation("keep", clear_cache=True)
            engine.step()
            engine.resume_generation()
        if steps == 14:
            engine.reset_prefix_cache(reset_running_requests=True)
    assert all(r.is_finished for r in engine.engine_core.state.requests.values())
    result = verify(engine.engine_core.tape)
    assert result.ok, result.first_divergence and result.first_divergence.format()


def test_the_worker_thread_runs_on_the_engines_cpu_threads() -> None:
    """OpenMP's thread count is per thread: each of the runner's lanes must run on one, or
    oneDNN's matmuls there would run on every core, against the other lanes."""
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))
    if not libs:
        pytest.skip("this torch build does not ship GNU OpenMP")
    omp_max_threads = ctypes.CDLL(libs[0]).omp_get_max_threads
    llm = tiny_llm(pipeline_depth=2, cpu_threads=2)
    runner = llm.llm_engine.engine_core.runner
    runner.min_lane_work = 0  # two prompts are too little to share out otherwise
    seen: list[tuple[str, int]] = []
    forward = runner.model.forward

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append((threading.current_thread().name, omp_max_threads()))
        return forward(*args, **kwargs)

    runner.model.forward = spy  # type: ignore[method-assign]
    llm.generate(["Hello", "world"], SamplingParams(max_tokens=3, temperature=0.0))
    llm.close()
    assert set(seen) == {("tokentape-model-runner", 1), ("tokentape-model-lane-1", 1)}


@pytest.mark.parametrize("depth", [1, 2])
def test_building_an_engine_leaves_the_callers_thread_count_alone(depth: int) -> None:
    """The engine's cpu_threads apply to its worker thread only: the caller's count, and the
    count a thread started later begins with, stay what they were (transformers, or anything
    else in the process, runs on its own settings)."""
    if os.cpu_count() == 1:
        pytest.skip("one CPU: every count is 1")
    before = torch.get_num_threads()
    seen_in_worker: list[int] = []
    llm = tiny_llm(pipeline_depth=depth, cpu_threads=1)
    forward = llm.llm_engine.engine_core.runner.model.forward

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen_in_worker.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    llm.llm_engine.engine_core.runner.model.forward = spy  # type: ignore[method-assign]
    llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0))
    in_a_new_thread: list[int] = []
    t = threading.Thread(target=lambda: in_a_new_thread.append(torch.get_num_threads()))
    t.start()
    t.join()
    llm.close()
    assert before > 1 and seen_in_worker and set(seen_in_worker) == {1}
    assert torch.get_num_threads() == before
    assert in_a_new_thread == [before]


def test_pipelined_steps_run_on_the_worker_thread_in_order() -> None:
    """With depth 2 the forward pass runs off the engine's thread, and the engine hands over
    step N + 1 while step N is still running (it does not wait for N's frame to plan it)."""
    llm = tiny_llm(pipeline_depth=2, cpu_threads=1)  # one lane: every forward on the worker
    runner = llm.llm_engine.engine_core.runner
    threads: set[str] = set()
    overlapped: list[bool] = []
    forward = runner.model.forward

    def forward_that_waits_for_the_next_step(*args: object, **kwargs: object) -> torch.Tensor:
        threads.add(threading.current_thread().name)
        if len(overlapped) < 3:  # hold the first steps until the engine submits the next one
            deadline = time.monotonic() + 10
            while not runner._worker.num_pending and time.monotonic() < deadline:
                time.sleep(0.001)
            overlapped.append(runner._worker.num_pending > 0)  # step N + 1 queued behind us
        return forward(*args, **kwargs)

    runner.model.forward = forward_that_waits_for_the_next_step  # type: ignore[method-assign]
    out = llm.generate(["Hello", "world"], SamplingParams(max_tokens=8, temperature=0.0))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert threads == {"tokentape-model-runner"}
    assert overlapped == [True, True, True]
