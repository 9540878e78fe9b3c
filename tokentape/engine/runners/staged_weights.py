"""The runner's side of vLLM's chunked weight transfer (RFC #31848): each chunk is checked as a
whole update is, then held (copied: a trainer may reuse its buffers for the next chunk) until
the finish loads them all at once, so the old weights serve until then. Shared by the model
runner and the oracle's weights, which say how to check and how to load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokentape.engine.runners.base import WeightChunk

if TYPE_CHECKING:
    import torch


class StagedWeights:
    """A mixin: `_checked(weights)` gives the checked tensors of an update, `_load(tensors)`
    loads them and returns the new weights' hash."""

    _staged: dict[str, torch.Tensor]  # chunks of the open transfer, by parameter name

    def _checked(self, weights: object) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _load(self, tensors: dict[str, torch.Tensor]) -> str:
        raise NotImplementedError

    def stage_weights(self, weights: object) -> WeightChunk:
        """A chunk of a transfer, checked and held until `load_staged_weights`."""
        from tokentape.engine.model.loader import chunk_record  # torch, on first use

        tensors = {n: t.clone() for n, t in self._checked(weights).items()}
        self._staged.update(tensors)
        return WeightChunk(*chunk_record(tensors))

    def load_staged_weights(self) -> str:
        staged, self._staged = self._staged, {}
        return self._load(staged)
