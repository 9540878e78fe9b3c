"""The engine's command-line arguments, defined once (as vLLM's `EngineArgs.add_cli_args`):
`tokentape generate`, `tokentape serve` and `tokentape replay whatif` add the ones they take
to their parsers and read them back as the engine arguments of `LLM` / `AsyncLLM`. Each
flag is an `EngineConfig` field; its default is the config's unless the command says whose
default applies (whatif: the tape's)."""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tokentape.engine.config import LOGPROBS_MODES, EngineConfig
from tokentape.engine.model_registry import DEFAULT_MODEL, MODEL_HELP, is_oracle
from tokentape.engine.weight_transfer import parse_weight_transfer_config
from tokentape.events.discard import DISCARD_POLICIES


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum, with a one-line error otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def json_value(parse_text: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: a JSON value read by `parse_text`, with a one-line error otherwise."""

    def parse(text: str) -> Any:
        try:
            return parse_text(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


@dataclass(frozen=True, slots=True)
class _Flag:
    help: str
    minimum: int | None = None  # an integer flag; None: one of `choices`, or text without any
    metavar: str = "N"
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None  # a flag of JSON: its value as the engine takes it
    switch: bool = False  # a flag without a value: True when given


# By EngineConfig field, in the order --help lists them.
ENGINE_FLAGS: dict[str, _Flag] = {
    "pipeline_depth": _Flag(
        "steps in flight with async scheduling, which N > 1 turns on; 1 = synchronous", 1
    ),
    "num_speculative_tokens": _Flag("n-gram speculative tokens per decode", 0, "K"),
    "discard_policy": _Flag(
        "how stale frames are recognised after a preemption: epoch, the exact one; counter "
        "and flag reproduce vLLM's historical bugs",
        choices=tuple(DISCARD_POLICIES),
    ),
    "kv_cache_memory_bytes": _Flag("the KV cache's memory budget in bytes", 1, "BYTES"),
    "num_kv_blocks": _Flag("number of paged KV cache blocks, instead of the budget", 1),
    "block_size": _Flag("tokens per KV block", 1),
    "max_num_seqs": _Flag("most requests running at once", 1),
    "max_num_batched_tokens": _Flag("token budget of one step", 1),
    "max_model_len": _Flag("longest sequence", 1),
    "cpu_threads": _Flag("CPU threads the model runs on", 1),
    "enforce_eager": _Flag(
        "run every step eagerly on CUDA, without the decode steps' CUDA graphs (vLLM's option)",
        switch=True,
    ),
    "max_logprobs": _Flag(
        "the most log-probabilities a request may ask for per token (vLLM's option; -1: no "
        "limit but the vocabulary)",
        -1,
    ),
    "logprobs_mode": _Flag(
        "what the sampled tokens' logprobs hold (vLLM's option): raw_* of the model's logits, "
        "processed_* after the logits processors, temperature, min-p, top-k and top-p; "
        "*_logprobs the log-softmax, *_logits the values",
        choices=LOGPROBS_MODES,
    ),
    "worker_extension_cls": _Flag(
        "a class mixed into the worker (vLLM's option): collective_rpc calls its methods",
        metavar="MODULE.CLASS",
    ),
    "weight_transfer_config": _Flag(
        "the transport of update_weights(update_info) (vLLM's option), as JSON: "
        '\'{"backend": "shm"}\', shared memory on this machine (vLLM\'s nccl and ipc need GPUs)',
        metavar="JSON",
        parse=json_value(parse_weight_transfer_config),
    ),
    "enable_lora": _Flag("serve LoRA adapters per request (vLLM's option)", switch=True),
    "max_loras": _Flag("most different LoRA adapters in one step", 1),
    "max_lora_rank": _Flag("highest rank of a LoRA adapter", 1),
    "max_cpu_loras": _Flag("most LoRA adapters loaded at once", 1),
}
# The LoRA flags: for a server, which names its adapters (serve's --lora-modules).
LORA_FLAGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
_DEFAULTS = EngineConfig()
_NONE_DEFAULTS = {
    "pipeline_depth": "synchronous for a model on the CPU, 2 on CUDA and for the oracle",
    "kv_cache_memory_bytes": "VLLM_CPU_KVCACHE_SPACE GiB on the CPU, else 4 GiB or a quarter "
    "of the RAM; gpu_memory_utilization of the GPU on CUDA",
    "num_kv_blocks": "what the memory budget holds",
    "max_model_len": "the model's context length, capped at the KV capacity",
    "cpu_threads": "one per CPU",
    "worker_extension_cls": "none",
    "weight_transfer_config": "none: weights come as state_dicts or checkpoint folders",
    "enable_lora": "off",
    "enforce_eager": "off: CUDA graphs for decode steps on CUDA",
    "max_cpu_loras": "max_loras",
}


class UsageContext(enum.Enum):
    """What an engine is built for, as vLLM's: some engine arguments' defaults depend on it."""

    ENGINE_CONTEXT = "ENGINE_CONTEXT"  # AsyncLLM, LLMEngine: the engine's own defaults
    OPENAI_API_SERVER = "OPENAI_API_SERVER"  # `serve`: vLLM's server defaults on the CPU


# vLLM's defaults for its OpenAI-compatible server on the CPU (its EngineArgs' defaults for the
# usage context OPENAI_API_SERVER); an offline LLM, and a server on CUDA, keep the engine's.
# The smaller step budget serves a wave of prompts that arrive together in turns: the first of
# them get their first tokens after one short prefill step, not all of them after one long
# one (measured: docs/benchmarks.md, "Serving side by side with vllm serve").
SERVER_CPU_DEFAULTS: dict[str, int] = {"max_num_batched_tokens": 2048, "max_num_seqs": 128}
_SERVER_DEFAULT_HELP = {
    name: f"{value} for a model on the CPU, as vLLM's server; else {getattr(_DEFAULTS, name)}"
    for name, value in SERVER_CPU_DEFAULTS.items()
}


def add_engine_cli_args(
    parser: argparse.ArgumentParser,
    fields: Iterable[str] = tuple(ENGINE_FLAGS),
    *,
    model: bool = True,
    seed: bool = True,
    default_of: str | None = None,
    server: bool = False,
) -> None:
    """Add --model, --seed, --sync and the engine flags named by `fields`. `default_of`:
    whose default applies when a flag is not given (e.g. "the tape's"); the engine's by
    default, shown in each flag's help. `server`: the flags of a server, whose defaults on
    the CPU are vLLM's server's (create_engine_config)."""
    if model:
        parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model to serve: {MODEL_HELP}")
    if seed:
        parser.add_argument(
            "--seed",
            type=int,
            default=0,
            help="engine seed: keys the model's sampling and goes into the tape header "
            "(default: 0)",
        )
    fields = list(fields)
    group: Any = parser
    if "pipeline_depth" in fields and default_of is None:  # --sync is depth 1, without async
        group = parser.add_mutually_exclusive_group()
        group.add_argument(
            "--sync",
            action="store_true",
            help="synchronous scheduling: one step in flight at a time",
        )
    for name in fields:
        flag = ENGINE_FLAGS[name]
        if default_of is not None:
            default = f"default: {default_of}"
        elif server and name in _SERVER_DEFAULT_HELP:
            default = f"default: {_SERVER_DEFAULT_HELP[name]}"
        elif name in _NONE_DEFAULTS:
            default = f"default: {_NONE_DEFAULTS[name]}"
        else:
            default = f"engine default: {getattr(_DEFAULTS, name)}"
        option = "--" + name.replace("_", "-")
        where = group if name == "pipeline_depth" else parser
        if flag.switch:
            where.add_argument(
                option, action="store_true", default=None, help=f"{flag.help} ({default})"
            )
        elif flag.parse is not None:  # JSON
            where.add_argument(
                option,
                type=flag.parse,
                default=None,
                metavar=flag.metavar,
                help=f"{flag.help} ({default})",
            )
        elif flag.minimum is None and not flag.choices:  # free text
            where.add_argument(
                option, default=None, metavar=flag.metavar, help=f"{flag.help} ({default})"
            )
        elif flag.minimum is None:
            where.add_argument(
                option,
                choices=list(flag.choices),
                default=None,
                help=f"{flag.help} ({default})",
            )
        else:
            where.add_argument(
                option,
                type=int_at_least(flag.minimum),
                default=None,
                metavar=flag.metavar,
                help=f"{flag.help} ({default})",
            )


def engine_args_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the command line gave (LLM's / AsyncLLM's keyword arguments):
    the seed, async_scheduling=False for --sync, and every engine flag that was given."""
    kwargs: dict[str, Any] = {}
    if getattr(args, "seed", None) is not None:
        kwargs["seed"] = args.seed
    if getattr(args, "sync", False):
        kwargs["async_scheduling"] = False
    for name in ENGINE_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    return kwargs


def create_engine_config(
    model: str, engine_args: dict[str, Any], usage_context: UsageContext
) -> EngineConfig:
    """The config of `engine_args` (EngineConfig's fields) for `model`, made where the engine
    runs (vLLM's EngineArgs.create_engine_config): for a server of a model on the CPU, the
    arguments not given take vLLM's server defaults (SERVER_CPU_DEFAULTS); elsewhere, and for
    the oracle, which runs no model, the engine's. The device is the one the model would run
    on (its "auto": CUDA where torch sees a device), so the engine core, which loads torch
    anyway, asks, not a server's front end."""
    if usage_context is UsageContext.OPENAI_API_SERVER and not is_oracle(model):
        from tokentape.engine.runners.devices import resolve_device

        if resolve_device(engine_args.get("device", "auto")) == "cpu":
            engine_args = {**SERVER_CPU_DEFAULTS, **engine_args}
    return EngineConfig(model=model, **engine_args)
