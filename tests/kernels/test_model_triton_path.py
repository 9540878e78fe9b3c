"""End to end: the real model gives the same greedy tokens through the Triton kernels (under
the interpreter) as through the torch references, over chunked prefills and decodes.

Skipped until the real model (tokentape.engine.model, branch model-runner) is present.
"""

from __future__ import annotations

import importlib.util
import os

import kernel_cases  # noqa: F401  (turns the interpreter on before triton is imported)
import pytest

from tokentape import LLM, SamplingParams

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "interpreter off (CUDA present): gpu_check.py runs the engine", allow_module_level=True
    )
if importlib.util.find_spec("tokentape.engine.model") is None:
    pytest.skip("the real model is not in this tree yet", allow_module_level=True)


def generate(monkeypatch: pytest.MonkeyPatch, backend: str) -> list[list[int]]:
    monkeypatch.setenv("TOKENTAPE_KERNELS", backend)
    # Block size 4 and a 24-token budget: the 18-token prompt is prefilled in chunks over
    # several blocks, mixed in steps with the other prompts' prefills and decodes.
    llm = LLM(
        model="tiny",
        tape=False,
        seed=0,
        async_scheduling=False,
        block_size=4,
        max_num_batched_tokens=24,
    )
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4] * 9, [100]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_model_tokens_match_between_reference_and_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = generate(monkeypatch, "torch")
    assert all(len(tokens) == 6 for tokens in reference)
    assert generate(monkeypatch, "triton") == reference
