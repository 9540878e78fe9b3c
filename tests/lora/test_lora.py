"""LoRA adapters per request: peft's tokens, the tape, the scheduler's max_loras, the prefix
cache's salt, and every bad input refused before anything is recorded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from adapter_files import hf_model, write_adapter, write_tiny_base

from tokentape import LLM, SamplingParams
from tokentape.errors import LoRAError
from tokentape.events import schema as ev
from tokentape.lora import LoRARequest
from tokentape.replay.tape import load_tape
from tokentape.replay.verify import verify
from tokentape.replay.whatif import WhatIfError, whatif

pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 101, 102, 3, 4], [40, 41, 42, 43], [7, 7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_base(root / "base")
    write_adapter(root / "all", base, rank=8, alpha=16, seed=1)
    write_adapter(root / "attn", base, rank=16, alpha=8, targets=["q_proj", "v_proj"], seed=2)
    write_adapter(
        root / "mlp",
        base,
        rank=4,
        alpha=4,
        targets=["gate_proj", "down_proj"],
        seed=3,
        use_rslora=True,
    )
    return {"root": root, "base": base}


def peft_greedy(
    base: torch.nn.Module, adapter: Path | None, prompt: list[int], n: int
) -> list[int]:
    from peft import PeftModel

    model = base if adapter is None else PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    if adapter is not None:
        model.unload()  # the base model as it was
    return out[0, len(prompt) :].tolist()


def test_mixed_batch_greedy_tokens_equal_peft(files: dict, tmp_path: Path) -> None:
    root, base = files["root"], files["base"]
    names = ["all", "attn", None, "mlp"]
    loras = [
        None if n is None else LoRARequest(n, i + 1, str(root / n)) for i, n in enumerate(names)
    ]
    with LLM(
        str(root / "base"), tape=str(tmp_path / "t.tape"), enable_lora=True, max_loras=4
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY, lora_request=loras)
    got = [o.outputs[0].token_ids for o in outs]
    want = [
        peft_greedy(base, None if n is None else root / n, p, GREEDY.max_tokens)
        for n, p in zip(names, PROMPTS)
    ]
    assert got == want
    assert len({tuple(t) for t in got}) == 4  # each adapter changes the tokens
    # The tape: each adapter with its SHA-256 once, each request with its adapter; it verifies.
    tape = load_tape(str(tmp_path / "t.tape"))
    events = [e for _, e in tape.events()]
    added = [e for e in events if isinstance(e, ev.LoRAAdded)]
    assert [(a.lora_name, a.lora_int_id, a.rank) for a in added] == [
        ("all", 1, 8),
        ("attn", 2, 16),
        ("mlp", 4, 4),
    ]
    assert added[2].scaling == pytest.approx(4 / 2)  # use_rslora: alpha / sqrt(r)
    assert added[1].target_modules == ["q_proj", "v_proj"]
    assert all(len(a.adapter_id) == 64 for a in added)
    assert [e.lora_int_id for e in events if isinstance(e, ev.RequestAdded)] == [1, 2, 0, 4]
    assert verify(tape).ok


def test_a_batch_without_lora_requests_gives_the_base_models_tokens(files: dict) -> None:
    root = files["root"]
    with LLM(str(root / "base"), tape=None) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    with LLM(str(root / "base"), tape=None, enable_lora=True, max_loras=2) as llm:
        llm.llm_engine.add_lora(LoRARequest("all", 1, str(root / "all")))
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want


def test_whatif_with_the_model_applies_the_same_adapters(files: dict, tmp_path: Path) -> None:
    root = tmp_path / "files"
    shutil.copytree(files["root"], root)
    tape = str(tmp_path / "t.tape")
    with LLM(str(root / "base"), tape=tape, enable_lora=True, max_loras=2) as llm:
        llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest("all", 1, str(root / "all")))
    result = whatif(tape, runner="model", pipeline_depth=2)
    assert result.diff.identical
    # The folder now holds another adapter: the replay says so rather than run with it.
    shutil.rmtree(root / "all")
    shutil.copytree(root / "attn", root / "all")
    with pytest.raises(WhatIfError, match="another adapter"):
        whatif(tape, runner="model")


def test_max_loras_bounds_the_adapters_of_every_step(files: dict, tmp_path: Path) -> None:
    root = files["root"]
    loras = [LoRARequest(n, i + 1, str(root / n)) for i, n in enumerate(["all", "attn", "mlp"])]
    tape = str(tmp_path / "t.tape")
    prompts = [[i + 3] * 5 for i in range(9)]
    with LLM("oracle", tape=tape, enable_lora=True, max_loras=2, max_cpu_loras=3) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6), lora_request=loras * 3)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    t = load_tape(tape)
    lora_of = {e.req_id: e.lora_int_id for _, e in t.events() if isinstance(e, ev.RequestAdded)}
    steps = [e for _, e in t.events() if isinstance(e, ev.StepScheduled)]
    per_step = [{lora_of[x.req_id] for x in s.entries} for s in steps]
    assert max(len(s) for s in per_step) == 2
    assert verify(t).ok


def test_the_prefix_cache_is_not_shared_across_adapters(files: dict, tmp_path: Path) -> None:
    root = files["root"]
    tape = str(tmp_path / "t.tape")
    prompt = list(range(3, 3 + 40))  # two full blocks of 16
    with LLM("oracle", tape=tape, enable_lora=True, max_loras=2) as llm:
        a = LoRARequest("all", 1, str(root / "all"))
        llm.generate([prompt], SamplingParams(max_tokens=2), lora_request=a)
        llm.generate([prompt], SamplingParams(max_tokens=2))  # the base model: no hit
        llm.generate([prompt], SamplingParams(max_tokens=2), lora_request=a)  # a hit
    first = {}
    for _, e in load_tape(tape).events():
        if isinstance(e, ev.StepScheduled):
            for x in e.entries:
                first.setdefault(x.req_id, x.num_computed_before)
    assert [first[r] for r in ("0", "1", "2")] == [0, 0, 32]


def test_remove_and_evict(files: dict, tmp_path: Path) -> None:
    root = files["root"]
    tape = str(tmp_path / "t.tape")
    with LLM("oracle", tape=tape, enable_lora=True, max_loras=1) as llm:
        engine = llm.llm_engine
        assert engine.add_lora(LoRARequest("all", 1, str(root / "all")))
        assert not engine.add_lora(LoRARequest("all", 1, str(root / "all")))  # loaded already
        # max_cpu_loras (= max_loras = 1) adapters loaded: the idle one makes room.
        llm.generate(
            [[5, 6]],
            SamplingParams(max_tokens=2),
            lora_request=LoRARequest("attn", 2, str(root / "attn")),
        )
        assert engine.list_loras() == {2}
        assert engine.remove_lora(2) and not engine.remove_lora(2)
        assert engine.list_loras() == set()
    kinds = [ev.kind_of(e) for _, e in load_tape(tape).events() if ev.kind_of(e).startswith("LoRA")]
    assert kinds == ["LoRAAdded", "LoRARemoved", "LoRAAdded", "LoRARemoved"]
    assert verify(tape).ok


def test_segments_restore_the_adapters(files: dict, tmp_path: Path) -> None:
    from tokentape.events.segment_dir import SegmentedTapeSpec

    root = files["root"]
    spec = SegmentedTapeSpec(str(tmp_path / "dir"), segment_seconds=0.01, retention_bytes=None)
    lora = LoRARequest("all", 1, str(root / "all"))
    with LLM(str(root / "base"), tape=spec, enable_lora=True) as llm:
        llm.generate(PROMPTS, GREEDY, lora_request=lora)
    segments = sorted(p for p in os.listdir(tmp_path / "dir") if p.endswith(".tape"))
    assert len(segments) > 2
    assert verify(str(tmp_path / "dir")).ok
    last = str(tmp_path / "dir" / segments[-2])
    snapshot = next(e for _, e in load_tape(last).events())
    assert isinstance(snapshot, ev.EngineSnapshot) and [x.lora_name for x in snapshot.loras] == [
        "all"
    ]
    assert verify(last).ok


# -- bad input: a clear error, nothing recorded, the engine serves on ---------------------------


def _damage(path: Path, name: str, data: bytes) -> None:
    (path / name).write_bytes(data)


@pytest.fixture
def bad_folders(files: dict, tmp_path: Path) -> dict[str, Path]:
    root = files["root"]
    folders = {}
    for case in ("bad_json", "bad_weights", "no_weights", "dora"):
        folders[case] = tmp_path / case
        shutil.copytree(root / "all", folders[case])
    _damage(folders["bad_json"], "adapter_config.json", b"{not json")
    _damage(folders["bad_weights"], "adapter_model.safetensors", b"\x00" * 40)
    os.remove(folders["no_weights"] / "adapter_model.safetensors")
    config = json.loads((folders["dora"] / "adapter_config.json").read_text())
    config["use_dora"] = True
    (folders["dora"] / "adapter_config.json").write_text(json.dumps(config))
    # An adapter of another base model: a Llama of other shapes.
    from tokentape.engine.model.model_config import ModelConfig

    other = ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    folders["other_base"] = tmp_path / "other_base"
    write_adapter(folders["other_base"], hf_model(other, {}), rank=4)
    folders["high_rank"] = tmp_path / "high_rank"
    write_adapter(folders["high_rank"], files["base"], rank=32, targets=["q_proj"])
    return folders


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "does not exist"),
        ("bad_json", "not valid JSON"),
        ("bad_weights", "damaged"),
        ("no_weights", "no adapter_model.safetensors"),
        ("dora", "use_dora=True is not served"),
        ("other_base", "another base model"),
        ("high_rank", "rank 32 is above max_lora_rank=16"),
    ],
)
def test_a_bad_adapter_is_refused_before_anything_is_recorded(
    files: dict, bad_folders: dict[str, Path], tmp_path: Path, case: str, message: str
) -> None:
    root = files["root"]
    path = str(bad_folders.get(case, tmp_path / "nowhere"))
    with LLM(str(root / "base"), tape=None, enable_lora=True) as llm:
        before = llm.llm_engine.engine_core.state.num_events
        with pytest.raises(LoRAError, match=message):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("bad", 1, path))
        assert llm.llm_engine.engine_core.state.num_events == before
        assert not llm.llm_engine.engine_core.state.requests
        out = llm.generate(
            PROMPTS[:1], GREEDY, lora_request=LoRARequest("all", 2, str(root / "all"))
        )
        assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_lora_calls_refused(files: dict) -> None:
    root = files["root"]
    all_ = LoRARequest("all", 1, str(root / "all"))
    with LLM("oracle", tape=None) as llm:  # LoRA not enabled
        with pytest.raises(LoRAError, match="enable_lora=True"):
            llm.generate([[3, 4]], lora_request=all_)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "p")
    with LLM("oracle", tape=None, enable_lora=True, max_loras=2) as llm:
        engine = llm.llm_engine
        engine.add_lora(all_)
        with pytest.raises(LoRAError, match="loaded already, with id 1"):
            engine.add_lora(LoRARequest("all", 2, str(root / "attn")))
        with pytest.raises(LoRAError, match="is adapter 'all'"):
            engine.add_lora(LoRARequest("other", 1, str(root / "attn")))
        with pytest.raises(TypeError, match="must be a LoRARequest"):
            llm.generate([[3, 4]], lora_request=["all"])  # type: ignore[list-item]
        engine.add_request("r", [3, 4], SamplingParams(max_tokens=50), lora_request=all_)
        with pytest.raises(LoRAError, match="serves 1 unfinished request"):
            engine.remove_lora(1)
        with pytest.raises(ValueError, match="1 LoRA requests for 2 prompts"):
            llm.generate([[3], [4]], lora_request=[all_])


def test_save_peft_adapter_writes_what_peft_reads(files: dict, tmp_path: Path) -> None:
    from tokentape.lora.peft_adapter import load_peft_adapter, save_peft_adapter

    root, base = files["root"], files["base"]
    original = load_peft_adapter(str(root / "all"), 16)
    save_peft_adapter(str(tmp_path / "copy"), original.weights, lora_alpha=16)
    copy = load_peft_adapter(str(tmp_path / "copy"), 16)
    assert copy.scaling == original.scaling and copy.target_modules == original.target_modules
    assert all(
        torch.equal(a, copy.weights[n][0]) and torch.equal(b, copy.weights[n][1])
        for n, (a, b) in original.weights.items()
    )
    prompt = PROMPTS[0]
    assert peft_greedy(base, tmp_path / "copy", prompt, 6) == peft_greedy(
        base, root / "all", prompt, 6
    )
