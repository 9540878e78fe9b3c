"""Parallel sampling (`SamplingParams.n > 1`), as vLLM does it: a parent request fans out into
n child requests "{index}_{request_id}" of n=1, and their outputs are gathered into one
RequestOutput per parent with the children's CompletionOutputs (index = the child's).

Seeds as vLLM derives them: with a seed, child i samples with seed + i. Without one vLLM's
children differ by their random generators; tokentape's randomness is keyed, so child i gets
the seed derived from the engine seed and the prompt (what a request without a seed samples
with), plus i. Each child is an ordinary request on the tape, its seed recorded, so a replay
needs nothing of the parent.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tokentape.engine.outputs import CompletionOutput, RequestOutput
from tokentape.engine.runners.base import prompt_seed
from tokentape.events.schema import RequestOutputKind, SamplingParams
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


class ParentRequest:
    """Gathers the children's outputs of one parent request."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.kind = params.output_kind
        self.child_ids = {child_request_id(i, request_id): i for i in range(params.n)}
        self.unfinished = set(self.child_ids)
        self.final: list[CompletionOutput | None] = [None] * params.n

    def gather(self, child: RequestOutput) -> RequestOutput | None:
        """The parent's output for one child's, or None (FINAL_ONLY before the last child
        finishes). Streaming kinds pass each child's completion on as it comes."""
        index = self.child_ids[child.request_id]
        completion = child.outputs[0]
        completion.index = index
        if child.finished:
            self.unfinished.discard(child.request_id)
        finished = not self.unfinished
        if self.kind == RequestOutputKind.FINAL_ONLY:
            self.final[index] = completion
            if not finished:
                return None
            outputs = [c for c in self.final if c is not None]
        else:
            outputs = [completion]
        return RequestOutput(
            self.request_id, child.prompt_token_ids, outputs, finished, child.prompt
        )
