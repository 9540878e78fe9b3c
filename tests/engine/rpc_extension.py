"""A worker extension as an RL framework writes one (verl, OpenRLHF, TRL): methods mixed into
the worker that collective_rpc calls by name. For tests/engine/test_collective_rpc.py; the
engine core process imports it by name ("rpc_extension.WeightSync", this folder on its path)."""

from __future__ import annotations

from typing import Any

import torch


class WeightSync:
    model_runner: Any
    rank: int
    device: Any

    def whoami(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": str(self.device)}

    def load_seeded(self, seed: int) -> int:
        """Every parameter drawn from `seed`, through the model's vLLM-style load_weights."""
        model = self.model_runner.model
        gen = torch.Generator().manual_seed(seed)
        pairs = [
            (name, torch.randn(p.shape, generator=gen) * 0.05)
            for name, p in model.named_parameters()
        ]
        return len(model.load_weights(pairs))

    def scale_norms(self, factor: float) -> int:
        """In place through `.data`, as vLLM's weight loaders write: no version counter moves."""
        n = 0
        for name, p in self.model_runner.model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.mul_(factor)
                n += 1
        return n

    def fail(self, message: str) -> None:
        raise ValueError(message)


class Clashes:
    """An extension that would replace a method of the worker: refused."""

    def get_model(self) -> None:
        pass
