"""EngineConfig: every knob that shapes scheduling, and `resolve_config`, the one place where
the settings whose defaults depend on the model are settled (the KV cache's block count, the
scheduling mode, max_model_len) before the engine is built. The resolved config is written
into the tape header, so a replay rebuilds the same scheduler from it."""

from __future__ import annotations

import logging

import msgspec
import msgspec.structs

from tokentape.engine.runners.base import HasModelConfig, ModelRunner
from tokentape.engine.weight_transfer import WeightTransferConfig, weight_transfer_config
from tokentape.events.discard import ALL_POLICIES
from tokentape.events.faults import FAULTS
from tokentape.events.validation import INT64_MAX, check_bool, check_int, check_number, check_str

MAX_PIPELINE_DEPTH = 4
# vLLM's largest max_lora_rank (the CPU kernel keeps a row's rank-sized product on its stack).
MAX_LORA_RANK = 512
DEFAULT_PIPELINE_DEPTH = 2  # vLLM's async scheduling: one step planned ahead
# The fake models have no K/V to hold: their pool keeps the size it always had.
ORACLE_NUM_KV_BLOCKS = 2048
# vLLM's logprobs_mode: what a frame's logprobs hold. Raw: of the model's logits, before any
# processing; processed: of what the sampler draws from (after the logits processors, the
# temperature, min-p, top-k and top-p; -inf where masked; a greedy row's are its processed
# logits without a temperature). *_logprobs: log-softmax; *_logits: the values themselves.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")

_log = logging.getLogger(__name__)


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = "tiny"
    # The steps in flight at once: 1 is synchronous, 2 vLLM's async scheduling, more a
    # deeper pipeline. `async_scheduling` is vLLM's flag for the same thing: False means a
    # depth of 1, True a depth of 2 unless pipeline_depth says more. Both None: synchronous
    # for a model on the CPU (as vLLM's CPU platform sets it), 2 for CUDA and the oracle.
    # Resolved (resolve_config), pipeline_depth alone says it, and async_scheduling agrees.
    async_scheduling: bool | None = None
    pipeline_depth: int | None = None
    num_speculative_tokens: int = 0
    discard_policy: str = "epoch"
    block_size: int = 16
    # None: as many blocks as the KV cache's memory budget holds (engine/kv_cache_size.py:
    # kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE on the CPU, gpu_memory_utilization); the
    # engine records the number it allocated, so a tape's header always has one.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None  # None: 0.92 on CUDA (vLLM's default)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # None: LLM sets the model's context length (as vLLM derives it from its config),
    # capped at the KV capacity; the oracle's, and old tapes', is the KV capacity.
    max_model_len: int | None = None
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
    # vLLM's enforce_eager: on CUDA, decode steps replay CUDA graphs unless this is True
    # (engine/runners/cuda_graphs.py); the CPU always runs eagerly.
    enforce_eager: bool = False
    # Threads the model runs on, on the CPU: for a small model lanes of one thread each that
    # share out every step's sequences, for a big one threads that share each matmul
    # (engine/runners/input_batch.py, choose_lanes); the engine's own thread count, not the
    # process's. None or 0: one per CPU the process may run on.
    cpu_threads: int | None = None
    # The most log-probabilities a request may ask for per token (vLLM's max_logprobs, 20 by
    # default); -1: as many as the vocabulary holds.
    max_logprobs: int = 20
    # Upstream bugs reproduced on purpose (tokentape.events.faults), for tapes and tests;
    # empty on every ordinary engine, and then nothing looks at it.
    faults: list[str] = []  # a list, as it reads back from the header
    # What the sampled tokens' logprobs (and the top k) hold: LOGPROBS_MODES, vLLM's default
    # first. Prompt logprobs are always raw log-probabilities.
    logprobs_mode: str = "raw_logprobs"
    # vLLM's worker_extension_cls: "module.Class", a class mixed into the worker, whose
    # methods collective_rpc calls (an RL framework's weight loading); None: none.
    worker_extension_cls: str | None = None
    # vLLM's weight_transfer_config: the transport of update_weights(update_info), "shm"
    # (engine/weight_transfer.py); None: weights come as state_dicts or checkpoint folders.
    weight_transfer_config: WeightTransferConfig | None = None
    # vLLM's LoRA options: adapters per request (LoRARequest) when enable_lora; at most
    # max_loras different adapters in one step, each of rank <= max_lora_rank, and at most
    # max_cpu_loras loaded at once (None: max_loras, as vLLM's default).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        # Types first (a bool is not an int here; the seed goes into the tape header and the
        # runners' 64-bit seed hashing), then the relations between fields.
        for name in ("model", "discard_policy", "device", "dtype", "logprobs_mode"):
            check_str(name, getattr(self, name))
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("enforce_eager", self.enforce_eager)
        check_bool("async_scheduling", self.async_scheduling, optional=True)
        check_bool("batch_invariant", self.batch_invariant, optional=True)
        check_int("pipeline_depth", self.pipeline_depth, 1, MAX_PIPELINE_DEPTH, optional=True)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        check_int("block_size", self.block_size, 1)
        check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        if self.gpu_memory_utilization is not None:
            check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, lo_open=True)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_model_len", self.max_model_len, 2, optional=True)
        check_int("seed", self.seed)
        check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        check_int("cpu_threads", self.cpu_threads, 0, optional=True)
        check_int("max_logprobs", self.max_logprobs, -1)
        check_bool("enable_lora", self.enable_lora)
        check_int("max_loras", self.max_loras, 1)
        check_int("max_lora_rank", self.max_lora_rank, 1, MAX_LORA_RANK)
        check_int("max_cpu_loras", self.max_cpu_loras, 1, optional=True)

        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(
            self.discard_policy in ALL_POLICIES,
            f"discard_policy must be one of {sorted(ALL_POLICIES)}, got {self.discard_policy!r}",
        )
        if isinstance(self.faults, str) or not isinstance(self.faults, (tuple, list)):
            raise TypeError(f"faults must be a list of fault names, got {self.faults!r}")
        msgspec.structs.force_setattr(self, "faults", list(self.faults))  # equal after a round trip
        # A mapping (JSON, the tape header, the engine core process's setup) becomes the struct.
        transfer = weight_transfer_config(self.weight_transfer_config)
        msgspec.structs.force_setattr(self, "weight_transfer_config", transfer)
        for name in self.faults:
            need(
                isinstance(name, str) and name in FAULTS,
                f"unknown fault {name!r}; the faults are {sorted(FAULTS)}",
            )
        if self.worker_extension_cls is not None:
            check_str("worker_extension_cls", self.worker_extension_cls)
            parts = self.worker_extension_cls.split(".")
            need(
                len(parts) > 1 and all(part.isidentifier() for part in parts),
                "worker_extension_cls must name a class as module.Class, got "
                f"{self.worker_extension_cls!r}",
            )
        need(
            self.logprobs_mode in LOGPROBS_MODES,
            f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}",
        )
        need(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
        )
        if self.num_kv_blocks is not None:
            need(
                self.kv_capacity <= INT64_MAX,
                f"num_kv_blocks * block_size must be < 2**63, got {self.kv_capacity}",
            )
        need(
            self.max_num_batched_tokens >= 1 + self.num_speculative_tokens,
            "max_num_batched_tokens must leave room for one decode with its speculative tokens",
        )
        need(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            "need 1 <= prompt_lookup_min <= prompt_lookup_max",
        )

    @property
    def lora_capacity(self) -> int:
        """How many LoRA adapters may be loaded at once (0: LoRA is off)."""
        if not self.enable_lora:
            return 0
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)

    def check_runnable(self) -> None:
        """What tokentape's engine needs beyond a config a tape can hold: room in the KV cache
        for one sequence of max_model_len (vLLM's tests record schedulers with less)."""
        if self.num_kv_blocks is None:
            return  # sized from memory when the model is built; checked again then
        if self.max_model_len is not None and self.max_model_len > self.kv_capacity:
            raise ValueError(
                f"max_model_len must be in 2..{self.kv_capacity} (the KV capacity), "
                f"got {self.max_model_len}"
            )

    @property
    def kv_capacity(self) -> int:
        if self.num_kv_blocks is None:
            raise ValueError("num_kv_blocks is not known until the engine sizes its KV cache")
        return self.num_kv_blocks * self.block_size

    @property
    def effective_max_model_len(self) -> int:
        return self.max_model_len or self.kv_capacity

    @property
    def effective_pipeline_depth(self) -> int:
        """The steps in flight at once. A resolved config's pipeline_depth; unresolved fields
        read as the oracle's, and `async_scheduling=False` means 1 (tapes written before
        resolve_config settled both record a depth of 2 beside it)."""
        depth = DEFAULT_PIPELINE_DEPTH if self.pipeline_depth is None else self.pipeline_depth
        on = depth > 1 if self.async_scheduling is None else self.async_scheduling
        return depth if on else 1

    @property
    def is_resolved(self) -> bool:
        return None not in (self.num_kv_blocks, self.async_scheduling, self.pipeline_depth)


def resolve_config(config: EngineConfig, runner: ModelRunner) -> EngineConfig:
    """The config as the engine runs it, settled once for the runner built for it: the block
    count its KV pool has (sized from memory when the model was built: kv_cache_size.py), the
    scheduling mode, and max_model_len's default from the model; checked and logged as vLLM
    logs its KV capacity."""
    changes: dict[str, object] = {}
    if config.num_kv_blocks is None:
        changes["num_kv_blocks"] = getattr(runner, "num_kv_blocks", ORACLE_NUM_KV_BLOCKS)
    depth = _pipeline_depth(config, runner)
    changes["pipeline_depth"], changes["async_scheduling"] = depth, depth > 1
    config = msgspec.structs.replace(config, **changes)
    config = _with_model_max_len(config, runner)
    config.check_runnable()
    tokens, max_len = config.kv_capacity, config.effective_max_model_len
    _log.info(
        "KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx",
        f"{tokens:,}",
        f"{max_len:,}",
        tokens / max_len,
    )
    return config


def _pipeline_depth(config: EngineConfig, runner: ModelRunner) -> int:
    """async_scheduling, when not given, is off for a model on the CPU (as vLLM's CPU platform
    turns it off: there the engine thread takes a core from the model's threads, and sync
    measured as fast or faster: docs/benchmarks.md, the async / sync rows) unless a
    pipeline_depth > 1 asks for it, and on otherwise."""
    on = config.async_scheduling
    if on is None:
        asked = config.pipeline_depth is not None and config.pipeline_depth > 1
        device = getattr(runner, "device", None)  # a real model's; the oracle has none
        on = asked or not (device is not None and device.type == "cpu")
    if not on:
        return 1
    return DEFAULT_PIPELINE_DEPTH if config.pipeline_depth is None else config.pipeline_depth


def _with_model_max_len(config: EngineConfig, runner: ModelRunner) -> EngineConfig:
    """max_model_len defaulted as vLLM defaults it: the model's context length (its config's
    derived_max_model_len), capped, with a warning, at what the KV cache holds. One above the
    model's context length is refused. The oracle has no context length: its default stays
    the KV capacity."""
    if not isinstance(runner, HasModelConfig):
        return config
    derived = runner.config.derived_max_model_len
    source = runner.config.context_length_source
    if config.max_model_len is not None:
        if config.max_model_len > derived:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is greater than the model's "
                f"context length ({derived}: {source})"
            )
        return config
    capacity = config.kv_capacity
    if derived > capacity:
        _log.warning(
            "max_model_len %d: the model's context length is %d (%s), but the KV cache "
            "holds %d tokens (num_kv_blocks=%d x block_size=%d); raise num_kv_blocks, or "
            "give the cache more memory (kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE), to "
            "serve the whole context",
            capacity,
            derived,
            source,
            capacity,
            config.num_kv_blocks,
            config.block_size,
        )
    return msgspec.structs.replace(config, max_model_len=min(derived, capacity))
