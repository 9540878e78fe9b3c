"""tokentape's greedy streams equal vLLM's token for token, on the same weights.

Runs where vLLM is reachable (benchmarks/baselines/locate.py: `$TOKENTAPE_VLLM_PYTHON`,
`.venv-vllm` in the repository root, or an importable vllm; `benchmarks/setup_vllm_venv.sh`
makes the venv), else skips and says why. vLLM runs in its own Python as a side process
(benchmarks/baselines/vllm_generate.py, its default settings) on the built-in tiny model
written as a Hugging Face folder; its first start compiles for about a minute.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from baselines.client import SideProcess  # noqa: E402
from baselines.locate import find_vllm  # noqa: E402

from tokentape import LLM, SamplingParams  # noqa: E402
from tokentape.engine.model.loader import builtin_model, save_checkpoint  # noqa: E402

FOUND, WHERE = find_vllm()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(FOUND is None, reason=WHERE)]


def workload(n: int = 16, seed: int = 3) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(8, 64))] for _ in range(n)]
    return prompts, [rng.randint(24, 40) for _ in range(n)]


def test_greedy_streams_equal_vllm(tmp_path: Path) -> None:
    assert FOUND is not None
    prompts, outputs = workload()
    folder = save_checkpoint(builtin_model("tiny", 0)[1], tmp_path / "tiny")
    spec = {
        "model": folder,
        "dtype": "float32",
        "seed": 0,
        "max_model_len": 128,
        "prompts": prompts,
        "max_tokens": outputs,
        "warmup_prompts": 1,
    }
    with SideProcess(
        FOUND.python,
        "vllm_generate.py",
        spec,
        label="vllm",
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        workdir=str(tmp_path),
    ) as side:
        side.start()
        theirs = side.call("round", tokens=True)["tokens"]

    llm = LLM(model="tiny", seed=0, tape=None)  # async depth 2, the tape in memory
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    llm.close()

    assert [len(t) for t in theirs] == outputs
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not differ, (
        f"{len(differ)}/{len(prompts)} streams differ; request {differ[0]}: "
        f"tokentape {ours[differ[0]]} vs vLLM {theirs[differ[0]]}"
    )
