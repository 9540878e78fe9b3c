"""The worker extension of examples/rlhf_ray.py's `--weight-sync collective-rpc`: the
trainer's code inside each engine's worker, as OpenRLHF and verl write theirs. The engine is
built with `worker_extension_cls="rlhf_weight_sync.WeightSyncExtension"` (this folder on the
engine core process's path); `collective_rpc` calls its methods by name:

- `init_weight_update_group(address, rank, world_size)`: join the trainer's
  torch.distributed group (gloo, the CPU's backend; NCCL on GPUs);
- `update_weights_from_trainer(meta)`: receive each tensor of the trainer's broadcast, in
  `meta`'s order, and load them through the model's `load_weights` (vLLM's interface).
  Returns the weights' content hash, which the tape's CollectiveRPC records too.

It imports no Ray: the engine core process that runs it needs torch alone.
"""

from __future__ import annotations

from typing import Any

import torch


class WeightSyncExtension:
    model_runner: Any  # the worker's (tokentape.engine.worker.Worker)

    def init_weight_update_group(self, address: str, rank: int, world_size: int) -> None:
        torch.distributed.init_process_group(
            "gloo", init_method=address, rank=rank, world_size=world_size
        )

    def update_weights_from_trainer(self, meta: list[list[Any]]) -> str:
        from tokentape.engine.model.loader import weights_hash

        model = self.model_runner.model
        weights = []
        for name, shape, dtype in meta:
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(t, src=0)
            weights.append((name, t))
        model.load_weights(weights)
        return weights_hash(model)
