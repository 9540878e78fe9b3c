"""Building the model runner for an engine config: the model (a built-in one from its seed, or
a Hugging Face checkpoint folder with its tokenizer), its dtype and thread count, and the KV
cache's block count from the memory budget (kv_cache_size.py) once the weights are in place.
"""

from __future__ import annotations

import os

import torch

from tokentape.engine.config import EngineConfig
from tokentape.engine.kv_cache_size import kv_bytes_per_token, num_blocks_for, used_device_bytes
from tokentape.engine.model.decoder import CausalLM
from tokentape.engine.model.model_config import ModelConfig
from tokentape.engine.model_registry import unknown_model
from tokentape.engine.runners.devices import cpus_available, resolve_device
from tokentape.engine.runners.model_runner import TorchModelRunner
from tokentape.engine.runners.worker import on_a_thread_of_its_own
from tokentape.progress import LOUD_BYTES, gigabytes, say


def parameter_count(c: ModelConfig) -> int:
    """A decoder's parameters from its config (norms left out: they are few)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_hidden_layers * layer


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model_runner(config: EngineConfig) -> TorchModelRunner:
    """The runner for `config.model`: a built-in name or a Hugging Face checkpoint folder.
    Built on a thread of its own, so that the OpenMP team of the build's torch ops does not
    outlive it beside the runner's worker (worker.py)."""
    runner: TorchModelRunner = on_a_thread_of_its_own(lambda: _build(config))
    return runner


def _build(config: EngineConfig) -> TorchModelRunner:
    from tokentape.engine.model.loader import builtin_model, load_checkpoint, load_tokenizer
    from tokentape.engine.model.model_config import BUILTIN_CONFIGS

    device = resolve_device(config.device)  # before the model is built: a ValueError naming it
    tokenizer = None
    if config.model in BUILTIN_CONFIGS:
        size = 4 * parameter_count(BUILTIN_CONFIGS[config.model])  # built in float32
        if size >= LOUD_BYTES:
            say(f"building {config.model}'s weights from seed {config.seed} ({gigabytes(size)})")
        _, model = builtin_model(config.model, config.seed)
        model_id = config.model
    elif os.path.isdir(config.model):
        files = [f for f in os.scandir(config.model) if f.name.endswith(".safetensors")]
        size = sum(f.stat().st_size for f in files)
        if size >= LOUD_BYTES:
            say(f"loading the checkpoint {config.model} ({gigabytes(size)})")
        _, model = load_checkpoint(config.model)
        tokenizer = load_tokenizer(config.model)
        model_id = os.path.abspath(config.model)
    else:
        raise unknown_model(config.model)
    threads = config.cpu_threads or cpus_available()  # every CPU we may run on
    dtype_name = config.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
    dtype = _DTYPES[dtype_name]
    num_kv_blocks = config.num_kv_blocks
    if num_kv_blocks is None:
        num_kv_blocks = _kv_blocks_from_budget(config, model, device, dtype)
    runner = TorchModelRunner(
        model,
        model_id,
        num_kv_blocks=num_kv_blocks,
        block_size=config.block_size,
        seed=config.seed,
        device=device,
        dtype=dtype,
        num_threads=threads,
        batch_invariant=config.batch_invariant,
        prompt_lookup=(config.prompt_lookup_max, config.prompt_lookup_min),
        tokenizer=tokenizer,
        logprobs_mode=config.logprobs_mode,
        lora_capacity=config.lora_capacity,
        max_num_seqs=config.max_num_seqs,
        cuda_graphs=not config.enforce_eager,
    )
    return runner


def _kv_blocks_from_budget(
    config: EngineConfig, model: CausalLM, device: str, dtype: torch.dtype
) -> int:
    """The block count the memory budget holds, measured with the weights in place (on CUDA,
    what the process already holds counts against gpu_memory_utilization, as in vLLM)."""
    cfg = model.config
    model.to(device=device, dtype=dtype)  # the runner's own move is then a no-op
    device_type = torch.device(device).type
    dtype_bytes = torch.finfo(dtype).bits // 8
    per_token = kv_bytes_per_token(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype_bytes
    )
    # The forward pass's peak beside the cache, for a budget that is a fraction of the whole
    # device: a step's hidden states and MLP activations at the token budget, and float32
    # logits for every sequence (vLLM profiles a dummy pass for this; an estimate here).
    activations = (
        config.max_num_batched_tokens
        * (4 * cfg.hidden_size + 3 * cfg.intermediate_size)
        * dtype_bytes
        + config.max_num_seqs * cfg.vocab_size * 4
    )
    return num_blocks_for(
        config, per_token, device_type, used_device_bytes(device_type), activations
    )
