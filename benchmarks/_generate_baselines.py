"""bench_generate's two baselines, each a side process started once and run once per round:
vLLM's CPU engine and transformers (benchmarks/baselines). Here: their specs, the KV cache
size vLLM is given, the batch sizes transformers tries, and the CPU accounting of their
processes while they are idle."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from baselines import procstat
from baselines.client import SideProcess
from baselines.locate import Found

GIB = 1 << 30
VLLM_BLOCK = 128  # vLLM's default block size on the CPU: requests are rounded up to it


def vllm_kv_cache_gib(hf_config: dict[str, Any], lengths: list[int], dtype_bytes: int) -> int:
    """Whole GiB of KV cache that hold every request at once (+15%), at least 2: vLLM on the
    CPU takes its size from VLLM_CPU_KVCACHE_SPACE, as its users set it for their workload."""
    per_token = (
        hf_config["num_hidden_layers"]
        * 2
        * hf_config["num_key_value_heads"]
        * hf_config["head_dim"]
        * dtype_bytes
    )
    tokens = sum(-(-n // VLLM_BLOCK) * VLLM_BLOCK for n in lengths)
    return max(2, math.ceil(per_token * tokens * 1.15 / GIB))


def hf_batch_sizes(sizes: list[int], num_prompts: int) -> list[int]:
    """The sizes to try; those above the number of prompts all mean one batch of every one."""
    return sorted({min(s, num_prompts) for s in sizes})


@dataclass(slots=True)
class Side:
    """A started side process, and the CPU its processes used while other variants ran."""

    name: str
    proc: SideProcess
    found: Found
    info: dict[str, Any]
    idle_cpu_s: float = 0.0
    idle_wall_s: float = 0.0
    _mark: tuple[float, float] | None = field(default=None)

    def tree_cpu(self) -> float:
        return sum(s for _, s in procstat.tree_cpu(self.proc.pid).values())

    def settle(self, max_wait: float = 5.0, quiet: float = 0.05) -> None:
        """Wait (at most `max_wait` s) until its processes use < `quiet` of a core: vLLM's
        workers spin on their queue for ~1 s after each request before they sleep, and
        OpenMP's threads spin a while after each parallel region."""
        deadline = time.monotonic() + max_wait
        last = self.tree_cpu()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.tree_cpu()
            if now - last < quiet * 0.25:
                return
            last = now

    def idle_begin(self) -> None:
        self._mark = (self.tree_cpu(), time.perf_counter())

    def idle_end(self) -> None:
        assert self._mark is not None
        cpu0, t0 = self._mark
        self.idle_cpu_s += self.tree_cpu() - cpu0
        self.idle_wall_s += time.perf_counter() - t0
        self._mark = None

    def close(self) -> None:
        self.proc.close()


def start_vllm(
    found: Found,
    model_dir: str,
    prompts: list[list[int]],
    outputs: list[int],
    dtype: str,
    seed: int,
    max_model_len: int,
    kv_gib: int,
    workdir: str,
) -> Side:
    spec = {
        "model": model_dir,
        "dtype": dtype,
        "seed": seed,
        "max_model_len": max_model_len,
        "prompts": prompts,
        "max_tokens": outputs,
        "warmup_prompts": 2,
    }
    proc = SideProcess(
        found.python,
        "vllm_generate.py",
        spec,
        label="vllm",
        workdir=workdir,
        env={"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)},
    )
    try:
        info = proc.start()
    except BaseException:
        proc.close()
        raise
    side = Side("vLLM", proc, found, info)
    side.settle()
    return side


def start_hf(
    found: Found,
    model_dir: str,
    prompts: list[list[int]],
    outputs: list[int],
    dtype: str,
    threads: int | None,
    workdir: str,
) -> Side:
    spec = {
        "model": model_dir,
        "dtype": dtype,
        "prompts": prompts,
        "max_tokens": outputs,
        "pad_token_id": 2,
        "threads": threads,
    }
    proc = SideProcess(found.python, "hf_generate.py", spec, label="transformers", workdir=workdir)
    try:
        info = proc.start()
    except BaseException:
        proc.close()
        raise
    side = Side("transformers", proc, found, info)
    side.settle()
    return side
