"""The runner's side of vLLM's chunked weight transfer (RFC #31848): each chunk is checked as a
whole update is, then held (copied: a trainer may reuse its buffers for the next chunk) until
the finish loads them all at once, so the old weights serve until then. Shared by the model
runner and the oracle's weights, which say how to check and how to load.

The memory that held a transfer's chunks is kept after its finish, and the next transfer
copies its chunks into it: memory written for the first time costs a page fault a page (on a
VM, a copy into it ran at 0.5-4 GB/s, into memory written before at 14-16 GB/s). An engine
that takes transfers thus holds its weights twice from the first finish on, as a transfer of
all of them does at its finish anyway; a sleep and a close free the kept copy.

The work of a chunk is hashing: each tensor's SHA-256 for the tape and, where the weights'
hash is one SHA-256 over every tensor in name order (the model's, loader.weights_hash), that
hash taken on through the tensors come so far, side by side. The finish hashes the rest: from
the first name (in order) that no chunk brought."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokentape.engine.runners.base import WeightChunk

if TYPE_CHECKING:
    import torch

    from tokentape.engine.model.loader import WeightsHashStream


class StagedWeights:
    """A mixin: `_checked(weights)` gives the checked tensors of an update, `_load(tensors,
    hashing)` loads them (copies them in: the tensors are the next transfer's memory) and
    returns the new weights' hash (finishing `hashing`, where `_hash_stream` gives one)."""

    _staged: dict[str, torch.Tensor]  # chunks of the open transfer, by parameter name
    # The memory of the last finished transfer's chunks, by name: the next one's copies go
    # there. None of it is held by the open transfer.
    _stage_memory: dict[str, torch.Tensor]
    _hashing: WeightsHashStream | None = None  # the open transfer's weights hash, so far

    def _checked(self, weights: object) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _load(self, tensors: dict[str, torch.Tensor], hashing: WeightsHashStream | None) -> str:
        raise NotImplementedError

    def _hash_stream(self) -> WeightsHashStream | None:
        """The weights' hash as one stream over the parameters, to take on chunk by chunk;
        None where the hash is not one (the oracle's: a hash of each tensor's hash)."""
        return None

    def stage_weights(self, weights: object) -> WeightChunk:
        """A chunk of a transfer, checked and held until `load_staged_weights`. The chunk is
        only held once it is copied and hashed: one that fails leaves the held ones as they
        were (a tensor sent again is copied into new memory, not over the one held)."""
        from collections import ChainMap

        from tokentape.engine.model.loader import chunk_record, hash_pool  # torch, on first use

        checked = self._checked(weights)
        if self._hashing is None:
            self._hashing = self._hash_stream()
        hashing = self._hashing
        copies = {n: self._stage_buffer(n, t) for n, t in checked.items()}
        try:
            for name, t in checked.items():
                copies[name].copy_(t)
            taking = None
            if hashing is not None:
                hashing.forget(copies)  # a tensor sent again replaces the one hashed
                taking = hash_pool().submit(hashing.take, ChainMap(copies, self._staged))
            try:
                record = chunk_record(copies)
            finally:
                if taking is not None:
                    taking.result()  # it reads the copies: done before they go anywhere
        except BaseException:
            if hashing is not None:
                hashing.forget(copies)
            for name, buffer in copies.items():
                if name not in self._staged:
                    self._stage_memory[name] = buffer
            raise
        self._staged.update(copies)
        return WeightChunk(*record)

    def _stage_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        import torch

        kept = self._stage_memory.pop(name, None)
        if (
            kept is not None
            and kept.shape == like.shape
            and kept.dtype == like.dtype
            and kept.device == like.device
        ):
            return kept
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)

    def load_staged_weights(self) -> str:
        staged, self._staged = self._staged, {}
        hashing, self._hashing = self._hashing, None
        weights_id = self._load(staged, hashing)
        self._stage_memory = staged  # copied into the weights: the next transfer's memory
        return weights_id

    def drop_stage_memory(self) -> None:
        """Free the memory kept for the next transfer (a sleep, a close)."""
        self._stage_memory = {}

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
