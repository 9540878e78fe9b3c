"""The KV cache's size, from a memory budget as vLLM sizes it.

The budget, in bytes, the first of:
- `kv_cache_memory_bytes` (vLLM's option of that name);
- on the CPU, `VLLM_CPU_KVCACHE_SPACE` (GiB, vLLM's variable) or its alias
  `TOKENTAPE_CPU_KVCACHE_SPACE`;
- `gpu_memory_utilization`, a fraction of the device's memory less what the process already
  holds there (on the CPU too, as vLLM 0.32 reads it there: of the machine's memory);
- on CUDA, 0.92 of that (vLLM's default utilization); on the CPU, DEFAULT_CPU_KV_CACHE_BYTES
  capped at a quarter of the machine's memory.

The number of blocks is the budget over the bytes a block holds in every layer:
layers x 2 (K and V) x kv_heads x head_dim x dtype bytes x block_size. `num_kv_blocks` set
by hand overrides all of it. The runner's build allocates the pool at that size, and
config.resolve_config records it and logs the tokens that fit and how many sequences of
max_model_len, in vLLM's words.
"""

from __future__ import annotations

import logging
import math
import os

from tokentape.engine.config import EngineConfig

_log = logging.getLogger(__name__)

GiB = 1 << 30
# vLLM's CPU default before it sized from the machine's memory (VLLM_CPU_KVCACHE_SPACE unset: 4
# GiB). It holds the 256-prompt tiny workload 12 times over (1M tokens of 4 KiB) and 18,724
# tokens of qwen3-0.6b (224 KiB a token in float32, 2.5 GB of weights beside it); the pages
# are committed only as blocks are first written (runners/model_runner.py), so a short run
# costs what it touches. Capped at a quarter of the machine's memory for a small laptop.
DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.32's CacheConfig default
CPU_KVCACHE_SPACE_ENVS = ("VLLM_CPU_KVCACHE_SPACE", "TOKENTAPE_CPU_KVCACHE_SPACE")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    return num_layers * 2 * num_kv_heads * head_dim * dtype_bytes


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _env_kv_space() -> tuple[int, str] | None:
    for name in CPU_KVCACHE_SPACE_ENVS:
        value = os.environ.get(name, "")
        if value != "":
            try:
                gib = float(value)
            except ValueError:
                raise ValueError(f"{name} must be a number of GiB, got {value!r}") from None
            if not gib > 0 or math.isinf(gib):
                raise ValueError(f"{name} must be a positive number of GiB, got {value!r}")
            return int(gib * GiB), f"{name}={value} GiB"
    return None


def kv_cache_budget(config: EngineConfig, device_type: str, used_bytes: int) -> tuple[int, str]:
    """The bytes the KV cache may take, and where that figure comes from (for the log).
    `used_bytes`: what the process already holds on the device (weights and all)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if device_type == "cpu":
        env = _env_kv_space()
        if env is not None:
            return env
    util = config.gpu_memory_utilization
    if device_type == "cpu" and util is None:
        total = physical_memory_bytes()
        budget = min(DEFAULT_CPU_KV_CACHE_BYTES, total // 4)
        return budget, f"the CPU default, {budget / GiB:.2f} GiB"
    util = DEFAULT_GPU_MEMORY_UTILIZATION if util is None else util
    total = physical_memory_bytes() if device_type == "cpu" else _cuda_total_bytes()
    budget = int(total * util) - used_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={util} leaves no memory for the KV cache: "
            f"{util} x {total / GiB:.2f} GiB is less than the {used_bytes / GiB:.2f} GiB "
            "already in use; raise it, or set kv_cache_memory_bytes"
        )
    return budget, f"gpu_memory_utilization={util} of {total / GiB:.2f} GiB"


def _cuda_total_bytes() -> int:
    import torch

    return torch.cuda.mem_get_info()[1]


def used_device_bytes(device_type: str) -> int:
    """What the process holds on the device now: its resident memory on the CPU, the memory
    in use on the current CUDA device (every process's, as vLLM counts it)."""
    if device_type == "cpu":
        return _rss_bytes()
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def num_blocks_for(
    config: EngineConfig,
    bytes_per_token: int,
    device_type: str,
    used_bytes: int,
    reserve_bytes: int = 0,
) -> int:
    """The block count for `config` (its num_kv_blocks when set). `reserve_bytes`: memory
    the forward pass will need beside the cache (activations), taken from a budget that is a
    fraction of the device."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget, source = kv_cache_budget(config, device_type, used_bytes)
    if config.kv_cache_memory_bytes is None and source.startswith("gpu_memory_utilization"):
        budget -= reserve_bytes
    block_bytes = bytes_per_token * config.block_size
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(
            f"a KV cache of {max(budget, 0) / GiB:.3f} GiB ({source}) holds no block of "
            f"{config.block_size} tokens ({block_bytes:,} bytes); give it more memory"
        )
    _log.info(
        "KV cache: %.2f GiB (%s), %d blocks of %d tokens at %d bytes a token",
        blocks * block_bytes / GiB,
        source,
        blocks,
        config.block_size,
        bytes_per_token,
    )
    return blocks
