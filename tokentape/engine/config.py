"""EngineConfig: every knob that shapes scheduling. It is written into the tape header so
that replay can rebuild the same scheduler."""

from __future__ import annotations

import msgspec

from tokentape.events.discard import DISCARD_POLICIES

MAX_PIPELINE_DEPTH = 4


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = "tiny"
    async_scheduling: bool = True
    pipeline_depth: int = 2
    num_speculative_tokens: int = 0
    discard_policy: str = "epoch"
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # defaults to the KV capacity
    enable_prefix_caching: bool = True
    seed: int = 0
    # n-gram (prompt lookup) drafter: the longest and shortest suffix it tries to match
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    # The real model (ignored by the oracle): "auto" is CUDA when there is one, else the CPU;
    # dtype "auto" is bfloat16 on CUDA and float32 on the CPU; batch_invariant None means on
    # for float32 on the CPU (a sequence's tokens do not depend on what it is batched with).
    device: str = "auto"
    dtype: str = "auto"
    batch_invariant: bool | None = None
    # torch's intra-op threads on the CPU (process-wide). None: 1 for models under 50M
    # parameters, whose matmuls are too small to pay for a thread pool (and the pipeline's
    # worker thread already runs beside the scheduler), else torch's default; 0: torch's default.
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(1 <= self.pipeline_depth <= MAX_PIPELINE_DEPTH,
             f"pipeline_depth must be in 1..{MAX_PIPELINE_DEPTH}, got {self.pipeline_depth}")
        need(self.num_speculative_tokens >= 0,
             f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        need(self.discard_policy in DISCARD_POLICIES,
             f"discard_policy must be one of {sorted(DISCARD_POLICIES)}, got {self.discard_policy!r}")
        need(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        need(self.num_kv_blocks >= 1, f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1 + self.num_speculative_tokens,
             "max_num_batched_tokens must leave room for one decode with its speculative tokens")
        need(self.max_model_len is None or 2 <= self.max_model_len <= self.kv_capacity,
             f"max_model_len must be in 2..{self.kv_capacity} (the KV capacity), "
             f"got {self.max_model_len}")
        need(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "need 1 <= prompt_lookup_min <= prompt_lookup_max")
        need(self.cpu_threads is None or self.cpu_threads >= 0,
             f"cpu_threads must be >= 0 or None, got {self.cpu_threads}")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def kv_capacity(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def effective_max_model_len(self) -> int:
        return self.max_model_len or self.kv_capacity

    @property
    def effective_pipeline_depth(self) -> int:
        """`async_scheduling=False` means synchronous: one step in flight at a time."""
        return self.pipeline_depth if self.async_scheduling else 1
