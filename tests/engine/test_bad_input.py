"""Input that would kill the engine or the tape is refused with a clear TypeError/ValueError
before anything is recorded; the requests in flight finish untouched and the tape verifies.

Before these checks, `logprobs=True` was recorded and the tape was unreadable from that event
on (msgspec decodes strictly: `Expected int | null, got bool`), and an int beyond 64 bits or
a lone surrogate in a request id killed the engine with every request in flight.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentape import LLM, SamplingParams
from tokentape.cli import main as cli_main
from tokentape.engine.config import EngineConfig
from tokentape.engine.core.engine_core import EngineCore
from tokentape.events import schema as ev
from tokentape.replay import fold, load_tape, verify

NAN, INF = math.nan, math.inf

# (field named in the message, SamplingParams kwargs)
BAD_PARAMS: list[tuple[str, dict[str, Any]]] = [
    ("max_tokens", dict(max_tokens=True)),
    ("max_tokens", dict(max_tokens=False)),
    ("max_tokens", dict(max_tokens=2**64)),
    ("max_tokens", dict(max_tokens=2**63)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=4.0)),
    ("max_tokens", dict(max_tokens=None)),
    ("temperature", dict(temperature=NAN)),
    ("temperature", dict(temperature=INF)),
    ("temperature", dict(temperature=-INF)),
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature=10**400)),
    ("temperature", dict(temperature=True)),
    ("temperature", dict(temperature="0.5")),
    ("top_p", dict(top_p=NAN)),
    ("top_p", dict(top_p=INF)),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=True)),
    ("top_k", dict(top_k=True)),
    ("top_k", dict(top_k=2**64)),
    ("top_k", dict(top_k=-1)),
    ("seed", dict(seed=True)),
    ("seed", dict(seed=2**63)),
    ("seed", dict(seed=-(2**63) - 1)),
    ("seed", dict(seed=1.0)),
    ("stop_token_ids[0]", dict(stop_token_ids=(True,))),
    ("stop_token_ids[1]", dict(stop_token_ids=[5, 2**64])),
    ("stop_token_ids[0]", dict(stop_token_ids=(-1,))),
    ("stop_token_ids[0]", dict(stop_token_ids=(1.0,))),
    ("stop_token_ids", dict(stop_token_ids=5)),
    ("stop_token_ids", dict(stop_token_ids="12")),
    ("ignore_eos", dict(ignore_eos=1)),
    ("ignore_eos", dict(ignore_eos=None)),
    ("logprobs", dict(logprobs=True)),
    ("logprobs", dict(logprobs=False)),
    ("logprobs", dict(logprobs=2**64)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=1.5)),
]

# (text in the message, request id, prompt, params); vocabulary 259 (the byte tokenizer's)
BAD_REQUESTS: list[tuple[str, Any, Any, Any]] = [
    ("request_id", "\ud800", [5, 6], None),
    ("request_id", "bad\udcff", [5, 6], None),
    ("request_id", "", [5, 6], None),
    ("request_id", 5, [5, 6], None),
    ("request_id", None, [5, 6], None),
    ("request_id", b"bytes", [5, 6], None),
    ("already in use", "r0", [5, 6], None),
    ("prompt_token_ids[1]", "p-bool", [5, True], None),
    ("prompt_token_ids[0]", "p-false", [False], None),
    ("prompt_token_ids[1]", "p-2**64", [5, 2**64], None),
    ("prompt_token_ids[1]", "p-2**63", [5, 2**63], None),
    ("prompt_token_ids[1]", "p-neg", [5, -1], None),
    ("prompt_token_ids[1]", "p-float", [5, 6.0], None),
    ("prompt_token_ids[2]", "p-vocab", [5, 6, 259], None),
    ("prompt_token_ids", "p-bytes", b"\x05\x06", None),
    ("prompt_token_ids", "p-int", 7, None),
    ("prompt_token_ids", "p-none", None, None),
    ("empty", "p-empty", [], None),
    ("SamplingParams", "p-dict", [5, 6], {"max_tokens": 3}),
]

BAD_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    *[
        (name, {name: True})
        for name in (
            "pipeline_depth",
            "num_speculative_tokens",
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "seed",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "cpu_threads",
        )
    ],
    ("seed", dict(seed=False)),
    ("seed", dict(seed=2**63)),
    ("seed", dict(seed=-(2**63) - 1)),
    ("seed", dict(seed=1180591620717411303424)),
    ("num_kv_blocks", dict(num_kv_blocks=2**64)),
    ("block_size", dict(block_size=2.0)),
    ("num_kv_blocks * block_size", dict(num_kv_blocks=2**40, block_size=2**40)),
    ("async_scheduling", dict(async_scheduling=1)),
    ("enable_prefix_caching", dict(enable_prefix_caching=None)),
    ("batch_invariant", dict(batch_invariant=0)),
    ("model", dict(model=5)),
    ("model", dict(model="\ud800")),
    ("discard_policy", dict(discard_policy=None)),
    ("device", dict(device=0)),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD_PARAMS)
def test_bad_sampling_params_are_refused_naming_the_field(
    field: str, kwargs: dict[str, Any]
) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(f"{field} must be")


@pytest.mark.parametrize(("field", "kwargs"), BAD_CONFIGS)
def test_bad_engine_config_is_refused_naming_the_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        EngineConfig(model="oracle", **kwargs) if "model" not in kwargs else EngineConfig(**kwargs)
    assert str(info.value).startswith(f"{field} must be")


def test_numbers_are_normalised_so_params_equal_their_copy_from_the_tape() -> None:
    p = SamplingParams(temperature=0, top_p=1, stop_token_ids=[7, 8])
    assert type(p.temperature) is float and type(p.top_p) is float and p.stop_token_ids == (7, 8)
    event = ev.RequestAdded(0, "r", [5], p)
    assert ev.decode(ev.encode(event)) == event


# -- whatever SamplingParams and EngineConfig accept, the tape can hold and read back ---------

ANY_VALUE = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.one_of(st.booleans(), st.integers(-(2**66), 2**66), st.floats()), max_size=3),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(list(SamplingParams.__struct_fields__)), ANY_VALUE))
def test_accepted_sampling_params_round_trip_through_the_tape(kwargs: dict[str, Any]) -> None:
    try:
        params = SamplingParams(**kwargs)
    except (TypeError, ValueError):
        return
    event = ev.RequestAdded(3, "req", [5, 6], params)
    assert ev.decode(ev.encode(event)) == event


INT_CONFIG_FIELDS = [
    "pipeline_depth",
    "num_speculative_tokens",
    "block_size",
    "num_kv_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "seed",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "cpu_threads",
    "async_scheduling",
    "enable_prefix_caching",
    "batch_invariant",
]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(INT_CONFIG_FIELDS), ANY_VALUE, max_size=3))
def test_accepted_engine_configs_round_trip_through_the_tape_header(kwargs: dict[str, Any]) -> None:
    try:
        config = EngineConfig(model="oracle", **kwargs)
    except (TypeError, ValueError):
        return
    header = ev.TapeHeader(
        ev.FORMAT_VERSION,
        msgspec.to_builtins(config),
        config.discard_policy,
        "oracle",
        config.seed,
        "0",
    )
    decoded = ev.decode_header(ev.encode_header(header))
    assert decoded == header and EngineConfig(**decoded.config) == config


# -- in a running engine: nothing recorded, nothing lost, the engine keeps serving --------------

GOOD = {
    f"r{i}": ([3 + i, 9, 10 + i, 4] * (1 + i), SamplingParams(max_tokens=12 + 3 * i, seed=i))
    for i in range(5)
}


def run(llm: LLM, bad_inputs: Callable[[LLM], None] | None) -> dict[str, list[int]]:
    """Add GOOD, step a few times, try the bad inputs with requests in flight, finish."""
    engine = llm.llm_engine
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids  # cumulative: every token so far

    for req_id, (prompt, params) in GOOD.items():
        engine.add_request(req_id, prompt, params)
    for _ in range(3):
        step()
    if bad_inputs is not None:
        assert (
            engine.engine_core.state.in_flight_steps or engine.engine_core.depth == 1
        )  # the pipeline is busy
        bad_inputs(llm)
    while engine.has_unfinished_requests():
        step()
    return outputs


def try_every_bad_input(llm: LLM) -> None:
    engine = llm.llm_engine

    def num_events() -> int:
        engine.engine_core.tape.flush()
        return len(load_tape(engine.engine_core.tape.path))

    before = num_events()
    for i, (field, kwargs) in enumerate(BAD_PARAMS):
        with pytest.raises(
            (TypeError, ValueError), match=f"^{field.replace('[', '.').replace(']', '.')} must be"
        ):
            engine.add_request(f"bad{i}", [5, 6], SamplingParams(**kwargs))
    for text, req_id, prompt, params in BAD_REQUESTS:
        with pytest.raises((TypeError, ValueError)) as info:
            engine.add_request(req_id, prompt, params)
        assert text in str(info.value)
    # Engine commands whose flags go on the tape as booleans.
    for command, name in (
        (lambda: engine.reset_prefix_cache(reset_running_requests=1), "reset_running_requests"),
        (lambda: engine.pause_generation("keep", clear_cache=1), "clear_cache"),
        (lambda: engine.pause_generation("nap"), "mode"),
    ):
        with pytest.raises((TypeError, ValueError), match=name):
            command()
    # LLM.generate checks every prompt before adding any: the good ones first are not added.
    for prompts in (["fine", "\ud800"], [[5, 6], [5, True]], [[5, 6], [2**64]], [[5, 6], 7.5]):
        with pytest.raises((TypeError, ValueError), match=r"prompt"):
            llm.generate(prompts)
    with pytest.raises(TypeError, match="logprobs"):
        llm.generate([[5, 6]], SamplingParams(logprobs=True))
    assert set(engine.engine_core.state.requests) == set(GOOD)
    assert num_events() == before  # not one event recorded
    assert not engine.engine_core._dead


def tape_events(path: Path) -> list[ev.Event]:
    return [e for _, e in load_tape(path).events()]


@pytest.mark.parametrize(("depth", "k"), [(1, 0), (2, 0), (3, 2)])
def test_bad_input_in_flight_changes_nothing(tmp_path: Path, depth: int, k: int) -> None:
    kwargs: dict[str, Any] = dict(
        model="oracle",
        pipeline_depth=depth,
        num_speculative_tokens=k,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=16,
    )
    clean_path, path = tmp_path / "clean.tape", tmp_path / "bad.tape"
    with LLM(tape=clean_path, **kwargs) as clean:
        expected = run(clean, None)
    llm = LLM(tape=path, **kwargs)
    got = run(llm, try_every_bad_input)
    runner = llm.llm_engine.engine_core.runner
    assert got == expected
    for req_id, (prompt, params) in GOOD.items():
        assert got[req_id] == runner.expected_stream(prompt, params)  # type: ignore[attr-defined]
    llm.llm_engine.engine_core.tape.flush()
    assert verify(str(path)).ok
    assert set(fold(str(path)).requests) == set(GOOD)
    assert tape_events(path) == tape_events(clean_path)  # the same run, event for event
    # ... and the engine serves on.
    late = llm.generate([[7, 8, 9], "still serving"], SamplingParams(max_tokens=9))
    for out in late:
        assert out.finished and out.outputs[0].token_ids == runner.expected_stream(  # type: ignore[attr-defined]
            out.prompt_token_ids, SamplingParams(max_tokens=9)
        )
    llm.close()
    assert verify(str(path)).ok


def test_generate_leaves_no_half_added_batch_and_keeps_its_request_ids() -> None:
    llm = LLM(model="oracle", tape=None)
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a string or a list of token ids"):
        llm.generate([[5, 6], 4.5])
    assert not llm.llm_engine.engine_core.state.requests
    llm.llm_engine.add_request(
        "0", [5, 6], SamplingParams(max_tokens=2)
    )  # an id generate would use
    outs = llm.generate([[5, 6], [7]], SamplingParams(max_tokens=2))
    assert [o.request_id for o in outs] == ["1", "2"]


# -- the tape file and the CLI ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "reason"),
    [
        (lambda d: d / "no" / "such" / "dir" / "x.tape", FileNotFoundError, "does not exist"),
        (lambda d: d / "file" / "x.tape", NotADirectoryError, "is not a directory"),
        (lambda d: d, IsADirectoryError, "is a directory"),
        (lambda d: d / "file", FileExistsError, "already exists"),
    ],
)
def test_a_tape_path_that_cannot_be_created_is_named_before_the_model_is_built(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[Path], Path],
    error: type[Exception],
    reason: str,
) -> None:
    (tmp_path / "file").write_text("not a tape")

    def no_model(config: EngineConfig) -> None:
        raise AssertionError("the model was built before the tape path was checked")

    monkeypatch.setattr("tokentape.engine.factory.make_runner", no_model)
    path = make(tmp_path)
    with pytest.raises(error) as info:
        LLM(model="tiny", tape=path)
    assert str(info.value).startswith(f"{path}: ") and reason in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_tape_in_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="is not writable"):
            LLM(model="oracle", tape=tmp_path / "x.tape")
    finally:
        tmp_path.chmod(0o700)


def test_bad_tape_arguments() -> None:
    with pytest.raises(ValueError, match="ambiguous"):
        LLM(model="oracle", tape=True)
    with pytest.raises(TypeError, match="tape must be a file path"):
        LLM(model="oracle", tape=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be encoded"):
        LLM(model="oracle", tape="\ud800.tape")


def test_a_refused_engine_leaves_no_tape(tmp_path: Path) -> None:
    path = tmp_path / "x.tape"
    with pytest.raises(ValueError, match="seed must be a 64-bit signed integer"):
        LLM(model="oracle", tape=path, seed=2**63)
    assert not os.listdir(tmp_path)


def test_a_kv_cache_larger_than_memory_is_refused_with_its_size(tmp_path: Path) -> None:
    path = tmp_path / "x.tape"
    with pytest.raises(
        ValueError, match=r"num_kv_blocks=10000000000 .* GiB of KV cache, more than"
    ):
        LLM(model="tiny", tape=path, num_kv_blocks=10**10)
    assert not os.listdir(tmp_path)


def test_an_engine_that_fails_to_build_closes_and_removes_its_new_tape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_engine(*args: object) -> EngineCore:
        raise MemoryError("no room for the KV blocks")

    monkeypatch.setattr("tokentape.engine.factory.EngineCore", failing_engine)
    with pytest.raises(MemoryError):
        LLM(model="oracle", tape=tmp_path / "x.tape")
    assert not os.listdir(tmp_path)
    monkeypatch.undo()
    with LLM(model="oracle", tape=tmp_path / "x.tape") as llm:  # the path is free again
        assert llm.generate([[5, 6]])[0].finished


@pytest.mark.parametrize(
    "args",
    [
        ["--seed", "1180591620717411303424"],
        ["--seed", str(2**63)],
        ["--max-tokens", str(2**64)],
        ["--temperature", "nan"],
    ],
)
@pytest.mark.parametrize("explicit_tape", [True, False])
def test_cli_generate_refuses_out_of_range_numbers_with_one_error_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    explicit_tape: bool,
) -> None:
    monkeypatch.chdir(tmp_path)  # the default tape path is in the current directory
    tape = ["--tape", str(tmp_path / "run.tape")] if explicit_tape else []
    assert cli_main(["generate", "hi", *args, *tape]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not os.listdir(tmp_path)
