"""Side script: Hugging Face transformers' `generate` at its best settings, timed per round.

Runs in any Python with transformers and torch (never imports tokentape), in its own
process so that nothing of tokentape's changes its torch thread count: it runs on torch's
default (one thread per core) unless the spec names a count. The checkpoint folder loads
with `from_pretrained`, float32.

Every output length is known, so requests are sorted by output length (then prompt length)
and batched in that order, each batch left-padded with an attention mask and run greedily
with `max_new_tokens = min_new_tokens =` its longest request; only the requested tokens count
and are returned, in the workload's order.

Spec: {"model", "dtype", "prompts": [[int]], "max_tokens": [int], "pad_token_id",
"threads": int | null}.
Command `round` (args: batch_size, tokens: bool) -> seconds, output_tokens, cpu_s
({"transformers": CPU seconds of this process}), tokens if asked.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import sideserver


def setup(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, sideserver.Handler]]:
    import torch
    import transformers

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    threads = torch.get_num_threads()
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_arg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model"], **{dtype_arg: getattr(torch, spec["dtype"])}
    ).eval()
    prompts: list[list[int]] = spec["prompts"]
    max_tokens: list[int] = spec["max_tokens"]
    pad: int = spec["pad_token_id"]
    order = sorted(range(len(prompts)), key=lambda i: (max_tokens[i], len(prompts[i])))

    def generate(batch: list[int], tokens: dict[int, list[int]]) -> None:
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch])
        mask = torch.tensor(
            [[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch]
        )
        new = max(max_tokens[i] for i in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None,
            )
        for row, i in enumerate(batch):
            tokens[i] = out[row, width : width + max_tokens[i]].tolist()

    generate(order[:2], {})  # warm-up

    def round_(args: dict[str, Any]) -> dict[str, Any]:
        size: int = args["batch_size"]
        tokens: dict[int, list[int]] = {}
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        for start in range(0, len(order), size):
            generate(order[start : start + size], tokens)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        reply: dict[str, Any] = {
            "seconds": seconds,
            "output_tokens": sum(max_tokens),
            "cpu_s": {"transformers": cpu},
        }
        if args.get("tokens"):
            reply["tokens"] = [tokens[i] for i in range(len(prompts))]
        return reply

    info = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": threads,
    }
    return info, {"round": round_}


if __name__ == "__main__":
    raise SystemExit(sideserver.run(setup))
