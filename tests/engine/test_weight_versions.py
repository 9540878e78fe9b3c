"""Weight versions (vLLM #49040's weight_version) and the chunked transfer (vLLM RFC #31848:
start_weight_update, update_weights per chunk, finish_weight_update), on the oracle, whose
weights are replaced and hashed as a model's while its tokens ignore them: every refusal
changes nothing, the tape holds enough to recompute every token's version, and replay verifies
the transfer without the weights."""

from __future__ import annotations

import asyncio
from typing import cast

import msgspec
import pytest
import torch

from tokentape import LLM, AsyncLLM, SamplingParams
from tokentape.engine.outputs import RequestOutputKind
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.engine.runners.oracle_weights import oracle_state_dict
from tokentape.events import schema as ev
from tokentape.events.fold_errors import ReducerError
from tokentape.events.reducer import evolve, initial_state
from tokentape.replay import load_tape, verify
from tokentape.replay.weight_versions import delivered_weight_versions

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def drive(llm: LLM, outs: dict[str, list], steps: int | None = None) -> None:
    """Step (all the way, or `steps` times), keeping every output of each request."""
    n = 0
    while llm.llm_engine.has_unfinished_requests() and (steps is None or n < steps):
        for out in llm.llm_engine.step():
            outs.setdefault(out.request_id, []).append(out)
        n += 1


def pause(llm: LLM, outs: dict[str, list]) -> None:
    llm.llm_engine.pause_generation(mode="keep", clear_cache=True)
    drive(llm, outs, 1)  # the drained tokens go out


def tape_events(llm: LLM) -> list[ev.Event]:
    tape = llm.llm_engine.engine_core.tape
    tape.flush()
    return [e for _, e in load_tape(tape.path or tape).events()]  # type: ignore[arg-type]


def test_versions_are_numbered_named_and_carried_by_every_token() -> None:
    llm = LLM(model="oracle", tape=None, pipeline_depth=2)
    engine = llm.llm_engine
    assert engine.get_weight_version() == "default"  # vLLM's initial version
    outs: dict[str, list] = {}
    engine.add_request("r", [5, 6, 7], PARAMS)
    delta = msgspec.structs.replace(PARAMS, output_kind=RequestOutputKind.DELTA)
    engine.add_request("d", [8, 9], delta)
    drive(llm, outs, 4)
    pause(llm, outs)
    n_before = len(outs["r"][-1].outputs[0].token_ids)  # delivered under the first weights
    engine.update_weights(oracle_state_dict(1))
    assert engine.get_weight_version() == "1"  # no version given: the update's number
    engine.update_weights(oracle_state_dict(2), weight_version=42)  # a trainer's step
    assert engine.get_weight_version() == "42"
    engine.resume_generation()
    drive(llm, outs)
    final = outs["r"][-1].outputs[0]
    # The oracle's stream is untouched by the weights; the versions say who computed what.
    assert final.token_ids == OracleRunner().expected_stream([5, 6, 7], PARAMS)
    assert final.weight_versions[:n_before] == ["default"] * n_before
    assert set(final.weight_versions[n_before:]) == {"42"}
    assert 0 < n_before < 12 and final.weight_version == "default"  # its first token's
    # DELTA: each output's versions are its own tokens'; together, the whole stream's.
    deltas = [o.outputs[0] for o in outs["d"]]
    assert all(len(c.weight_versions) == len(c.token_ids) for c in deltas)
    joined = [v for c in deltas for v in c.weight_versions]
    assert joined[0] == "default" and joined[-1] == "42" and len(joined) == 12
    # The tape alone gives every delivered token's version again (offline, as a postmortem).
    offline = delivered_weight_versions(llm.llm_engine.engine_core.tape)  # type: ignore[arg-type]
    assert offline["r"] == final.weight_versions and offline["d"] == joined
    updates = [e for e in tape_events(llm) if isinstance(e, ev.WeightsUpdated)]
    assert [u.weight_version for u in updates] == ["1", "42"]
    assert (
        engine.engine_core.state.weight_version == "42"
        and engine.engine_core.state.num_weight_updates == 2
    )


@pytest.mark.parametrize(
    ("version", "error", "match"),
    [
        (True, TypeError, "weight_version must be a string"),
        (1.5, TypeError, "weight_version must be a string"),
        ("x" * 300, ValueError, "at most 256 characters"),
        ("\ud800", ValueError, "valid Unicode"),
    ],
)
def test_a_bad_version_is_refused_before_anything_changes(version, error, match) -> None:
    llm = LLM(model="oracle", tape=None)
    llm.llm_engine.pause_generation(mode="keep")
    before = llm.llm_engine.engine_core.runner.weights.weights_id
    n = len(tape_events(llm))
    with pytest.raises(error, match=match):
        llm.llm_engine.update_weights(oracle_state_dict(1), weight_version=version)
    assert (
        len(tape_events(llm)) == n
        and llm.llm_engine.engine_core.runner.weights.weights_id == before
    )
    assert llm.llm_engine.get_weight_version() == "default"


def test_a_chunked_transfer_checks_each_chunk_and_loads_at_the_finish(tmp_path) -> None:
    llm = LLM(model="oracle", tape=str(tmp_path / "t.tape"), pipeline_depth=2)
    engine, weights = llm.llm_engine, llm.llm_engine.engine_core.runner.weights
    with pytest.raises(RuntimeError, match="start_weight_update: pause generation first"):
        engine.start_weight_update()
    engine.pause_generation(mode="keep")
    with pytest.raises(RuntimeError, match="no weight update is open"):
        engine.finish_weight_update()
    old_id = weights.weights_id
    new = oracle_state_dict(7)
    engine.start_weight_update()
    with pytest.raises(RuntimeError, match="already open"):
        engine.start_weight_update()
    assert engine.update_weights({"embed_tokens.weight": new["embed_tokens.weight"]}) is None
    n = len(tape_events(llm))
    # A bad chunk names its parameter, and nothing is recorded, held or loaded.
    for chunk, match in (
        ({"lm_head.weight": torch.zeros(95, 9)}, "'lm_head.weight' has shape \\(95, 9\\)"),
        ({"lm_head.bias": torch.zeros(95)}, "unknown tensor 'lm_head.bias'"),
        ({"lm_head.weight": torch.full((95, 8), float("nan"))}, "'lm_head.weight' holds 760 NaN"),
    ):
        with pytest.raises(ValueError, match=match):
            engine.update_weights(chunk)
    with pytest.raises(ValueError, match="give it to finish_weight_update"):
        engine.update_weights({"lm_head.weight": new["lm_head.weight"]}, weight_version="v")
    assert len(tape_events(llm)) == n and weights.weights_id == old_id
    with pytest.raises(RuntimeError, match="resume_generation: a weight update is open"):
        engine.resume_generation()
    assert engine.is_paused() and len(tape_events(llm)) == n
    buffer = new["lm_head.weight"].clone()
    engine.update_weights({"lm_head.weight": buffer})
    buffer.zero_()  # a trainer reusing its buffer: the chunk was copied when received
    assert weights.weights_id == old_id  # still the old weights until the finish
    weights_id = engine.finish_weight_update(weight_version="step-7")
    assert weights_id == weights.weights_id != old_id
    assert (
        engine.engine_core.state.weight_update_chunks is None
        and engine.get_weight_version() == "step-7"
    )
    engine.resume_generation()
    llm.generate([[5, 6, 7]], PARAMS)
    llm.close()
    # The same weights in one update hash the same.
    whole = LLM(model="oracle", tape=None)
    whole.llm_engine.pause_generation(mode="keep")
    assert whole.llm_engine.update_weights(new) == weights_id
    events = [e for _, e in load_tape(tmp_path / "t.tape").events()]
    kinds = [ev.kind_of(e) for e in events if "Weight" in ev.kind_of(e)]
    assert kinds == [
        "WeightUpdateStarted",
        "WeightChunkReceived",
        "WeightChunkReceived",
        "WeightsUpdated",
    ]
    chunks = [e for e in events if isinstance(e, ev.WeightChunkReceived)]
    assert [c.names for c in chunks] == [["embed_tokens.weight"], ["lm_head.weight"]]
    assert chunks[1].shapes == [[95, 8]] and chunks[1].hashes[0].startswith("sha256:")
    assert verify(tmp_path / "t.tape").ok  # the recorded hashes stand for the weights
    assert load_tape(tmp_path / "t.tape").fold().weight_version == "step-7"


def test_a_second_transfer_writes_into_the_first_ones_memory_not_the_weights() -> None:
    """The memory of a finished transfer's chunks takes the next one's: the weights that
    serve are not it, and stay as they were until the finish."""
    llm = LLM(model="oracle", tape=None)
    engine = llm.llm_engine
    weights = cast(OracleRunner, engine.engine_core.runner).weights
    engine.pause_generation(mode="keep")
    ids = []
    for seed in (7, 8):
        engine.start_weight_update()
        before = weights.weights_id
        engine.update_weights(oracle_state_dict(seed))
        weights._forget_weights_id()  # hashed again from the weights themselves
        assert weights.weights_id == before
        ids.append(engine.finish_weight_update())
    whole = LLM(model="oracle", tape=None)
    whole.llm_engine.pause_generation(mode="keep")
    assert [whole.llm_engine.update_weights(oracle_state_dict(s)) for s in (7, 8)] == ids


def test_an_empty_transfer_publishes_a_version_over_the_same_weights() -> None:
    llm = LLM(model="oracle", tape=None)
    llm.llm_engine.pause_generation(mode="keep")
    before = llm.llm_engine.engine_core.runner.weights.weights_id
    llm.llm_engine.start_weight_update()
    assert llm.llm_engine.finish_weight_update() == before
    assert llm.llm_engine.get_weight_version() == "1"


def test_the_reducer_refuses_weights_changed_with_steps_in_flight() -> None:
    state = initial_state()
    evolve(state, ev.RequestAdded(0, "r", [5, 6], PARAMS))
    evolve(state, ev.StepScheduled(0, [ev.ScheduledEntry("r", 0, 0, 2, 0, [0])]))
    with pytest.raises(ReducerError, match="1 step\\(s\\) in flight"):
        evolve(state, ev.WeightsUpdated(1, "sha256:x", "v"))
    with pytest.raises(ReducerError, match="no update started"):
        evolve(state, ev.WeightChunkReceived(1, ["a"], [[1]], ["sha256:y"]))


def test_a_version_3_update_without_a_version_reads_as_its_number() -> None:
    state = initial_state()
    old = ev.decode(ev.encode(ev.WeightsUpdated(0, "sha256:x")))  # as a format-3 tape holds it
    evolve(state, old)
    evolve(state, ev.WeightsUpdated(0, "sha256:y", "named"))
    evolve(state, ev.WeightsUpdated(0, "sha256:z"))
    assert state.weight_version == "3" and state.weights_id == "sha256:z"


@pytest.mark.parametrize("multiprocess", [True, False], ids=["process", "inproc"])
def test_async_llm_has_the_same_calls(tmp_path, multiprocess: bool) -> None:
    """AsyncLLM: the transfer's chunks cross to the engine core (state_dicts as safetensors),
    its refusals come back with their type and message, and every output carries its version."""
    tape = str(tmp_path / "async.tape")
    engine = AsyncLLM("oracle", tape=tape, multiprocess_mode=multiprocess, block_size=4)
    new = oracle_state_dict(3)
    delta = msgspec.structs.replace(PARAMS, output_kind=RequestOutputKind.DELTA)

    async def main() -> tuple[list, list]:
        before = [o async for o in engine.generate([5, 6, 7], delta, "a")]
        assert await engine.get_weight_version() == "default"
        await engine.pause_generation(mode="keep")
        await engine.start_weight_update()
        assert await engine.update_weights({"lm_head.weight": new["lm_head.weight"]}) is None
        with pytest.raises(ValueError, match="'embed_tokens.weight' has shape \\(2,\\)"):
            await engine.update_weights({"embed_tokens.weight": torch.zeros(2)})
        with pytest.raises(RuntimeError, match="call finish_weight_update first"):
            await engine.resume_generation()
        await engine.update_weights({"embed_tokens.weight": new["embed_tokens.weight"]})
        weights_id = await engine.finish_weight_update(weight_version="rl-step-3")
        assert weights_id.startswith("sha256:")
        assert await engine.get_weight_version() == "rl-step-3"
        await engine.resume_generation()
        after = [o async for o in engine.generate([5, 6, 7], delta, "b")]
        return before, after

    try:
        before, after = asyncio.run(main())
    finally:
        engine.shutdown()
    assert {v for o in before for v in o.outputs[0].weight_versions} == {"default"}
    assert {v for o in after for v in o.outputs[0].weight_versions} == {"rl-step-3"}
    assert sum(len(o.outputs[0].weight_versions) for o in after) == PARAMS.max_tokens
    assert verify(tape).ok
