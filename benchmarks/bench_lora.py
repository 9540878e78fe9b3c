"""LoRA's cost, side by side in one run: `LLM.generate` of the same batch on three engines of
the same model (`--model`, default the built-in tiny), each built once, at tokentape's
defaults otherwise:

- base: no LoRA (`enable_lora` off), the batch as is.
- lora-off: `enable_lora=True, max_loras=8` with the 8 adapters loaded, the batch with no
  LoRA request: what serving LoRA costs the requests that use none.
- lora-mixed: the same engine, the batch spread over the 8 adapters (request i runs with
  adapter i % 8): every step mixes them.

The adapters are PEFT folders of rank `--rank` (default 16) on all seven projections of
every layer, random A and B (`save_peft_adapter`). The batch: `--requests` (default 64)
prompts of `--prompt-len` tokens, `--max-tokens` each, ignore_eos. Each round runs every arm
once, in an order rotated every round, after a warm-up round (`--rounds`, default 5); per
arm, output tokens per second by the best round and the median, and each arm's ratio to
base.

    python benchmarks/bench_lora.py                        # tiny, 5 rounds, ~2 min
    python benchmarks/bench_lora.py --model qwen3-0.6b --rounds 2 --max-tokens 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import emit, machine_info, md_table  # noqa: E402

from tokentape import LLM, LoRARequest, SamplingParams  # noqa: E402
from tokentape.engine.model.model_config import BUILTIN_CONFIGS, ModelConfig  # noqa: E402
from tokentape.lora.peft_adapter import TARGET_MODULES, save_peft_adapter  # noqa: E402


def module_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every target projection's (in, out), by its place in a layer."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    return {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }


def write_adapters(folder: str, config: ModelConfig, count: int, rank: int) -> list[str]:
    paths = []
    shapes = module_shapes(config)
    assert {k.rsplit(".", 1)[-1] for k in shapes} == set(TARGET_MODULES)
    for n in range(count):
        gen = torch.Generator().manual_seed(n)
        weights = {}
        for layer in range(config.num_hidden_layers):
            for module, (n_in, n_out) in shapes.items():
                a = torch.randn(rank, n_in, generator=gen) / n_in**0.5
                b = torch.randn(n_out, rank, generator=gen) * 0.02
                weights[f"model.layers.{layer}.{module}"] = (a, b)
        path = os.path.join(folder, f"adapter{n}")
        save_peft_adapter(path, weights, lora_alpha=2 * rank)
        paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(BUILTIN_CONFIGS))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()

    config = BUILTIN_CONFIGS[args.model]
    folder = tempfile.mkdtemp(prefix="bench_lora_")
    paths = write_adapters(folder, config, args.adapters, args.rank)
    loras = [LoRARequest(f"a{n}", n + 1, path) for n, path in enumerate(paths)]
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, config.vocab_size, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    mixed = [loras[i % len(loras)] for i in range(args.requests)]

    base = LLM(args.model, tape=None)
    lora_llm = LLM(
        args.model,
        tape=None,
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
    )
    for lora in loras:
        lora_llm.llm_engine.add_lora(lora)
    arms = {
        "base": lambda: base.generate(prompts, params, use_tqdm=False),
        "lora-off": lambda: lora_llm.generate(prompts, params, use_tqdm=False),
        "lora-mixed": lambda: lora_llm.generate(
            prompts, params, use_tqdm=False, lora_request=mixed
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for round_ in range(args.rounds + 1):  # the first is the warm-up
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            start = time.perf_counter()
            outs = arms[name]()
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert tokens == args.requests * args.max_tokens
            if round_:
                rates[name].append(tokens / seconds)
        # Prefix caching would serve later rounds' prompts from the cache: the same work
        # each round instead.
        base.reset_prefix_cache()
        lora_llm.reset_prefix_cache()
    base.close()
    lora_llm.close()

    best = {name: max(r) for name, r in rates.items()}
    median = {name: statistics.median(r) for name, r in rates.items()}
    rows = [
        [
            name,
            f"{best[name]:,.0f}",
            f"{median[name]:,.0f}",
            f"{best[name] / best['base']:.3f}",
            f"{median[name] / median['base']:.3f}",
        ]
        for name in names
    ]
    markdown = (
        f"LoRA on {args.model}: {args.requests} requests of {args.prompt_len} prompt tokens and "
        f"{args.max_tokens} output tokens; {args.adapters} adapters of rank {args.rank} on all "
        f"seven projections; {args.rounds} rounds\n\n"
        + md_table(["arm", "out tok/s best", "median", "/ base (best)", "/ base (median)"], rows)
    )
    results = {
        "machine": machine_info(),
        "args": vars(args),
        "tok_per_s": rates,
        "ratio_best": {n: best[n] / best["base"] for n in names},
        "ratio_median": {n: median[n] / median["base"] for n in names},
    }
    emit(results, markdown, args.json)


if __name__ == "__main__":
    main()
