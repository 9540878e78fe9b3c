"""Parallel sampling (`SamplingParams.n > 1`), as vLLM does it: a parent request fans out into
n child requests "{index}_{request_id}" of n=1 (EngineCore.add_request), and the output
processor gathers their outputs into one RequestOutput per parent with the children's
CompletionOutputs (index = the child's).

Seeds as vLLM derives them: with a seed, child i samples with seed + i. Without one vLLM's
children differ by their random generators; tokentape's randomness is keyed, so child i gets
the seed derived from the engine seed and the prompt (what a request without a seed samples
with), plus i. Each child is an ordinary request on the tape, its seed recorded, so a replay
needs nothing of the parent.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tokentape.engine.runners.base import prompt_seed
from tokentape.events.schema import SamplingParams
from tokentape.events.validation import INT64_MAX


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


def child_params(
    params: SamplingParams, index: int, engine_seed: int, prompt: Sequence[int]
) -> SamplingParams:
    base = params.seed if params.seed is not None else prompt_seed(engine_seed, prompt) & INT64_MAX
    seed = base + index
    if seed > INT64_MAX:
        raise ValueError(f"seed + n - 1 must fit in 64 bits, got seed {base} with n={params.n}")
    return msgspec.structs.replace(params, n=1, seed=seed)
