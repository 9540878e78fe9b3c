"""The oracle's weights: a small fixed set of parameters that a weight update replaces, checked
(names, shapes, floating point, finite) and hashed as the real model's are, so the engine's
weight updates, whole or chunked and versioned, run in oracle tests and chaos storms.

The oracle's tokens do not depend on them: a correct engine still delivers
`OracleRunner.expected_stream` across any number of updates. torch is imported on first use
only (an oracle run that never updates its weights does not load it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tokentape.engine.runners.staged_weights import StagedWeights

if TYPE_CHECKING:
    import torch

    from tokentape.engine.model.loader import WeightsHashStream

# name -> shape, as a state_dict of a two-matrix model over the oracle's 95 printable tokens.
ORACLE_PARAMETERS: dict[str, tuple[int, ...]] = {
    "embed_tokens.weight": (95, 8),
    "lm_head.weight": (95, 8),
}


def oracle_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """A full set of oracle weights drawn from `seed` (a trainer's "new weights" in tests)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen) for n, shape in ORACLE_PARAMETERS.items()}


class OracleWeights(StagedWeights):
    """The weights an OracleRunner serves, and the chunks of a transfer it holds."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._params: dict[str, torch.Tensor] | None = None  # drawn on first use
        self._staged: dict[str, torch.Tensor] = {}
        self._stage_memory: dict[str, torch.Tensor] = {}
        self._weights_id: str | None = None

    @property
    def params(self) -> dict[str, torch.Tensor]:
        if self._params is None:
            self._params = oracle_state_dict(self.seed)
        return self._params

    def _checked(self, weights: object) -> dict[str, torch.Tensor]:
        """A state_dict, or a folder of *.safetensors (no config.json: the oracle has none),
        checked against the parameters (weight_checks.checked_update)."""
        from tokentape.engine.model.loader import read_weight_files
        from tokentape.engine.model.weight_checks import checked_update

        origin: dict[str, str] = {}
        tensors: Mapping[str, Any]
        if isinstance(weights, (str, os.PathLike)):
            tensors, origin = read_weight_files(weights)
        elif isinstance(weights, Mapping):
            tensors = weights
        else:
            raise TypeError(
                "update_weights takes a state_dict or a folder of *.safetensors (the oracle's "
                f"parameters: {', '.join(ORACLE_PARAMETERS)}), got {type(weights).__name__}"
            )
        return checked_update(self.params, tensors, origin)

    def update_weights(self, weights: object) -> str:
        return self._load(self._checked(weights), None)

    def _load(self, tensors: dict[str, torch.Tensor], hashing: WeightsHashStream | None) -> str:
        # Copied in, as the model's are: a transfer's chunks are the next one's memory.
        for name, t in tensors.items():
            self.params[name].copy_(t)
        self._weights_id = None
        return self.weights_id

    def _forget_weights_id(self) -> None:
        self._weights_id = None

    @property
    def weights_id(self) -> str:
        """sha256 over every parameter (as loader.weights_hash: name, dtype, shape, bytes)."""
        if self._weights_id is None:
            import hashlib

            from tokentape.engine.model.loader import tensor_sha256

            h = hashlib.sha256()
            for name in sorted(self.params):
                h.update(tensor_sha256(name, self.params[name]).encode())
            self._weights_id = "sha256:" + h.hexdigest()
        return self._weights_id
