"""The runner's side of vLLM's chunked weight transfer (RFC #31848): each chunk is checked as a
whole update is, then held (copied: a trainer may reuse its buffers for the next chunk) until
the finish loads them all at once, so the old weights serve until then. Shared by the model
runner and the oracle's weights, which say how to check and how to load."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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

    @property
    def weights_id(self) -> str:
        raise NotImplementedError

    def _forget_weights_id(self) -> None:
        raise NotImplementedError

    def call_and_rehash(
        self, call: Callable[[], Any]
    ) -> tuple[Any, BaseException | None, str | None]:
        """Run a worker call (collective_rpc) and hash the weights again: code that may
        change them in place. (result, its exception, the new hash if they changed)."""
        before = self.weights_id
        result: Any = None
        error: BaseException | None = None
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 (the caller gets it back, as vLLM's does)
            error = exc
        self._forget_weights_id()
        after = self.weights_id
        return result, error, after if after != before else None
