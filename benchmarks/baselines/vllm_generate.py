"""Side script: vLLM's offline `LLM.generate` on a checkpoint folder, timed per round.

Runs in vLLM's Python (never imports tokentape); driven by benchmarks/bench_generate.py and
tests/integrations through the sideserver protocol. vLLM as its users run it: token-id
prompts (`TokensPrompt`) since the checkpoint has no tokenizer (`skip_tokenizer_init`),
greedy, ignore_eos, each request's own max_tokens, `detokenize=False`; the prefix cache reset
before every round (a round is a fresh workload: no prompt of it was seen before); every
other setting at vLLM's default (on the CPU: sync scheduling, block size 128, the model on one
OpenMP thread with one core left to the front end). `VLLM_CPU_KVCACHE_SPACE` comes from the
environment. One `LLM` serves every round, after a warm-up generate.

Spec: {"model", "dtype", "seed", "max_model_len", "prompts": [[int]], "max_tokens": [int],
"warmup_prompts": int, "llm": {more LLM(...) arguments, optional: e.g. scheduler_cls}}.
Commands: `round` (args: tokens: bool) -> seconds, output_tokens, cpu_s (CPU seconds per
process, by name: the front end is this process), tokens if asked; `cpu` -> CPU seconds so
far per process (to see what the processes use while idle).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import procstat
import sideserver
from vllm_requests import make_llm


def _config_info(llm: Any) -> dict[str, Any]:
    """The settings vLLM chose, from its config (best effort: names move between versions)."""
    info: dict[str, Any] = {}
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        return info
    for key, obj, attr in (
        ("block_size", config.cache_config, "block_size"),
        ("enable_prefix_caching", config.cache_config, "enable_prefix_caching"),
        ("max_num_seqs", config.scheduler_config, "max_num_seqs"),
        ("max_num_batched_tokens", config.scheduler_config, "max_num_batched_tokens"),
        ("async_scheduling", config.scheduler_config, "async_scheduling"),
        ("scheduler_cls", config.scheduler_config, "scheduler_cls"),
        ("max_model_len", config.model_config, "max_model_len"),
    ):
        value = getattr(obj, attr, None)
        info[key] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
    return info


def _cpu_by_name(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    me = os.getpid()
    relabel = {p: ("front end" if p == me else label, s) for p, (label, s) in after.items()}
    before = {p: ("front end" if p == me else label, s) for p, (label, s) in before.items()}
    return procstat.cpu_delta(before, relabel)


def setup(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, sideserver.Handler]]:
    import torch
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(spec)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        for n in spec["max_tokens"]
    ]
    w = spec.get("warmup_prompts", 2)
    llm.generate(prompts[:w], params[:w], use_tqdm=False)

    def round_(args: dict[str, Any]) -> dict[str, Any]:
        # Every round from a cold prefix cache, as tokentape's fresh engine starts: otherwise
        # the prompts of the warm-up and of the round before are cache hits, and a round of
        # long prompts skips nearly all its prefill.
        llm.reset_prefix_cache()
        gc.collect()
        cpu0 = procstat.tree_cpu(os.getpid())
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        cpu = _cpu_by_name(cpu0, procstat.tree_cpu(os.getpid()))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        reply: dict[str, Any] = {
            "seconds": seconds,
            "output_tokens": sum(map(len, tokens)),
            "cpu_s": cpu,
        }
        if args.get("tokens"):
            reply["tokens"] = tokens
        return reply

    def cpu(_: dict[str, Any]) -> dict[str, Any]:
        snap = procstat.tree_cpu(os.getpid())
        return {"cpu_s": _cpu_by_name({}, snap)}

    processes = {procstat.name(p): p for p in procstat.descendants(os.getpid())}
    info = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "front_end_torch_threads": torch.get_num_threads(),
        "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "processes": processes,
        **_config_info(llm),
    }
    return info, {"round": round_, "cpu": cpu}


if __name__ == "__main__":  # vLLM starts its engine core as a child process
    raise SystemExit(sideserver.run(setup))
