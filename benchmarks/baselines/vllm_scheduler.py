"""Side script: vLLM's own `Scheduler` and `AsyncScheduler` stepped through decode steps on
the CPU with fake runner outputs, as vLLM's tests/v1/core do; timed per step.

Runs in vLLM's Python (never imports tokentape); driven by benchmarks/bench_vs_vllm.py.
The scheduler is built as vLLM's EngineCore builds it (`VllmConfig` from the checkpoint
folder, prefix caching on with its default hash, requests carrying the engine's block
hasher), with a KV cache of `num_blocks` blocks and no model. A decode step is what
EngineCore does around the model: `schedule()`, then `update_from_output()` with the runner's
output; with `AsyncScheduler` the step scheduled next is scheduled before the previous
step's output is applied (vLLM's batch queue of depth 2). The fake runner output (one
sampled token per request) is built outside the timed calls.

Spec: {"model", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
"max_model_len", "max_tokens", "prompts": [[int]], "skip_calls", "window_calls"}.
Command `time` (args: scheduler: "Scheduler" | "AsyncScheduler", n: int) -> wall_s and
cpu_s per step (`time.perf_counter` and `time.process_time` summed over the timed calls).
"""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

import sideserver


def setup(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, sideserver.Handler]]:
    import torch
    import vllm
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    block_size: int = spec["block_size"]
    num_blocks: int = spec["num_blocks"]
    classes = {"Scheduler": Scheduler, "AsyncScheduler": AsyncScheduler}

    def build(cls: type) -> tuple[Any, Any]:
        vllm_config = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=spec["max_num_seqs"],
                max_num_batched_tokens=spec["max_num_batched_tokens"],
                max_model_len=spec["max_model_len"],
                is_encoder_decoder=False,
            ),
            model_config=ModelConfig(
                model=spec["model"], dtype="float32", seed=0, skip_tokenizer_init=True
            ),
            cache_config=CacheConfig(block_size=block_size),  # prefix caching: its default
        )
        config = json_model_config(spec["model"])
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layers"],
                    FullAttentionSpec(
                        block_size=block_size,
                        num_kv_heads=config["num_key_value_heads"],
                        head_size=config["head_dim"],
                        dtype=torch.float32,
                    ),
                )
            ],
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        scheduler = cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            log_stats=False,
        )
        return vllm_config, scheduler

    def time_steps(args: dict[str, Any]) -> dict[str, Any]:
        cls = classes[args["scheduler"]]
        n: int = args["n"]
        vllm_config, scheduler = build(cls)
        cache = vllm_config.cache_config
        hasher = None
        if cache.enable_prefix_caching:
            hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            hasher = get_request_block_hasher(block_size, hash_fn)
        params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True, temperature=0.0)
        for i, prompt in enumerate(spec["prompts"][:n]):
            scheduler.add_request(
                Request(
                    request_id=str(i),
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
        depth = 2 if cls is AsyncScheduler else 1
        in_flight: deque[Any] = deque()
        wall = cpu = 0.0
        step = 0

        def one_step(timed: bool) -> None:
            nonlocal wall, cpu, step
            t0, c0 = time.perf_counter(), time.process_time()
            out = scheduler.schedule()
            t1, c1 = time.perf_counter(), time.process_time()
            if timed:
                wall += t1 - t0
                cpu += c1 - c0
                assert out.total_num_scheduled_tokens == n, "a step did not decode every request"
            in_flight.append(out)
            if len(in_flight) < depth:
                return
            done = in_flight.popleft()
            ids = list(done.num_scheduled_tokens)
            runner_output = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: k for k, r in enumerate(ids)},
                sampled_token_ids=[[3 + (int(r) * 31 + step * 17) % 256] for r in ids],
            )
            step += 1
            t2, c2 = time.perf_counter(), time.process_time()
            scheduler.update_from_output(done, runner_output)
            t3, c3 = time.perf_counter(), time.process_time()
            if timed:
                wall += t3 - t2
                cpu += c3 - c2

        for _ in range(spec["skip_calls"]):
            one_step(False)
        assert len(scheduler.running) == n and not scheduler.waiting, "not all requests running"
        window = spec["window_calls"]
        gc.collect()
        for _ in range(window):
            one_step(True)
        assert len(scheduler.running) == n, "a request finished or was preempted in the window"
        return {"wall_s": wall / window, "cpu_s": cpu / window}

    cache = build(Scheduler)[0].cache_config
    info = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "prefix_caching_hash_algo": cache.prefix_caching_hash_algo,
    }
    return info, {"time": time_steps}


def json_model_config(folder: str) -> dict[str, Any]:
    import json
    import os

    with open(os.path.join(folder, "config.json")) as f:
        config: dict[str, Any] = json.load(f)
    return config


if __name__ == "__main__":
    raise SystemExit(sideserver.run(setup))
